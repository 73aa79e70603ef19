"""Rows joining and leaving a running decode batch: pure functions over our caches.

Every request is prefilled alone, at its own length, into its own :class:`~snapkv_rag.cache.KVCache`
(one row). To decode several requests together, their caches become rows of one cache:
:func:`merge` places each row's slots right-aligned to a common slot count (slots before a shorter
row's first token hold position ``-1``, which every layer masks out), and :func:`keep_rows` drops
the rows that finished. After SnapKV every row holds about the same number of prompt slots (the
budget), so little is padded. Each call copies the rows it keeps once: about what one decode step
reads anyway, and it happens once per request joining or leaving, not per step.

Recurrent layers (linear attention) hold transformers' own state objects; caches with them are not
merged (:func:`can_merge`), and such models decode one request at a time.
"""

from __future__ import annotations

import torch

from .cache import SLIDING, AttentionLayer, KVCache


def can_merge(cache: KVCache) -> bool:
    """Whether rows of caches like ``cache`` can decode in one batch (attention layers only, none
    with a recurrent state beside it)."""
    return all(spec.attends and not spec.state for spec in cache.specs)


def merge(caches: list[KVCache], room: int) -> KVCache:
    """One cache whose rows are the rows of ``caches``, in order, with ``room`` free slots after the
    longest for the tokens still to decode. The inputs are left unchanged."""
    if len(caches) == 1 and _free_slots(caches[0]) >= room:
        return caches[0]
    first = caches[0]
    merged = KVCache.__new__(KVCache)
    merged.__dict__.update({k: v for k, v in first.__dict__.items() if k != "layers"})
    merged.layers = []
    for i, layer in enumerate(first.layers):
        if not isinstance(layer, AttentionLayer):
            raise ValueError("merge: caches with recurrent layers cannot decode in one batch")
        merged.layers.append(_merge_layer([c.layers[i] for c in caches], room))
    merged.selection_s, merged.record_s, merged.recorder, merged._prefill = 0.0, 0.0, None, None
    return merged


def keep_rows(cache: KVCache, rows: list[int], room: int) -> KVCache | None:
    """``cache`` with only ``rows`` (in that order), its leading slots that no kept row uses
    dropped, and at least ``room`` free slots; ``None`` when no row is kept."""
    if not rows:
        return None
    kept = KVCache.__new__(KVCache)
    kept.__dict__.update({k: v for k, v in cache.__dict__.items() if k != "layers"})
    index = torch.tensor(rows, device=cache.layers[0].keys.device)
    kept.layers = [_keep_layer(layer, index, room) for layer in cache.layers]
    return kept


def _free_slots(cache: KVCache) -> int:
    return min(layer.keys.shape[-2] - layer.length for layer in cache.layers)


def _new_layer(like: AttentionLayer, keys, values, positions, length: int) -> AttentionLayer:
    layer = AttentionLayer(like.spec)
    layer.is_initialized, layer.device = True, keys.device
    layer.keys, layer.values, layer.positions = keys, values, positions
    layer.length = layer.prompt_slots = length
    used = positions[:, :, :length]
    layer.dense = like.spec.kind != SLIDING and bool((used >= 0).all())
    return layer


def _merge_layer(layers: list[AttentionLayer], room: int) -> AttentionLayer:
    length = max(layer.length for layer in layers)
    rows = sum(layer.keys.shape[0] for layer in layers)
    first = layers[0]
    heads = first.keys.shape[1]
    keys = first.keys.new_zeros((rows, heads, length + room, first.keys.shape[-1]))
    values = first.values.new_zeros((rows, heads, length + room, first.values.shape[-1]))
    positions = torch.full((rows, heads, length + room), -1, dtype=torch.long, device=keys.device)
    row = 0
    for layer in layers:
        b, n = layer.keys.shape[0], layer.length
        keys[row:row + b, :, length - n:length] = layer.keys[:, :, :n]
        values[row:row + b, :, length - n:length] = layer.values[:, :, :n]
        positions[row:row + b, :, length - n:length] = layer.positions[:, :, :n]
        row += b
    return _new_layer(first, keys, values, positions, length)


def _keep_layer(layer: AttentionLayer, index: torch.Tensor, room: int) -> AttentionLayer:
    positions = layer.positions.index_select(0, index)[:, :, :layer.length]
    used = (positions >= 0).any(dim=0).any(dim=0).nonzero()
    start = int(used[0]) if len(used) else layer.length
    length = layer.length - start
    free = max(room, layer.keys.shape[-2] - layer.length)
    keys = layer.keys.new_zeros((len(index), layer.keys.shape[1], length + free, layer.keys.shape[-1]))
    values = layer.values.new_zeros((len(index), layer.values.shape[1], length + free, layer.values.shape[-1]))
    keys[:, :, :length] = layer.keys[:, :, start:layer.length].index_select(0, index)
    values[:, :, :length] = layer.values[:, :, start:layer.length].index_select(0, index)
    kept_positions = torch.full(keys.shape[:3], -1, dtype=torch.long, device=keys.device)
    kept_positions[:, :, :length] = positions[:, :, start:]
    return _new_layer(layer, keys, values, kept_positions, length)
