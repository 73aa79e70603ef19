"""Lookahead SnapKV (:class:`~snapkv_rag.config.LookaheadSnapKVConfig`): the observation window
reaches into the answer.

SnapKV's votes come from the prompt's last queries: the instruction and the question, which ask
for the answer but are not the answer. The queries that will actually read the cache are those
of the answer's tokens. So, before compressing, the model drafts the first ``lookahead`` tokens
of its greedy answer over the full prompt cache, and their queries vote beside the prompt's
window. The draft is then dropped: the answer is decoded from the compressed cache like any
method's (its first token from the prompt's own logits), so only the selection differs.

The request path, top to bottom (:func:`prefill`):

1. the prompt runs once, compressed under the other methods of the call, its whole K/V and last
   queries kept in a :class:`~snapkv_rag.prefix_cache.Capture` (and its recurrent states copied);
2. :func:`draft_and_vote`: greedy tokens over that whole prompt, one decode step each (each
   step's K/V joining what the next sees), the step of the last one selecting every attention
   layer by :func:`select_layer` from the prompt's window and the draft's queries together.

A layer keeps what head-adaptive SnapKV keeps on the prompt with the draft appended, its window
widened by the draft and its budget by as many slots, less the draft's own positions: the same
``capacity`` prompt positions per head on average. Sliding-window layers vote with the prompt's
window alone (the draft sits beyond what their share of the prompt ends at).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping

import torch

from . import tails
from .cache import Compressed, LayerKV, PromptCache, Scoring, compress_layer
from .config import AdaSnapKVConfig, KVzipConfig, LookaheadSnapKVConfig
from .prefix_cache import Capture, Prefix, PrefixLayer

WHOLE = "\0whole"
"""The internal name of the full cache a call without any other method still needs for its prefill."""


def prefill(runner, prompts: list[list[int]], methods: Mapping[str, Any]):
    """``Runner.prefill`` for a call with lookahead methods: the ``Prefilled`` of the other methods
    with the lookahead ones' compressed caches added (their selection time includes the draft)."""
    if len(prompts) != 1:
        raise ValueError("lookahead: one prompt per prefill (its draft follows its own prompt)")
    ahead = {name: m for name, m in methods.items() if isinstance(m, LookaheadSnapKVConfig)}
    others = {name: m for name, m in methods.items() if name not in ahead} or {WHOLE: None}
    prompt = prompts[0]
    # the prompt's own K/V tensors, not copies: a full cache holds them anyway, and no pass writes into them
    whole = Capture(len(prompt), max_bytes=1 << 62, queries=max(m.window_size for m in ahead.values()), own=False)
    if any(isinstance(m, KVzipConfig) for m in others.values()):  # its pass runs the re-read on: a second one
        first = runner.prefill(prompts, others)
        base = runner.prefill(prompts, {WHOLE: None}, whole=whole)
        first = dataclasses.replace(first, compressed={**first.compressed, WHOLE: base.compressed[WHOLE]},
                                    prefill_s=first.prefill_s + base.prefill_s)
    else:
        first = runner.prefill(prompts, others, whole=whole)
    begin = time.perf_counter()
    kept = first.compressed[WHOLE][0] if WHOLE in first.compressed else next(iter(first.compressed.values()))[0]
    prefix = whole.prefix(prompt, len(runner.specs), tails.held_states(kept.layers))
    _, out = draft_and_vote(runner, prefix, int(first.logits[0].argmax()), max(m.lookahead for m in ahead.values()), ahead)
    spent = time.perf_counter() - begin
    compressed = {name: rows for name, rows in first.compressed.items() if name != WHOLE}
    for name, rows in out.items():
        rows[0].selection_s = spent
        compressed[name] = rows
    return dataclasses.replace(first, compressed=compressed, prefill_s=first.prefill_s + spent)


def draft_and_vote(runner, prefix: Prefix, first: int, count: int, methods: Mapping[str, LookaheadSnapKVConfig]
                   ) -> tuple[list[int], dict[str, list[Compressed]]]:
    """The model's greedy answer over the whole prompt ``prefix``, from its ``first`` token: at most
    ``count`` tokens, ending early at an end-of-sequence token. One token per step, each step's K/V
    joining what the next one sees (a decode step over the full prompt); the step of the last
    drafted token selects every attention layer under every method by :func:`select_layer`, from
    the prompt's window and the draft's queries. The recurrent layers step copies of the prompt's
    states; the kept cache gets the states after the prompt, not after the draft.
    Returns the drafted tokens and, per method, its compressed cache."""
    specs, length = runner.specs, prefix.length
    cache = tails.with_states(PromptCache(runner.model.config, specs, prefix), prefix.states)
    out = {name: [Compressed(m, specs, [None] * len(specs), length)] for name, m in methods.items()}
    queries: list[list[torch.Tensor]] = [[] for _ in specs]  # per layer, the draft's queries so far
    tokens, last = [first], [False]

    def hook(layer_idx: int, query: torch.Tensor, vote_keys: torch.Tensor, scoring: Scoring) -> None:
        layer = cache.layers[layer_idx]
        keys, values = layer.pending
        queries[layer_idx].append(query)
        layer.pending = None
        if not last[0]:  # the next step runs over the prompt and the draft so far
            layer.prefix, layer.prefix_length = PrefixLayer(keys, values, prefix.layers[layer_idx].queries), length + len(tokens)
            return
        query = torch.cat([prefix.layers[layer_idx].queries, *queries[layer_idx]], dim=-2)  # the window, then the draft
        for name, method in methods.items():
            out[name][0].layers[layer_idx] = select_layer(method, layer.spec, layer_idx, len(specs), query, keys, values,
                                                          vote_keys, scoring, length, min(len(tokens), method.lookahead))
        layer.done = True

    cache.compress = hook
    with runner.lock, torch.inference_mode(), runner._sliced():
        while True:
            last[0] = len(tokens) == count or tokens[-1] in runner.eos_ids
            at = length + len(tokens) - 1
            logits = runner._forward(torch.tensor([[tokens[-1]]], device=runner.device), None,
                                     torch.tensor([[at]], device=runner.device), cache)
            if last[0]:
                break
            tokens.append(int(logits[0].argmax()))
    for (kept,) in out.values():  # the states after the prompt, not after the draft
        tails.place_states(kept.layers, prefix.states, copies=True)
    return tokens, out


def select_layer(method: LookaheadSnapKVConfig, spec, layer_idx: int, num_layers: int, query: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor, vote_keys: torch.Tensor, scoring: Scoring, length: int,
                 drafted: int) -> LayerKV:
    """One attention layer of a ``length``-token prompt with a draft after it (``keys``/``values``
    over both; ``query`` the prompt's last queries, then the draft's): head-adaptive SnapKV over the
    prompt and the draft's first ``drafted`` tokens, its window and its budget widened by them, their
    positions then dropped. A sliding layer: head-adaptive SnapKV over the prompt alone."""
    total = keys.shape[-2]
    extra = total - length  # drafted positions in the pass
    if spec.window is not None:  # a sliding layer: its share ends with the prompt
        q = query[..., : query.shape[-2] - extra, :]
        return compress_layer(_ada(method, layer_idx, num_layers, 0), spec, layer_idx, num_layers, q, keys[..., :length, :],
                              values[..., :length, :], vote_keys[..., :length, :], scoring, [length])[0]
    cut = total - (extra - drafted)  # the votes come from the first ``drafted`` tokens
    q = query[..., : query.shape[-2] - (extra - drafted), :]
    kv = compress_layer(_ada(method, layer_idx, num_layers, drafted), spec, layer_idx, num_layers, q,
                        keys[..., :cut, :], values[..., :cut, :], vote_keys[..., :cut, :], scoring, [cut])[0]
    keep = kv.slots - drafted  # the window is always kept: the draft's positions are each head's last
    return LayerKV(kv.keys[..., :keep, :], kv.values[..., :keep, :], kv.positions[..., :keep])


def _ada(method: LookaheadSnapKVConfig, layer_idx: int, num_layers: int, drafted: int) -> AdaSnapKVConfig:
    """The head-adaptive SnapKV that selects a layer: window and budget widened by ``drafted``."""
    return AdaSnapKVConfig(max_capacity_prompt=method.budget_for_layer(layer_idx, num_layers) + drafted,
                           window_size=method.window_size + drafted, kernel_size=method.kernel_size,
                           pooling=method.pooling, floor=method.floor)
