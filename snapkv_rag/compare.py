"""Several compression methods on one prompt from ONE shared prefill (what the evals run).

Every method's cache is filled by the same prefill (its computation does not depend on what a
cache keeps), so only decoding is repeated, and each method's result is what ``generate`` with
that method returns. With ``hit_rate``, the full cache is decoded first while recording the
attention its decode steps pay to the prompt; each method then gets the share of those
most-attended positions that it kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from . import cited, compression
from .cache import AttentionLayer, KVCache
from .generation import Batch, Runner, SamplingOptions, prefill
from .results import GenerationResult, build_result
from .text import Request, decode_text

FULL = "\0full"  # the recording full cache's name (not a name a caller can give)


@dataclass
class Comparison:
    """What :func:`compare` returns: one result per method, from one shared prefill."""

    results: dict[str, GenerationResult]
    hit_rate: dict[str, float]
    prefill_s: float

    def __repr__(self) -> str:
        """One line per method (answer, kept tokens, decode speed, hit rate); documents not repeated."""
        lines = [f"Comparison(prefill {self.prefill_s:.2f} s, shared by {len(self.results)} methods)"]
        for name, r in self.results.items():
            text = r.text if len(r.text) <= 60 else r.text[:57] + "..."
            rate = f", hit rate {self.hit_rate[name]:.2f}" if name in self.hit_rate else ""
            lines.append(f"  {name}: {text!r}, kept {max(r.compression.kept_tokens, default=0)}/"
                         f"{r.compression.prompt_tokens}, {r.timings.decode_ms_per_token:.1f} ms/token{rate}")
        return "\n".join(lines)


def kept_positions(cache: KVCache, row: int = 0) -> dict[int, torch.Tensor]:
    """Per attention layer, the prompt positions ``[1, H_kv, n]`` a cache holds for ``row``."""
    kept = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, AttentionLayer):
            held = layer.positions[row:row + 1, :, : layer.prompt_slots]
            kept[i] = held[..., (held[0, 0] >= 0)]
    return kept


def attention_hit_rate(decode_attention: dict[int, torch.Tensor], kept: dict[int, torch.Tensor]) -> float:
    """Share of the prompt positions most attended by the full cache's decode steps that a method
    kept, averaged over layers and KV heads (the top-k, k = the number the method kept there)."""
    rates = []
    for layer, positions in kept.items():
        attention = decode_attention.get(layer)
        if attention is None:
            continue
        k = positions.shape[-1]
        if k >= attention.shape[-1]:
            rates.append(1.0)
            continue
        top = attention.topk(k, dim=-1).indices
        hit = torch.zeros_like(attention, dtype=torch.bool).scatter(-1, positions, True).gather(-1, top)
        rates.append(hit.float().mean().item())
    return sum(rates) / len(rates) if rates else 1.0


class _Recorder:
    """Accumulates, per layer, the attention each decode step of the full cache pays to each prompt
    position ``[1, H_kv, L]`` (the layer's own scale, soft-cap and sinks)."""

    def __init__(self, cache: KVCache, prompt_tokens: int):
        self.cache, self.length = cache, prompt_tokens
        self.totals: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx, query, keys, scoring) -> None:
        begin = time.perf_counter()
        layer = self.cache.layers[layer_idx]
        slots = layer.prompt_slots
        probs = compression.attention_probs(query[..., -1:, :], keys, None, **scoring.as_kwargs())
        probs = probs.sum(dim=-2).mean(dim=2)[..., :slots]  # [1, H_kv, slots]
        if probs.shape[1] != layer.positions.shape[1]:  # latent attention: one latent for all heads
            probs = probs.mean(dim=1, keepdim=True)
        where = layer.positions[:, :, :slots].clamp(min=0)
        total = torch.zeros((*probs.shape[:2], self.length), dtype=probs.dtype, device=probs.device)
        total.scatter_add_(-1, where, probs * (layer.positions[:, :, :slots] >= 0))
        self.totals[layer_idx] = total if layer_idx not in self.totals else self.totals[layer_idx] + total
        self.cache.record_s += time.perf_counter() - begin


def compare(runner: Runner, tokenizer, request: Request, methods: Mapping[str, Any], options: SamplingOptions,
            stop: Sequence[str] = (), hit_rate: bool = True) -> Comparison:
    """``methods`` maps a name to a config (``None`` for the full cache)."""
    full_names = [name for name, config in methods.items() if config is None]
    record = hit_rate and len(full_names) < len(methods)
    caches = {FULL: None, **methods} if record and not full_names else dict(methods)
    full_name = FULL if FULL in caches else (full_names[0] if full_names else None)
    pre = prefill(runner, Batch.of([request.input_ids], runner.pad_id, runner.device), caches,
                  room=options.max_new_tokens)
    prompt_tokens = len(request.input_ids)
    recorder = _Recorder(pre.caches[full_name], prompt_tokens) if record else None
    results: dict[str, GenerationResult] = {}
    order = ([full_name] if full_name is not None else []) + [n for n in methods if n not in full_names]
    for name in order:
        pre.caches[name].recorder = recorder if name == full_name else None
        constraint = request.constraint and request.constraint.fresh()  # each method starts the grammar afresh
        rows = _drain(decode_text(runner, tokenizer, pre, name, options, stop, [constraint]))
        pre.caches[name].recorder = None
        results[name] = cited.finish(build_result(rows[0], request.documents, prompt_tokens, pre.caches[name], 0,
                                                  pre.prefill_s, pre.selection_ms(name)), constraint, request.cite)
    for name in full_names:
        results[name] = results[full_name]
    rates = {name: attention_hit_rate(recorder.totals, kept_positions(pre.caches[name]))
             for name, config in methods.items() if config is not None} if record else {}
    return Comparison(results={name: results[name] for name in methods}, hit_rate=rates, prefill_s=pre.prefill_s)


def _drain(events):
    """Run a text generator to its return value."""
    while True:
        try:
            next(events)
        except StopIteration as stop:
            return stop.value
