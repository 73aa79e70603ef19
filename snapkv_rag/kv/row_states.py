"""Per-row recurrent and conv states of the slot cache: what lets rows of hybrid models decode together.

A layer with a fixed-size state (the conv and SSM states of Mamba / Mamba-2 layers, Qwen3-Next's and
Kimi-Linear's gated delta net, LFM2's short convolutions, the Mamba half of a Falcon-H1 / Zamba
hybrid layer) keeps it in transformers' ``LinearAttentionLayer`` fields: ``conv_states[i]`` and
``recurrent_states[i]``, one tensor ``[batch, ...]`` per state index ``i``. Here each of those tensors
is one buffer of ``rows`` rows, allocated when the first request joins (and grown with the slot
cache's row bucket, the rows in use copied once):

- a request joins by having its prompt's final states (batch 1) written into its row, nothing else;
- a request leaves by metadata only: its row's state is overwritten by the next request there;
- a step over rows ``[0, b)`` points the layer's fields at the views ``buffer[:b]`` (:meth:`RowStates.bind`);
  transformers' decode path updates states in place (``causal_conv1d_update``'s ``conv_state.copy_``,
  ``selective_state_update``'s ``state.copy_``, ``update_conv_state`` / ``update_recurrent_state``'s
  ``copy_``), so each row's new state lands in its own row of the buffer.

Decode steps feed one real token per row (prompts are prefilled alone, never padded to each other),
so no row's padding goes through another row's conv or scan; a row of the bucket that holds no request
updates only its own (ignored) row.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

_FIELDS = ("conv_states", "recurrent_states")


class StateLayer(LinearAttentionLayer):
    """A recurrent / conv layer of the slot cache: transformers' state layer whose state fields are
    views of the batch's rows of :class:`RowStates` buffers (set by :meth:`RowStates.bind`)."""


class RowStates:
    """The state buffers of every state layer of a model, per row. ``layers`` maps a layer index to its
    slot cache layer (a :class:`StateLayer` or a hybrid slot layer: both ``LinearAttentionLayer``)."""

    def __init__(self, layers: dict[int, LinearAttentionLayer]):
        self.layers = layers
        self.rows = 0
        # layer -> field name -> state index -> buffer [rows, ...] (None: the layer has no such state)
        self.buffers: dict[int, dict[str, dict[int, torch.Tensor | None]]] = {}

    def reserve(self, rows: int, states: dict[int, LinearAttentionLayer]) -> None:
        """Buffers of ``rows`` rows, shaped like the joining request's ``states`` (layer -> its state
        after the prompt); grown (the rows in use copied once) when they hold fewer rows."""
        if rows <= self.rows and self.buffers:
            return
        with torch.inference_mode():
            for i, state in states.items():
                old = self.buffers.get(i)
                per_field = {}
                for name in _FIELDS:
                    per_field[name] = {}
                    for n, tensor in getattr(state, name).items():
                        if tensor is None:
                            per_field[name][n] = None
                            continue
                        buffer = tensor.new_zeros((rows, *tensor.shape[1:]))
                        if old is not None and old[name].get(n) is not None:
                            buffer[: self.rows] = old[name][n][: self.rows]
                        per_field[name][n] = buffer
                self.buffers[i] = per_field
                _flags(self.layers[i], state)
        for buffer in self._tensors():
            if buffer.is_cuda:  # written in place by every step: fixed addresses
                torch._dynamo.mark_static_address(buffer, guard=False)
        self.rows = rows

    def write(self, row: int, states: dict[int, LinearAttentionLayer]) -> None:
        """Write the joining request's ``states`` (layer -> its batch-1 state) into ``row``."""
        if set(states) != set(self.layers):
            raise ValueError(
                f"row states: the request carries states for layers {sorted(states)}, the cache "
                f"holds layers {sorted(self.layers)}"
            )
        with torch.inference_mode():
            for i, state in states.items():
                for name in _FIELDS:
                    for n, tensor in getattr(state, name).items():
                        buffer = self.buffers[i][name].get(n)
                        if (tensor is None) != (buffer is None):
                            raise ValueError(
                                f"row states: layer {i} {name}[{n}] is "
                                f"{'missing' if tensor is None else 'unexpected'} in the joining request"
                            )
                        if tensor is not None:
                            buffer[row].copy_(tensor[0])

    def bind(self, b: int) -> None:
        """Point every state layer's fields at rows ``[0, b)`` of its buffers (views: in-place updates
        by the model land in the buffers)."""
        for i, per_field in self.buffers.items():
            layer = self.layers[i]
            for name in _FIELDS:
                target = getattr(layer, name)
                for n, buffer in per_field[name].items():
                    target[n] = None if buffer is None else buffer[:b]

    def release(self) -> None:
        """Give the buffers back (the last row left)."""
        self.buffers, self.rows = {}, 0
        for layer in self.layers.values():
            for name in _FIELDS:
                getattr(layer, name).update(dict.fromkeys(getattr(layer, name)))

    def _tensors(self):
        return (
            t for per_field in self.buffers.values() for d in per_field.values() for t in d.values() if t is not None
        )


def state_bytes(states: dict[int, LinearAttentionLayer]) -> int:
    """The bytes one request's conv / SSM ``states`` (layer -> its batch-1 state) take: one row of the
    buffers, whatever the prompt's length."""
    return sum(
        t.numel() * t.element_size()
        for state in states.values()
        for name in _FIELDS
        for t in getattr(state, name).values()
        if t is not None
    )


def _flags(target: LinearAttentionLayer, source: LinearAttentionLayer) -> None:
    """The joining state's flags (initialised, has a previous state, kernel size, dtype and device):
    the model's decode path reads them to take its one-token branch."""
    for name in (
        "is_conv_states_initialized",
        "is_recurrent_states_initialized",
        "has_previous_state",
        "conv_kernel_size",
    ):
        setattr(target, name, dict(getattr(source, name)))
    target.dtype, target.device = source.dtype, source.device
