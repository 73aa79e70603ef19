"""One budget for the whole model (KVzip's ``share="layer"`` and ``share="model"``,
:class:`~snapkv_rag.methods.KVzipConfig`): every prefix position of every layer and KV head is ranked
by its score together, and the best ``total`` of them are kept, where ``total`` is what an even split
would keep (``sum over layers of H_kv x (capacity - window)``). Layers (and with ``"model"`` heads)
whose positions score high keep more, the others less, down to none; the window is always kept.

- ``share="layer"``: each layer keeps as many positions as the ranking gave it, split evenly between
  its heads (each head its own best), so the layer stays dense;
- ``share="model"``: each (layer, head) keeps exactly what the ranking gave it; the layer is stored
  padded to its widest head, empty slots at position :data:`~snapkv_rag.methods.adaptive.EMPTY` (the
  layout of :mod:`snapkv_rag.methods.adaptive`).

Scores are comparable across layers because they are attention weights (KVzip's re-read maxima).
"""

from __future__ import annotations

import torch

from .adaptive import keep_ranked
from .selection import best_positions

SHARES = ("head", "layer", "model")


def global_counts(scores: list[torch.Tensor], total: int, share: str, fit: str = "positions") -> list[torch.Tensor]:
    """Per layer, how many prefix positions each head keeps ``[H]``, from the layers' prefix scores
    ``[H_l, n_l]`` (``-inf`` for a position that must not be kept, ``inf`` for one that must), with
    ``total`` kept over all of them (ties: the earlier layer, head and position first). ``fit="slots"``
    (``share="model"`` only): ``total`` bounds the slots held once each layer is padded to its widest
    head, so the best positions are kept as far as that storage allows (:func:`padded_fit`)."""
    if share not in ("layer", "model"):
        raise ValueError(f"share: must be 'layer' or 'model' here, got {share!r}")
    if fit not in ("positions", "slots"):
        raise ValueError(f"fit: must be 'positions' or 'slots', got {fit!r}")
    flat = torch.cat([s.float().reshape(-1) for s in scores])
    total = max(0, min(int(total), int(torch.isfinite(flat).sum() + (flat == float("inf")).sum())))
    order = flat.argsort(descending=True, stable=True)
    if fit == "slots" and share == "model":
        total = padded_fit(order, [s.shape for s in scores], total)
    chosen = torch.zeros_like(flat, dtype=torch.long)
    chosen[order[:total]] = 1
    out, at = [], 0
    for s in scores:
        per_head = chosen[at : at + s.numel()].view(s.shape).sum(-1)
        at += s.numel()
        if share == "layer":  # the layer's count, split evenly (the first heads take the remainder)
            heads, whole = s.shape[0], int(per_head.sum())
            per_head = torch.full((heads,), whole // heads, dtype=torch.long, device=per_head.device)
            per_head[: whole % heads] += 1
            per_head = per_head.clamp(max=s.shape[-1])
        out.append(per_head)
    return out


def keep_counts(
    scores: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, counts: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer of one prompt: each head's ``counts[h]`` best-scored prefix positions (``scores``
    ``[1, H, L - window]``) plus the last ``window`` positions of ``key_states`` / ``value_states``
    ``[1, H, L, D]``, padded to the widest head (:func:`~snapkv_rag.methods.adaptive.keep_ranked`)."""
    widest = int(counts.max()) if counts.numel() else 0
    return keep_ranked(best_positions(scores.float(), widest), key_states, value_states, counts[None], window)


def padded_fit(order: torch.Tensor, shapes: list[torch.Size], slots: int) -> int:
    """The most positions of the global ranking ``order`` (indices into the layers' flattened
    ``[H_l, n_l]`` scores, best first) whose padded storage, ``sum over layers of H_l x`` its widest
    head's count, stays within ``slots`` (a binary search: the storage grows with the count kept)."""
    sizes = [int(torch.tensor(shape).prod()) for shape in shapes]
    starts = torch.tensor([0] + sizes).cumsum(0)[:-1].to(order.device)
    heads = torch.tensor([shape[0] for shape in shapes], device=order.device)
    widths = torch.tensor([shape[1] for shape in shapes], device=order.device)
    layer_of = torch.repeat_interleave(
        torch.arange(len(shapes), device=order.device), torch.tensor(sizes, device=order.device)
    )
    head_base = torch.cat([torch.zeros(1, dtype=torch.long, device=order.device), heads.cumsum(0)[:-1]])
    layers = layer_of[order]
    head_of = head_base[layers] + (order - starts[layers]) // widths[layers]  # a global head number

    def cost(k: int) -> int:
        counts = torch.bincount(head_of[:k], minlength=int(heads.sum()))
        widest = torch.zeros(len(shapes), dtype=torch.long, device=order.device).scatter_reduce(
            0, torch.repeat_interleave(torch.arange(len(shapes), device=order.device), heads), counts, "amax"
        )
        return int((widest * heads).sum())

    low, high = 0, slots  # cost(k) >= k, so no more than ``slots`` positions fit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost(mid) <= slots else (low, mid - 1)
    return low
