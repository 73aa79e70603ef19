"""Several compression methods on one prompt from ONE shared prefill (what the evals run).

Every method's cache is filled by the same prefill (its computation does not depend on what a
cache keeps); each method's compressed cache then joins the engine's decode batch as an already
prefilled request and decodes through the scheduler's one loop (one after another, so that each
method's decode ms/token is its own; with ``together``, as rows of one batch), and each result is
what ``generate`` with that method returns. With ``hit_rate``, the full cache's row
records the attention its decode steps pay to the prompt (that batch then runs eagerly); each
method gets the share of those most-attended positions that it kept.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kv.slot_cache import SlotCache
from ..methods import selection as compression
from ..request import cited
from ..request.results import GenerationResult, Timings, finish_result
from ..request.text import Request
from .sampling import SamplingOptions
from .scheduler import Outcome, Scheduler

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
            lines.append(
                f"  {name}: {text!r}, kept {max(r.compression.kept_tokens, default=0)}/"
                f"{r.compression.prompt_tokens}, {r.timings.decode_ms_per_token:.1f} ms/token{rate}"
            )
        return "\n".join(lines)


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
        held = positions >= 0  # head-adaptive methods leave some heads' slots empty (-1)
        counts = held.sum(-1, keepdim=True)  # [1, H_kv, 1]: each head's own k
        top = attention.topk(k, dim=-1).indices
        kept = torch.zeros_like(attention, dtype=torch.long).scatter_add(-1, positions.clamp(min=0), held.long()) > 0
        ranked = torch.arange(k, device=top.device) < counts
        rates.append(((kept.gather(-1, top) & ranked).sum() / ranked.sum()).item())
    return sum(rates) / len(rates) if rates else 1.0


class _Recorder:
    """Accumulates, per layer, the attention each decode step of the full cache's row pays to each
    prompt position ``[1, H_kv, L]`` (the layer's own scale, soft-cap and sinks). Eager only: it
    reads the step's tensors on the host's schedule."""

    def __init__(self, prompt_tokens: int):
        self.length = prompt_tokens
        self.totals: dict[int, torch.Tensor] = {}
        self.slots: SlotCache | None = None
        self.row = 0

    def bind(self, slots: SlotCache, row: int) -> None:
        """The recorded request now decodes in ``row`` of ``slots``."""
        self.slots, self.row = slots, row
        slots.recorder = self

    def __call__(self, layer_idx, query, keys, scoring) -> None:
        begin = time.perf_counter()
        layer, r = self.slots.layers[layer_idx], slice(self.row, self.row + 1)
        valid = self.slots.masks[layer.index][r, 0, 0]  # [1, S]: the slots this row attends to
        probs = compression.attention_probs(query[r, :, -1:, :], keys[r], valid, **scoring.as_kwargs())
        probs = probs.sum(dim=-2).mean(dim=2)  # [1, H_kv, S]
        positions = self.slots.positions[layer.index, r, :, : valid.shape[-1]]  # the step's view of the row
        if probs.shape[1] != positions.shape[1]:  # latent attention: one latent for all heads
            probs = probs.mean(dim=1, keepdim=True)
            positions = positions[:, :1]
        prompt = (positions >= 0) & (positions < self.length)
        total = torch.zeros((*probs.shape[:2], self.length), dtype=probs.dtype, device=probs.device)
        total.scatter_add_(-1, positions.clamp(0, self.length - 1), probs * prompt)
        self.totals[layer_idx] = total if layer_idx not in self.totals else self.totals[layer_idx] + total
        self.slots.record_s += time.perf_counter() - begin


def compare(
    scheduler: Scheduler,
    request: Request,
    methods: Mapping[str, Any],
    options: SamplingOptions,
    stop: Sequence[str] = (),
    hit_rate: bool = True,
    together: bool = False,
) -> Comparison:
    """``methods`` maps a name to a config (``None`` for the full cache); ``together``: the methods
    decode as rows of one batch (else one after another, each with its own decode timings)."""
    if options.n != 1:
        raise ValueError(f"n: compare gives one answer per method, got n={options.n}; call generate with n per method")
    if request.stored is not None:
        raise ValueError(
            "documents: compare runs every method over the documents themselves; pass the documents, "
            "not a document handle (its cache was compressed once, with one method)"
        )
    full_names = [name for name, config in methods.items() if config is None]
    record = hit_rate and len(full_names) < len(methods)
    caches = {FULL: None, **methods} if record and not full_names else dict(methods)
    full_name = FULL if FULL in caches else (full_names[0] if full_names else None)
    order = ([full_name] if full_name is not None else []) + [
        n for n in caches if n != full_name and n not in full_names
    ]
    prompt_tokens = len(request.input_ids)
    recorder = _Recorder(prompt_tokens) if record else None
    # each method starts the grammar afresh
    requests = {
        name: dataclasses.replace(request, constraint=request.constraint and request.constraint.fresh())
        for name in order
    }
    tickets = scheduler.submit_group(
        requests,
        {name: caches[name] for name in order},
        options,
        list(stop),
        {full_name: recorder} if record else None,
        together,
    )
    results, kept, prefill_s = _collect(tickets, requests, request, prompt_tokens)
    for name in full_names:
        results[name] = results[full_name]
    rates = {}
    if record:
        rates = {
            name: attention_hit_rate(recorder.totals, kept[name])
            for name, config in methods.items()
            if config is not None
        }
    return Comparison(results={name: results[name] for name in methods}, hit_rate=rates, prefill_s=prefill_s)


def _collect(tickets: Mapping, requests: Mapping[str, Request], request: Request, prompt_tokens: int):
    """Each method's finished result, the prompt positions it kept, and the prefill time; every
    ticket is cancelled on the way out, so an error in one leaves no row decoding."""
    results: dict[str, GenerationResult] = {}
    kept: dict[str, dict[int, torch.Tensor]] = {}
    prefill_s = 0.0
    try:
        for name, ticket in tickets.items():
            outcome = next(item for item in ticket if isinstance(item, Outcome))
            prefill_s, kept[name] = outcome.prefill_s, outcome.kept_positions
            timings = Timings(prefill_s=outcome.prefill_s, decode_ms_per_token=0.0, batch_size=outcome.batch_size)
            results[name] = cited.finish(
                finish_result(outcome.row, request.documents, prompt_tokens, outcome.compression, timings),
                requests[name].constraint,
                request.cite,
            )
            results[name].usage.cached_tokens = outcome.cached_tokens
    finally:
        for ticket in tickets.values():
            ticket.cancel()
    return results, kept, prefill_s
