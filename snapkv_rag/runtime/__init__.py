"""Running the model: the attention hooks, the runner (prefill, decode step), lookahead's draft, on-device
sampling, the continuous-batching scheduler and the tickets callers wait on."""
