"""The selection algorithms as pure tensor functions: no model code, no state.

Shapes used throughout: queries ``[B, H, q, D]`` (RoPE applied), keys and values
``[B, H_kv, L, D]``, ``attention_mask`` ``[B, L]`` with 1 for real tokens and 0 for left padding.
Every function returns ``(keys, values, kept_positions)`` with ``kept_positions`` ``[B, H_kv, C]``
sorted ascending, so that the kept cache is dense and keeps the tokens in prompt order. Values may
have another head size than keys (multi-head latent attention caches 192-wide keys, 128-wide values).

Votes are computed the way the layer's own attention computes its weights: ``scale`` (default
``1/sqrt(D)``; Granite's attention multiplier, Gemma's ``query_pre_attn_scalar``), ``softcap``
(Gemma 2's logit soft-capping) and ``sinks`` (GPT-OSS's per-head sink logit, which takes its share of
the softmax and is then dropped). Ties in the scores are broken by position, earlier first, so the
selection does not depend on where a row's tokens sit in a padded batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # the settings each function reads; the method classes call these functions
    from .docsnapkv import DocSnapKVConfig
    from .h2o import H2OConfig
    from .keynorm import KeyNormConfig
    from .kvzip import KVzipConfig
    from .random import RandomConfig
    from .snapkv import SnapKVConfig
    from .streaming import StreamingLLMConfig

NEG_INF = float("-inf")


def _group_queries(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, H, q, D] -> [B, H_kv, H/H_kv, q, D]: the query heads that share each KV head."""
    b, h, q, d = query.shape
    if h % num_kv_heads:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({num_kv_heads})")
    return query.view(b, num_kv_heads, h // num_kv_heads, q, d)


def attention_probs(
    query: torch.Tensor,
    key_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention of the last ``q`` prompt queries over all ``L`` keys, in float32.

    Returns ``[B, H_kv, H/H_kv, q, L]``. Query ``i`` sits at position ``L - q + i`` and sees keys up
    to that position; padded keys get no weight and padded queries contribute zeros.
    """
    b, h_kv, length, d = key_states.shape
    q_len = query.shape[-2]
    grouped = _group_queries(query, h_kv).float()
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # in place from here on (the same values as out of place): these are the largest tensors of a selection
    logits = torch.matmul(grouped, key_states.float().unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if softcap:
        logits.div_(softcap).tanh_().mul_(softcap)
    first = length - q_len  # every query sees the keys before the first query; only the last q_len are causal
    q_pos = torch.arange(q_len, device=query.device)
    logits[..., first:].masked_fill_(q_pos[None, :] > q_pos[:, None], NEG_INF)
    if attention_mask is not None:
        real = attention_mask.to(device=query.device, dtype=torch.bool)
        logits.masked_fill_(~real[:, None, None, None, :], NEG_INF)
    if sinks is not None:  # one extra logit per query head, sharing the softmax, then dropped
        sink = sinks.float().reshape(1, h_kv, -1, 1, 1).expand(*logits.shape[:-1], 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    # a padded query sees no real key: all -inf -> NaN -> zeros (without padding every query sees key 0)
    return probs.nan_to_num_(nan=0.0) if attention_mask is not None or sinks is not None else probs


def snapkv_votes(
    query_window: torch.Tensor, key_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **scoring
) -> torch.Tensor:
    """Steps 1–3: attention of the observation window summed over its queries and averaged over
    the query heads of each KV head. Returns ``[B, H_kv, L]`` (the caller keeps the prefix part).
    ``scoring``: the layer's ``scale``, ``softcap`` and ``sinks`` (see :func:`attention_probs`)."""
    probs = attention_probs(query_window, key_states, attention_mask, **scoring)
    return probs.sum(dim=-2).mean(dim=2)


def pool_votes(votes: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Step 4: 1-D pooling along the sequence (stride 1, same length) so kept tokens come in clusters."""
    if kernel_size == 1:
        return votes
    b, h, n = votes.shape
    flat = votes.reshape(b * h, 1, n)
    pad = kernel_size // 2
    if pooling == "max":
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    elif pooling == "avg":
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad)
    else:
        raise ValueError(f"pooling: must be 'max' or 'avg', got {pooling!r}")
    return pooled.reshape(b, h, n)


def keep_top(
    prefix_scores: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    capacity: int,
    recent: int,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 5, shared by every method: the ``capacity - recent`` best-scored prefix positions plus
    the last ``recent`` positions, gathered from K and V. Padded prefix positions are never chosen
    while a real one is left. ``prefix_scores`` is ``[B, H_kv, L - recent]``."""
    b, h_kv, length, _ = key_states.shape
    if length <= capacity:
        kept = torch.arange(length, device=key_states.device).expand(b, h_kv, length)
        return key_states, value_states, kept
    scores = prefix_scores.float()
    if attention_mask is not None:
        real = attention_mask[:, : length - recent].to(device=scores.device, dtype=torch.bool)
        scores = scores.masked_fill(~real[:, None, :], NEG_INF)
    top = best_positions(scores, capacity - recent)
    window = torch.arange(length - recent, length, device=key_states.device).expand(b, h_kv, recent)
    kept = torch.cat([top, window], dim=-1).sort(dim=-1).values
    return gather_positions(key_states, kept), gather_positions(value_states, kept), kept


def best_positions(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` best positions of ``scores`` ``[..., n]``, ordered by (score desc, position asc):
    exactly tied scores (plateaus of max pooling) go to the earlier position, whatever offset the
    row has in a padded batch. ``topk`` leaves the order of ties to the kernel."""
    return scores.argsort(dim=-1, descending=True, stable=True)[..., :count]


def gather_positions(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``states`` ``[B, H_kv, L, D]`` at ``positions`` ``[B, H_kv, C]`` -> ``[B, H_kv, C, D]``."""
    return states.gather(2, positions.unsqueeze(-1).expand(*positions.shape, states.shape[-1]))


def snapkv_select(
    query_window: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    config: SnapKVConfig,
    attention_mask: torch.Tensor | None = None,
    *,
    capacity: int | None = None,
    shared: bool = False,
    **scoring,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SnapKV, steps 1–5 of the paper: returns ``(keys, values, kept_positions)``.

    ``query_window`` is ``[B, H, w, D]``: the last ``w`` prompt queries. ``capacity`` overrides
    ``config.max_capacity_prompt`` (per-layer budgets). When ``L <= capacity`` nothing is dropped.
    ``shared``: one selection for all heads, from their votes averaged (multi-head latent attention
    caches one latent for every head); the K/V returned are then those of the first head.
    """
    capacity = config.max_capacity_prompt if capacity is None else capacity
    length = key_states.shape[-2]
    if length <= capacity:
        return keep_top(key_states.new_zeros(()), key_states, value_states, capacity, 0)
    window = min(config.window_size, query_window.shape[-2])
    votes = snapkv_votes(query_window[..., -window:, :], key_states, attention_mask, **scoring)
    votes = votes[..., : length - window]
    if shared:
        votes, key_states, value_states = votes.mean(dim=1, keepdim=True), key_states[:, :1], value_states[:, :1]
    pooled = pool_votes(votes, config.kernel_size, config.pooling)
    return keep_top(pooled, key_states, value_states, capacity, window, attention_mask)


def share_budget(mass: Sequence[float], lengths: Sequence[int], total: int) -> list[int]:
    """``total`` tokens shared out in proportion to ``mass``, no share above its ``lengths``: a
    share that would pass its length is capped and the rest goes round the others again; the
    fractions left are given by largest remainder (the earlier first on ties). The shares add up to
    ``min(total, sum(lengths))``; a zero mass gets nothing while another can still take tokens, and
    tokens no positive mass can take go to the zero-mass ones by length."""
    shares = [0] * len(lengths)
    left = min(total, sum(lengths))
    open_ = [i for i, n in enumerate(lengths) if n > 0]
    while left > 0 and open_:
        weights = {i: max(float(mass[i]), 0.0) for i in open_}
        if sum(weights.values()) <= 0:
            weights = {i: float(lengths[i] - shares[i]) for i in open_}
        norm = sum(weights.values())
        ideal = {i: left * w / norm for i, w in weights.items()}
        full = [i for i in open_ if ideal[i] >= lengths[i] - shares[i]]
        if full:  # capped documents take all they have; the others share what is left, again
            for i in full:
                left -= lengths[i] - shares[i]
                shares[i] = lengths[i]
            open_ = [i for i in open_ if i not in full]
            continue
        floors = {i: int(ideal[i]) for i in open_}
        extra = left - sum(floors.values())
        for i in sorted(open_, key=lambda i: (-(ideal[i] - floors[i]), i))[:extra]:
            floors[i] += 1
        for i in open_:
            shares[i] += floors[i]
        left = 0
    return shares


def pool_within(votes: torch.Tensor, doc_of: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """:func:`pool_votes` inside each document only: ``votes`` ``[B, H, n]`` are the documents'
    tokens one after another, ``doc_of`` ``[n]`` (ascending) the document of each. The documents
    are laid out with ``kernel_size // 2`` pads between them (what the pooling pads the ends with:
    ``-inf`` for max, 0 for avg), pooled in one call, and read back."""
    pad = kernel_size // 2
    if pad == 0:
        return votes
    slots = torch.arange(votes.shape[-1], device=votes.device) + doc_of * pad
    gapped = votes.new_full(
        (*votes.shape[:-1], votes.shape[-1] + pad * int(doc_of[-1])), NEG_INF if pooling == "max" else 0.0
    )
    gapped[..., slots] = votes
    return pool_votes(gapped, kernel_size, pooling)[..., slots]


def doc_snapkv_select(
    query: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    config: DocSnapKVConfig,
    attention_mask: torch.Tensor | None = None,
    *,
    capacity: int | None = None,
    shared: bool = False,
    **scoring,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Document-aware SnapKV (:class:`DocSnapKVConfig`): returns ``(keys, values, kept_positions)``.

    ``query`` is ``[B, H, L, D]`` (all prompt queries; the voters are taken from its end). Every
    position outside the documents is kept (window included); the budget left is shared between
    the documents by their vote mass (mean over heads, :func:`share_budget`) and each head keeps
    its best positions inside each share, votes pooled within the document. The spans apply to
    every row (one prompt's layout; the engine prefills one request at a time). Without spans, or
    when the positions outside the documents alone fill the budget, this is :func:`snapkv_select`.
    """
    capacity = config.max_capacity_prompt if capacity is None else capacity
    b, _, length, _ = key_states.shape
    spans = [] if config.spans is None else config.spans.in_slice(length)
    device = key_states.device
    positions = torch.tensor([p for start, stop in spans for p in range(start, stop)], dtype=torch.long, device=device)
    doc_of = torch.tensor(
        [d for d, (start, stop) in enumerate(spans) for _ in range(start, stop)], dtype=torch.long, device=device
    )
    in_doc = torch.zeros(length, dtype=torch.bool, device=device)
    in_doc[positions] = True
    in_doc[length - min(config.window_size, length) :] = False  # the observation window is always kept
    real = (
        torch.ones(b, length, dtype=torch.bool, device=device)
        if attention_mask is None
        else attention_mask.to(device=device, dtype=torch.bool)
    )
    fixed = real & ~in_doc
    if not spans or length <= capacity or int(fixed.sum(-1).max()) >= capacity:
        return snapkv_select(
            query[..., -config.window_size :, :],
            key_states,
            value_states,
            config,
            attention_mask,
            capacity=capacity,
            shared=shared,
            **scoring,
        )
    window = min(config.window_size, query.shape[-2])
    votes = snapkv_votes(query[..., -window:, :], key_states, attention_mask, **scoring)  # [B, H_kv, L]
    if shared:
        votes, key_states, value_states = votes.mean(dim=1, keepdim=True), key_states[:, :1], value_states[:, :1]
    pooled = pool_within(votes[..., positions], doc_of, config.kernel_size, config.pooling)
    kept = _kept_by_document(votes, pooled, spans, positions, doc_of, fixed, real, capacity)
    return gather_positions(key_states, kept), gather_positions(value_states, kept), kept


def _kept_by_document(votes, pooled, spans, positions, doc_of, fixed, real, capacity: int) -> torch.Tensor:
    """:func:`doc_snapkv_select`'s kept positions ``[B, H, capacity]``: per row, every ``fixed``
    position, then each document's share of the rest (by its vote mass) of its best pooled positions,
    then pads where a padded row is shorter than the budget; in prompt order."""
    device, heads = votes.device, votes.shape[1]
    # each document's tokens in (score desc, position asc) order, the documents one after another
    order = best_positions(pooled, pooled.shape[-1])
    order = order.gather(-1, doc_of[order].argsort(dim=-1, stable=True))
    starts = torch.tensor([0] + [stop - start for start, stop in spans[:-1]], device=device).cumsum(0)
    rank = torch.arange(len(doc_of), device=device) - starts[doc_of]
    rows = []
    for row in range(votes.shape[0]):
        outside = torch.nonzero(fixed[row]).flatten().expand(heads, -1)
        mass = torch.zeros(len(spans), device=device).index_add_(0, doc_of, votes[row][:, positions].mean(0))
        shares = share_budget(mass.tolist(), [stop - start for start, stop in spans], capacity - outside.shape[-1])
        chosen = rank < torch.tensor(shares, device=device)[doc_of]  # the first `share` of each document
        kept = torch.cat([outside, positions[order[row][:, chosen]]], dim=-1)
        short = capacity - kept.shape[-1]  # a padded row shorter than the budget: pads fill its slots
        if short > 0:
            kept = torch.cat([kept, torch.nonzero(~real[row]).flatten()[:short].expand(heads, -1)], dim=-1)
        rows.append(kept.sort(dim=-1).values)
    return torch.stack(rows)


def key_norm_scores(key_states: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, L]``: minus each key's L2 norm, in float64 (higher is kept first). A norm is
    one reduction per key, so a row's scores do not depend on the batch it is in."""
    return -torch.linalg.vector_norm(key_states.double(), dim=-1)


def key_norm_select(
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    config: KeyNormConfig,
    attention_mask: torch.Tensor | None = None,
    *,
    capacity: int | None = None,
    shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key-norm selection (:class:`KeyNormConfig`): the prefix positions of shortest keys, pooled
    like SnapKV's votes, plus the last ``window_size`` positions. ``shared``: one selection for all
    heads from their scores averaged (multi-head latent attention, see :func:`snapkv_select`)."""
    capacity = config.max_capacity_prompt if capacity is None else capacity
    length = key_states.shape[-2]
    if length <= capacity:
        return keep_top(key_states.new_zeros(()), key_states, value_states, capacity, 0)
    window = min(config.window_size, length)
    scores = key_norm_scores(key_states[..., : length - window, :])
    if shared:
        scores, key_states, value_states = scores.mean(dim=1, keepdim=True), key_states[:, :1], value_states[:, :1]
    pooled = pool_votes(scores, config.kernel_size, config.pooling)
    return keep_top(pooled, key_states, value_states, capacity, window, attention_mask)


def reread_scores(
    reread_query: torch.Tensor, key_states: torch.Tensor, prompt_len: int, *, chunk: int = 512, **scoring
) -> torch.Tensor:
    """KVzip's votes ``[B, H_kv, prompt_len]``: for each prompt key, the largest attention weight any
    re-reading query (``reread_query`` ``[B, H, R, D]``, at positions ``prompt_len ..`` after the
    prompt) or query head of its group gives it. ``key_states`` ``[B, H_kv, prompt_len + R, D]`` are
    the prompt's keys followed by the re-read's (each query sees those before it); the queries go
    ``chunk`` at a time, so no ``R x L`` matrix is held at once."""
    best = None
    for start in range(0, reread_query.shape[-2], chunk):
        stop = min(start + chunk, reread_query.shape[-2])
        probs = attention_probs(reread_query[..., start:stop, :], key_states[..., : prompt_len + stop, :], **scoring)
        part = probs[..., :prompt_len].amax(dim=(2, 3))
        best = part if best is None else torch.maximum(best, part)
    return best


def kvzip_select(
    reread_query: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    config: KVzipConfig,
    *,
    capacity: int | None = None,
    shared: bool = False,
    sinks_from: int = 0,
    **scoring,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KVzip-style selection (:class:`KVzipConfig`) of one prompt of ``value_states.shape[-2]``
    positions: ``key_states`` hold the prompt's keys and then the re-read's (see
    :func:`reread_scores`); returns the prompt's kept ``(keys, values, kept_positions)``."""
    capacity = config.max_capacity_prompt if capacity is None else capacity
    length = value_states.shape[-2]
    prompt_keys = key_states[..., :length, :]
    if length <= capacity:
        return keep_top(prompt_keys.new_zeros(()), prompt_keys, value_states, capacity, 0)
    window = min(config.window_size, length)
    pooled = kvzip_scores(reread_query, key_states, length, config, shared=shared, sinks_from=sinks_from, **scoring)
    if shared:
        prompt_keys, value_states = prompt_keys[:, :1], value_states[:, :1]
    return keep_top(pooled, prompt_keys, value_states, capacity, window)


def kvzip_scores(
    reread_query: torch.Tensor,
    key_states: torch.Tensor,
    length: int,
    config: KVzipConfig,
    *,
    shared: bool = False,
    sinks_from: int = 0,
    **scoring,
) -> torch.Tensor:
    """KVzip's pooled prefix scores ``[B, H_kv (1 if shared), length - window]`` (see
    :func:`reread_scores`), the first ``config.sink_tokens`` prompt positions at ``inf`` (the prefix
    starts at prompt position ``sinks_from``: a sliding layer's share)."""
    window = min(config.window_size, length)
    scores = reread_scores(reread_query, key_states, length, chunk=config.chunk, **scoring)[..., : length - window]
    if shared:
        scores = scores.mean(dim=1, keepdim=True)
    pooled = pool_votes(scores, config.kernel_size, config.pooling).float()
    sinks = max(0, config.sink_tokens - sinks_from)
    if sinks:
        pooled[..., :sinks] = float("inf")
    return pooled


def streaming_select(
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    config: StreamingLLMConfig,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """StreamingLLM: the first ``sink_tokens`` real positions and the most recent ones."""
    b, h_kv, length, _ = key_states.shape
    capacity = config.max_capacity_prompt
    recent = capacity - config.sink_tokens
    # earlier positions score higher, so the sinks are the first real tokens of each row
    scores = -torch.arange(max(length - recent, 0), device=key_states.device, dtype=torch.float32).expand(b, h_kv, -1)
    return keep_top(scores, key_states, value_states, capacity, recent, attention_mask)


def h2o_select(
    query: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    config: H2OConfig,
    attention_mask: torch.Tensor | None = None,
    *,
    chunk: int = 512,
    shared: bool = False,
    **scoring,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """H2O-style: attention accumulated over every prompt query (``query`` is ``[B, H, L, D]``),
    computed in chunks of queries so that no ``L x L`` matrix is held at once."""
    length = key_states.shape[-2]
    if length <= config.max_capacity_prompt:
        return keep_top(key_states.new_zeros(()), key_states, value_states, config.max_capacity_prompt, 0)
    totals = None
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        # attention_probs places the queries at the end of the keys it is given
        probs = attention_probs(
            query[..., start:stop, :],
            key_states[..., :stop, :],
            None if attention_mask is None else attention_mask[:, :stop],
            **scoring,
        )
        part = F.pad(probs.sum(dim=-2).mean(dim=2), (0, length - stop))
        totals = part if totals is None else totals + part
    recent = config.recent_size
    if shared:  # one selection for all heads (see snapkv_select)
        totals, key_states, value_states = totals.mean(dim=1, keepdim=True), key_states[:, :1], value_states[:, :1]
    return keep_top(
        totals[..., : length - recent], key_states, value_states, config.max_capacity_prompt, recent, attention_mask
    )


def random_select(
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    config: RandomConfig,
    attention_mask: torch.Tensor | None = None,
    *,
    layer_idx: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniformly random prefix positions (seeded per layer) plus the recent window."""
    b, h_kv, length, _ = key_states.shape
    generator = torch.Generator(device="cpu").manual_seed(config.seed * 1_000_003 + layer_idx)
    scores = torch.rand((b, h_kv, max(length - config.recent_size, 0)), generator=generator, device="cpu")
    return keep_top(
        scores.to(key_states.device),
        key_states,
        value_states,
        config.max_capacity_prompt,
        config.recent_size,
        attention_mask,
    )
