"""One budget for the whole model (KVzip's ``share="layer"`` and ``share="model"``,
:class:`~snapkv_rag.methods.KVzipConfig`): every prefix position of every layer and KV head is ranked
by its score together, and the best ``total`` of them are kept, where ``total`` is what an even split
would keep (``sum over layers of H_kv x (capacity - window)``), within each layer's own budget: the
budget is a memory bound, so no head of a layer holds more than ``capacity - window`` prefix
positions (a layer is decoded padded to its widest head, and every layer of a request to its
widest layer: a layer over its budget would cost its bytes in every layer). The window is always kept.

- ``share="layer"``: each layer keeps as many positions as the ranking gave it, up to
  ``H_kv x (capacity - window)``, split evenly between its heads (each head its own best), so the
  layer stays dense; within the bound every layer fills its budget (the even split's total);
- ``share="model"``: each (layer, head) keeps what the ranking gave it, a layer's part of the ranking
  followed until its first head is full; the layer is stored padded to its widest head, empty
  slots at position :data:`~snapkv_rag.methods.adaptive.EMPTY` (the layout of
  :mod:`snapkv_rag.methods.adaptive`). A layer whose heads' scores differ keeps fewer positions
  than the even split in the same bytes.

Scores are comparable across layers because they are attention weights (KVzip's re-read maxima).
"""

from __future__ import annotations

import torch

from .adaptive import keep_ranked
from .selection import best_positions

SHARES = ("head", "layer", "model")


def global_counts(
    scores: list[torch.Tensor], total: int, share: str, fit: str = "positions", most: list[int] | None = None
) -> list[torch.Tensor]:
    """Per layer, how many prefix positions each head keeps ``[H]``, from the layers' prefix scores
    ``[H_l, n_l]`` (``-inf`` for a position that must not be kept, ``inf`` for one that must), with
    ``total`` kept over all of them (ties: the earlier layer, head and position first). ``fit="slots"``
    (``share="model"`` only): ``total`` bounds the slots held once each layer is padded to its widest
    head, so the best positions are kept as far as that storage allows (:func:`padded_fit`).
    ``most`` (one per layer): no head of the layer keeps more, its budget as a memory bound; a layer's
    part of the ranking is followed only until its first head (``"layer"``: the layer) is full."""
    if share not in ("layer", "model"):
        raise ValueError(f"share: must be 'layer' or 'model' here, got {share!r}")
    if fit not in ("positions", "slots"):
        raise ValueError(f"fit: must be 'positions' or 'slots', got {fit!r}")
    flat = torch.cat([s.float().reshape(-1) for s in scores])
    order = flat.argsort(descending=True, stable=True)
    keep = torch.isfinite(flat) | (flat == float("inf"))
    if most is not None:
        keep &= within_bounds(flat, order, [s.shape for s in scores], most, share)
    order = order[keep[order]]
    if fit == "slots" and share == "model":
        total = padded_fit(order, [s.shape for s in scores], max(0, int(total)))
    total = max(0, min(int(total), len(order)))
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


def within_bounds(flat: torch.Tensor, order: torch.Tensor, shapes: list[torch.Size], most: list[int], share: str):
    """Which of the positions ``flat`` (the layers' scores flattened, as in :func:`global_counts`) come,
    in the ranking ``order``, before their layer is full: before its first head holds ``most[l]``
    (``"model"``), or before the layer holds ``H_l x most[l]`` (``"layer"``, split evenly afterwards).
    A position that must be kept (``inf``: a sink) is kept while its head has room."""
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    out, at = [], 0
    for shape, cap in zip(shapes, most):
        heads, n = shape[0], shape[1]
        ranks, sinks = (t[at : at + heads * n].view(heads, n) for t in (rank, flat == float("inf")))
        at += heads * n
        if share == "layer":
            flat_ranks = ranks.reshape(-1).sort().values
            last = flat_ranks[min(heads * cap, flat_ranks.numel()) - 1]
        elif cap >= n:  # no head can pass its cap
            last = rank.new_tensor(len(order))
        else:  # the first head to fill its ``cap`` slots fills them there
            last = ranks.sort(-1).values[:, max(cap, 1) - 1].min()
        place = ranks.argsort(-1).argsort(-1)  # each position's place in its head's ranking
        out.append(((ranks <= last) | (sinks & (place < cap))).reshape(-1))
    return torch.cat(out)


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

    low, high = 0, min(slots, len(order))  # cost(k) >= k, so no more than ``slots`` positions fit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost(mid) <= slots else (low, mid - 1)
    return low
