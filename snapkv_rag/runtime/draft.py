"""Lookahead SnapKV (:class:`~snapkv_rag.methods.LookaheadSnapKVConfig`): the observation window
reaches into the answer.

SnapKV's votes come from the prompt's last queries: the instruction and the question, which ask
for the answer but are not the answer. The queries that will actually read the cache are those
of the answer's tokens. So, before compressing, the model drafts the first ``lookahead`` tokens
of its greedy answer over the full prompt cache, and their queries vote beside the prompt's
window. The draft is then dropped: the answer is decoded from the compressed cache like any
method's (its first token from the prompt's own logits), so only the selection differs.

The request path, top to bottom (:func:`prefill`):

1. the prompt runs once, compressed under the other methods of the call, its whole K/V and last
   queries kept in a :class:`~snapkv_rag.kv.prefix_cache.Capture` (and its recurrent states copied);
2. :func:`draft_and_vote`: greedy tokens over that whole prompt, each pass's K/V joining what the
   next sees; a pass runs the next token and a guess at those after it (:func:`guess`), keeping the
   guessed tokens the pass itself predicts, so that a copied phrase costs one pass, not one per
   token; then every attention layer is selected by :func:`select_layer` from the prompt's window
   and the draft's queries together.

A layer keeps what head-adaptive SnapKV keeps on the prompt with the draft appended, its window
widened by the draft and its budget by as many slots, less the draft's own positions: the same
``capacity`` prompt positions per head on average. Sliding-window layers vote with the prompt's
window alone (the draft sits beyond what their share of the prompt ends at).
"""

from __future__ import annotations

import collections
import dataclasses
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..kv import tails
from ..kv.prefix_cache import Capture, Prefix, PrefixLayer
from ..kv.prompt_cache import Compressed, LayerKV, PromptCache, Scoring, compress_layer
from ..methods import AdaSnapKVConfig, LookaheadSnapKVConfig

WHOLE = "\0whole"
"""The internal name of the full cache a call without any other method still needs for its prefill."""
PAST_DRAFTS: weakref.WeakKeyDictionary[Any, collections.deque] = weakref.WeakKeyDictionary()
"""Per runner its last 64 drafts, where :func:`guess` looks after the prompt (only speed depends on them)."""


def prefill(runner, prompts: list[list[int]], methods: Mapping[str, Any]):
    """``Runner.prefill`` for a call with lookahead methods: the ``Prefilled`` of the other methods
    with the lookahead ones' compressed caches added (their selection time includes the draft)."""
    if len(prompts) != 1:
        raise ValueError("lookahead: one prompt per prefill (its draft follows its own prompt)")
    whole = kept_whole(methods, len(prompts[0]))
    if whole:  # kept whole, nothing is selected: no draft, the full cache under the method's name
        out = runner.prefill(prompts, {name: None if name in whole else m for name, m in methods.items()})
        for name in whole:
            for compressed in out.compressed[name]:
                compressed.method = methods[name]
        return out
    ahead = {name: m for name, m in methods.items() if m is not None and m.drafts}
    others = {name: m for name, m in methods.items() if name not in ahead} or {WHOLE: None}
    prompt = prompts[0]
    # the prompt's own K/V tensors, not copies: a full cache holds them anyway, and no pass writes into them
    whole = Capture(len(prompt), max_bytes=1 << 62, queries=max(m.window_size for m in ahead.values()), own=False)
    if any(m is not None and m.rereads for m in others.values()):  # its pass runs the re-read on: a second one
        first = runner.prefill(prompts, others)
        base = runner.prefill(prompts, {WHOLE: None}, whole=whole)
        first = dataclasses.replace(
            first,
            compressed={**first.compressed, WHOLE: base.compressed[WHOLE]},
            prefill_s=first.prefill_s + base.prefill_s,
        )
    else:
        first = runner.prefill(prompts, others, whole=whole)
    begin = time.perf_counter()
    kept = first.compressed[WHOLE][0] if WHOLE in first.compressed else next(iter(first.compressed.values()))[0]
    prefix = whole.prefix(prompt, len(runner.specs), tails.held_states(kept.layers))
    _, out = draft_and_vote(
        runner, prefix, int(first.logits[0].argmax()), max(m.lookahead for m in ahead.values()), ahead
    )
    spent = time.perf_counter() - begin
    compressed = {name: rows for name, rows in first.compressed.items() if name != WHOLE}
    for name, rows in out.items():
        rows[0].selection_s = spent
        compressed[name] = rows
    return dataclasses.replace(first, compressed=compressed, prefill_s=first.prefill_s + spent)


def kept_whole(methods: Mapping[str, Any], length: int) -> set[str]:
    """The lookahead methods of ``methods`` whose budget (in tokens) holds a ``length``-token prompt
    whole: their cache is the full one, whatever a draft would vote for."""
    return {
        name
        for name, m in methods.items()
        if m is not None and m.drafts and m.ratio is None and length <= m.max_capacity_prompt
    }


def draft_and_vote(
    runner, prefix: Prefix, first: int, count: int, methods: Mapping[str, LookaheadSnapKVConfig], speculate: bool = True
) -> tuple[list[int], dict[str, list[Compressed]]]:
    """The model's greedy answer over the whole prompt ``prefix``, from its ``first`` token: at most
    ``count`` tokens, ending early at an end-of-sequence token; then every attention layer selected
    under every method by :func:`select_layer`, from the prompt's window and the draft's queries.

    Each pass runs the next drafted token over the prompt and the draft so far, followed (with
    ``speculate``, on a model without recurrent layers) by a guess at the tokens after it
    (:func:`guess`: from the prompt, which a RAG answer often copies, or from the model's earlier
    drafts, kept per runner in :data:`PAST_DRAFTS`). A guessed token is kept, with its K/V and its queries, only while
    each one is the token the pass itself predicts there (greedy, so the draft is the one a pass
    per token drafts); the pass's prediction after the last kept token is the next token. A wrong
    guess costs only its share of the pass; without any, there is one pass per drafted token.
    The recurrent layers step copies of the prompt's states; the kept cache gets the states after
    the prompt, not after the draft. Returns the drafted tokens and, per method, its compressed cache."""
    cache = tails.with_states(PromptCache(runner.model.config, runner.specs, prefix), prefix.states)
    speculate = speculate and not any(state is not None for state in prefix.states)  # a state can't be rolled back
    drafted, held, queries = _draft(runner, prefix, cache, first, count, speculate)
    return drafted, _select_all(runner.specs, prefix, cache, held, queries, methods, len(drafted))


def _draft(runner, prefix: Prefix, cache: PromptCache, first: int, count: int, speculate: bool):
    """The passes of :func:`draft_and_vote`: the drafted tokens, and per attention layer the K/V over
    the prompt and the kept draft tokens (``held``) and the kept tokens' queries."""
    specs, length = runner.specs, prefix.length
    queries: list[list[torch.Tensor]] = [[] for _ in specs]  # per layer, the kept draft tokens' queries
    staged: dict[int, tuple] = {}  # per attention layer, its (query, keys, values, vote_keys, scoring) this pass
    held: dict[int, tuple] = {}  # per attention layer, its (keys, values, vote_keys, scoring) over the kept tokens

    def hook(layer_idx: int, query: torch.Tensor, vote_keys: torch.Tensor, scoring: Scoring) -> None:
        layer = cache.layers[layer_idx]
        staged[layer_idx] = (query, *layer.pending, vote_keys, scoring)
        layer.pending = None

    cache.compress = hook
    tokens, fed = [first], 0  # the drafted tokens; how many of them have run
    with runner.lock, torch.inference_mode(), runner.sliced_mlps():
        past = PAST_DRAFTS.setdefault(runner, collections.deque(maxlen=64))
        while fed < count and (fed == 0 or tokens[fed - 1] not in runner.eos_ids):
            ids = tokens[fed:]
            if speculate and ids[0] not in runner.eos_ids:
                ids += guess(prefix.ids, tokens, count - fed - 1, list(reversed(past)))
            positions = torch.arange(length + fed, length + fed + len(ids), device=runner.device)[None]
            logits = runner.forward(
                torch.tensor([ids], device=runner.device), None, positions, cache, at=list(range(len(ids)))
            )
            predicted = logits[0].argmax(-1).tolist()
            kept = 1  # the first token was predicted by the pass before (or by the prompt)
            while kept < len(ids) and ids[kept] == predicted[kept - 1] and ids[kept - 1] not in runner.eos_ids:
                kept += 1
            fed += kept
            tokens = tokens[: fed - kept] + ids[:kept] + [predicted[kept - 1]]
            for i, (query, keys, values, vote_keys, scoring) in staged.items():
                layer = cache.layers[i]
                queries[i].append(query[..., :kept, :])
                keys, values, vote_keys = (t[..., : length + fed, :] for t in (keys, values, vote_keys))
                layer.prefix, layer.prefix_length = PrefixLayer(keys, values, prefix.layers[i].queries), length + fed
                held[i] = (keys, values, vote_keys, scoring)
        past.append(tokens[:fed])
    return tokens[:fed], held, queries


def _select_all(specs, prefix: Prefix, cache: PromptCache, held: dict, queries: list, methods, drafted: int):
    """Every attention layer selected under every method from the prompt's window and the draft's
    queries (:func:`select_layer`); the kept caches get the states after the prompt, not the draft."""
    length = prefix.length
    out = {name: [Compressed(m, specs, [None] * len(specs), length)] for name, m in methods.items()}
    for i, (keys, values, vote_keys, scoring) in held.items():  # the window, then the draft
        query = torch.cat([prefix.layers[i].queries, *queries[i]], dim=-2)
        for name, method in methods.items():
            votes = (query, keys, values, vote_keys, scoring)
            out[name][0].layers[i] = select_layer(
                method, specs[i], i, len(specs), *votes, length, min(drafted, method.lookahead)
            )
        cache.layers[i].done = True
    for (kept_cache,) in out.values():
        tails.place_states(kept_cache.layers, prefix.states, copies=True)
    return out


def guess(prompt: Sequence[int], draft: list[int], most: int, past: Sequence[list[int]] = ()) -> list[int]:
    """Up to ``most`` tokens to try after ``draft``, the answer drafted so far after ``prompt``: what
    followed the latest earlier occurrence of the last three tokens of the prompt and the draft (a
    RAG answer often copies a document; shorter matches there are mostly chance); failing that,
    what followed the draft's last tokens (three, two, then one) in ``past``, earlier drafts of the
    same model, latest first (answers to one prompt template tend to start alike). ``[]`` when
    nothing matches. No model: a search in the ids."""
    if most <= 0:
        return []
    text = [*prompt, *draft]
    tail = text[-3:]
    for start in range(len(text) - len(tail) - 1, -1, -1):
        if text[start] == tail[0] and text[start : start + len(tail)] == tail:
            return text[start + len(tail) : start + len(tail) + most]
    for n in range(min(3, len(draft)), 0, -1):
        for earlier in past:
            for start in range(len(earlier) - n - 1, -1, -1):
                if earlier[start : start + n] == draft[-n:]:
                    return earlier[start + n : start + n + most]
    return []


def select_layer(
    method: LookaheadSnapKVConfig,
    spec,
    layer_idx: int,
    num_layers: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    vote_keys: torch.Tensor,
    scoring: Scoring,
    length: int,
    drafted: int,
) -> LayerKV:
    """One attention layer of a ``length``-token prompt with a draft after it (``keys``/``values``
    over both; ``query`` the prompt's last queries, then the draft's): head-adaptive SnapKV over the
    prompt and the draft's first ``drafted`` tokens, its window and its budget widened by them, their
    positions then dropped. A sliding layer: head-adaptive SnapKV over the prompt alone."""
    total = keys.shape[-2]
    extra = total - length  # drafted positions in the pass
    if spec.window is not None:  # a sliding layer: its share ends with the prompt
        q = query[..., : query.shape[-2] - extra, :]
        return compress_layer(
            _ada(method, layer_idx, num_layers, 0),
            spec,
            layer_idx,
            num_layers,
            q,
            keys[..., :length, :],
            values[..., :length, :],
            vote_keys[..., :length, :],
            scoring,
            [length],
        )[0]
    cut = total - (extra - drafted)  # the votes come from the first ``drafted`` tokens
    q = query[..., : query.shape[-2] - (extra - drafted), :]
    kv = compress_layer(
        _ada(method, layer_idx, num_layers, drafted),
        spec,
        layer_idx,
        num_layers,
        q,
        keys[..., :cut, :],
        values[..., :cut, :],
        vote_keys[..., :cut, :],
        scoring,
        [cut],
    )[0]
    keep = kv.slots - drafted  # the window is always kept: the draft's positions are each head's last
    return LayerKV(kv.keys[..., :keep, :], kv.values[..., :keep, :], kv.positions[..., :keep])


def _ada(method: LookaheadSnapKVConfig, layer_idx: int, num_layers: int, drafted: int) -> AdaSnapKVConfig:
    """The head-adaptive SnapKV that selects a layer: window and budget widened by ``drafted``."""
    return AdaSnapKVConfig(
        max_capacity_prompt=method.budget_for_layer(layer_idx, num_layers) + drafted,
        window_size=method.window_size + drafted,
        kernel_size=method.kernel_size,
        pooling=method.pooling,
        floor=method.floor,
    )
