"""Ragged heads without padding, for what is stored between requests (:mod:`snapkv_rag.documents.store`).

A layer whose heads keep different counts (KVzip's model-wide ranking, Ada-SnapKV) is computed and
decoded padded to its widest head: per head the empty slots first, at position ``-1`` with zero K/V,
then the kept ones (:mod:`snapkv_rag.methods.adaptive`). Stored like that, a document set holds the padding
too (the budget's bytes, the widest head holding the budget, with fewer positions kept). Packed, it
holds only what was kept:

    packed = pack(layer_kv)          # keys [N, D], values [N, D_v], positions [N], counts [H_kv]
    layer_kv = unpack(packed)        # the padded layer again, exactly (empty slots first per head)

``N`` is the kept slots of all heads together, head after head; ``counts[h]`` of them are head
``h``'s. A layer quantized under a ``kv_dtype`` (:mod:`snapkv_rag.kv.quantized`) keeps its 8-bit
keys and values and packs their scales ``key_scale``/``value_scale`` ``[N, G]`` the same way. A
layer whose empty slots are not all before its kept ones in every head is kept padded as it is
(``packed.padded``), so that unpacking never reorders anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .prompt_cache import LayerKV


@dataclass(frozen=True)
class PackedKV:
    """One stored layer: the kept slots of every head, one after another (see the module)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    counts: torch.Tensor
    width: int = 0  # the padded layer's slots per head (its widest head's, or more)
    padded: LayerKV | None = None  # a layout :func:`pack` does not flatten, kept as it was
    key_scale: torch.Tensor | None = None  # [N, G]: under a kv_dtype, the keys' scales (None: floats)
    value_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        source = self.padded if self.padded is not None else self
        extra = () if self.padded is not None else (self.counts,)
        return _bytes(source.positions, *extra) + self.kept_bytes

    @property
    def kept_bytes(self) -> int:
        """Keys and values held, with their scales (the padding included only for a layer kept padded)."""
        source = self.padded if self.padded is not None else self
        return _bytes(source.keys, source.values, source.key_scale, source.value_scale)

    @property
    def slot_bytes(self) -> int:
        """The bytes of one position of every head: keys, values and their scales."""
        source = self.padded if self.padded is not None else self
        heads = self.counts.shape[0]
        size = (
            source.keys.shape[-1] * source.keys.element_size() + source.values.shape[-1] * source.values.element_size()
        )
        if source.key_scale is not None:
            size += sum(s.shape[-1] * s.element_size() for s in (source.key_scale, source.value_scale))
        return heads * size


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _trailing(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [H], mask [H, C])``: each head's kept slots, and where they would lie right-aligned."""
    counts = (positions >= 0).sum(-1)
    rank = torch.arange(positions.shape[-1], device=positions.device)
    return counts, rank >= positions.shape[-1] - counts[:, None]


def pack(kv: LayerKV) -> PackedKV:
    """``kv`` (one row ``[1, H, C, ...]``) without its empty slots."""
    positions = kv.positions[0]
    counts, trailing = _trailing(positions)
    if not torch.equal(positions >= 0, trailing) or kv.keys.shape[0] != 1:
        empty = kv.keys.new_zeros(0)
        return PackedKV(empty, empty, empty.long(), counts, padded=kv)
    scales = [None if t is None else t[0][trailing].clone() for t in (kv.key_scale, kv.value_scale)]
    return PackedKV(
        kv.keys[0][trailing].clone(),
        kv.values[0][trailing].clone(),
        positions[trailing].clone(),
        counts,
        positions.shape[-1],
        None,
        *scales,
    )


def unpack(packed: PackedKV) -> LayerKV:
    """The padded layer ``[1, H, width, ...]`` again: per head its empty slots first (position -1,
    zero K/V), then its kept ones, exactly as :func:`pack` found it."""
    if packed.padded is not None:
        return packed.padded
    counts = packed.counts
    heads, widest = counts.shape[0], packed.width
    rank = torch.arange(widest, device=counts.device)
    trailing = rank >= widest - counts[:, None]
    keys = packed.keys.new_zeros((heads, widest, packed.keys.shape[-1]))
    values = packed.values.new_zeros((heads, widest, packed.values.shape[-1]))
    positions = torch.full((heads, widest), -1, dtype=packed.positions.dtype, device=packed.positions.device)
    keys[trailing], values[trailing], positions[trailing] = packed.keys, packed.values, packed.positions
    scales = []
    for packed_scale in (packed.key_scale, packed.value_scale):
        scale = None
        if packed_scale is not None:
            scale = packed_scale.new_zeros((heads, widest, packed_scale.shape[-1]))
            scale[trailing] = packed_scale
            scale = scale[None]
        scales.append(scale)
    return LayerKV(keys[None], values[None], positions[None], None, *scales)
