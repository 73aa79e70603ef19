"""Head-adaptive budgets (Ada-SnapKV, :class:`~snapkv_rag.methods.ada.AdaSnapKVConfig`) and the ragged
cache they need.

A layer's prefix budget ``H_kv x (capacity - window)`` is shared between its heads by SnapKV's
pooled votes: every head keeps its best ``floor x (capacity - window)`` positions, and the rest of
the budget goes to the best-voted positions left in any head. Heads then hold different counts;
the layer is stored padded to its largest head, the empty slots with position ``-1`` (the slot
cache masks them, so they are never attended) and zero K/V. The budget is a memory bound: no head
holds more than ``capacity - window`` positions, so a layer never holds more slots than SnapKV's at
the same budget (:func:`head_counts`' ``most``: the vote's ranking is kept only up to where its
first head is full, which keeps fewer positions than the even split when the heads' votes differ).
:func:`trim_padding` drops the columns that every head of a row leaves empty, so a request holds the
same slots in a batch as alone; :func:`held_share` says how much of the held slots is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .selection import NEG_INF, best_positions, gather_positions, keep_top, pool_votes, snapkv_votes

if TYPE_CHECKING:
    from .ada import AdaSnapKVConfig

EMPTY = -1
"""The position of a slot that holds nothing (masked in decode)."""


def head_counts(ranked: torch.Tensor, per_head: int, floor: int, most: int | None = None) -> torch.Tensor:
    """``[B, H]``: how many prefix positions each head keeps out of ``H x per_head``, from each
    head's scores ``ranked`` best first ``[B, H, n]``: its ``floor`` best, then the best scores
    left across all heads of the row (ties: lower head first). A head's chosen ones are a prefix of
    its ranking, so its count says which they are. ``most``: no head keeps more (the layer's padded
    width, a memory bound): the row's ranking is followed only until its first head holds ``most``."""
    b, h, n = ranked.shape
    ranked = ranked.clone()
    ranked[..., :floor] = float("inf")  # the safeguard is always chosen
    order = ranked.reshape(b, h * n).argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(h * n, device=order.device).expand(b, -1))
    take = torch.full((b, 1), h * per_head, dtype=torch.long, device=order.device)
    if most is not None and most < n:  # where a head would pass ``most``: its most-th best is the last one taken
        full = rank.view(b, h, n)[..., max(most, 1) - 1].amin(-1, keepdim=True) + 1
        take = torch.minimum(take, full.clamp(min=h * min(floor, most)))  # every head's floor still kept
    return (rank < take).view(b, h, n).sum(-1)


def ada_snapkv_select(
    query_window: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    config: AdaSnapKVConfig,
    attention_mask: torch.Tensor | None = None,
    *,
    capacity: int | None = None,
    **scoring,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys, values, kept_positions)`` ``[B, H_kv, C, ...]`` with ``C`` the largest head's count
    plus the window; a head's unused slots come first, at position :data:`EMPTY` with zero K/V."""
    capacity = config.max_capacity_prompt if capacity is None else capacity
    b, h, length, _ = key_states.shape
    if length <= capacity:
        return keep_top(key_states.new_zeros(()), key_states, value_states, capacity, 0)
    window = min(config.window_size, query_window.shape[-2])
    votes = snapkv_votes(query_window[..., -window:, :], key_states, attention_mask, **scoring)[..., : length - window]
    pooled = pool_votes(votes, config.kernel_size, config.pooling).float()
    if attention_mask is not None:
        real = attention_mask[:, : length - window].to(device=pooled.device, dtype=torch.bool)
        pooled = pooled.masked_fill(~real[:, None, :], NEG_INF)
    per_head = capacity - window
    order = best_positions(pooled, pooled.shape[-1])  # [B, H, n]: each head's positions, best first
    counts = head_counts(pooled.gather(-1, order), per_head, int(config.floor * per_head), most=per_head)
    return keep_ranked(order, key_states, value_states, counts, window)


def keep_ranked(
    order: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, counts: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head's first ``counts`` ``[B, H]`` positions of its ranking ``order`` ``[B, H, >= max
    count]`` (best first) plus the last ``window`` positions, as ``(keys, values, kept_positions)``
    padded to the widest head: a head's unused slots first, at :data:`EMPTY` with zero K/V."""
    b, h, length, _ = key_states.shape
    widest = int(counts.max()) if counts.numel() else 0
    top = order[..., :widest]
    rank = torch.arange(widest, device=top.device)
    top = torch.where(rank < counts.to(top.device)[..., None], top, EMPTY)
    recent = torch.arange(length - window, length, device=top.device).expand(b, h, window)
    kept = torch.cat([top, recent], dim=-1).sort(dim=-1).values  # the empty slots first
    empty = (kept < 0)[..., None]
    keys = gather_positions(key_states, kept.clamp(min=0)).masked_fill(empty, 0)
    values = gather_positions(value_states, kept.clamp(min=0)).masked_fill(empty, 0)
    return keys, values, kept


def trim_padding(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
    """One row's ``[1, H, C, ...]`` without the leading columns that every head leaves empty."""
    unused = int((positions < 0).sum(-1).min())
    return (
        (keys, values, positions)
        if unused == 0
        else (keys[:, :, unused:], values[:, :, unused:], positions[:, :, unused:])
    )


def held_share(positions: torch.Tensor) -> float:
    """The share of a layer's held slots that hold a position (1.0 for a dense selection)."""
    return float((positions >= 0).float().mean())
