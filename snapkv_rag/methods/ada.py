"""Ada-SnapKV (head-adaptive budgets): SnapKV's votes, the layer's budget shared between its heads."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require
from .snapkv import SnapKVConfig


@dataclass(frozen=True)
class AdaSnapKVConfig(SnapKVConfig):
    """Ada-SnapKV (Feng et al. 2024, AdaKV): SnapKV's votes with the layer's budget shared between its
    KV heads by vote, not split evenly. Each head keeps its ``floor`` share of the even split (the
    safeguard) and the window; the rest of the layer's ``H_kv x (max_capacity_prompt - window)``
    prefix slots go to the best-voted positions of any head, so a head whose attention is spread
    keeps more and a focused head less. The cache holds each layer padded to its largest head
    (shorter heads' empty slots are masked, never attended), and the budget is a memory bound: no
    head keeps more than ``max_capacity_prompt`` positions (window included), so the layer holds
    SnapKV's bytes at the same budget, the votes followed until the first head is full, which keeps
    fewer positions than SnapKV's even split when the heads' votes differ
    (:mod:`snapkv_rag.methods.adaptive`).
    """

    floor: float = 0.2

    method = "adasnapkv"
    ragged = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            isinstance(self.floor, (int, float)) and not isinstance(self.floor, bool) and 0 <= self.floor <= 1,
            "floor",
            f"must be a share between 0 and 1, got {self.floor!r}",
        )

    def select(self, query, keys, values, attention_mask, layer_idx, num_layers, *, shared=False, **scoring):
        from . import adaptive  # the tensor work loads at the first selection, not with the settings

        if shared:  # one latent for every head: one selection, SnapKV's
            return super().select(query, keys, values, attention_mask, layer_idx, num_layers, shared=True, **scoring)
        return adaptive.ada_snapkv_select(
            query[..., -self.window_size :, :],
            keys,
            values,
            self,
            attention_mask,
            capacity=self.budget_for_layer(layer_idx, num_layers),
            **scoring,
        )
