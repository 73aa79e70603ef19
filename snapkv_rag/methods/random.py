"""Random prefix positions (seeded): the floor every method must beat."""

from __future__ import annotations

from dataclasses import dataclass

from .base import first_head
from .recent import RecentWindowConfig


@dataclass(frozen=True)
class RandomConfig(RecentWindowConfig):
    """Random prefix positions (seeded) plus a recent window: the floor any method must beat."""

    seed: int = 0

    method = "random"
    query_agnostic = True
    per_row = True  # the draws depend on the batch's shape

    def select(self, query, keys, values, attention_mask, layer_idx, num_layers, *, shared=False, **scoring):
        from . import selection  # the tensor work loads at the first selection, not with the settings

        keys, values = first_head(keys, values, shared)
        return selection.random_select(keys, values, self, attention_mask, layer_idx=layer_idx)
