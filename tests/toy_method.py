"""A method written as a user would add one: this file and one registry entry, nothing else.

``recent`` keeps each layer's last ``max_capacity_prompt`` prompt positions (a plain sliding window
over the prompt), so what it keeps can be checked from its budget alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snapkv_rag.methods.base import Method, check_budget, first_head


@dataclass(frozen=True)
class RecentConfig(Method):
    """The prompt's last ``max_capacity_prompt`` positions (or ``ratio`` of it), nothing else."""

    max_capacity_prompt: int | None = None
    ratio: float | None = None
    min_capacity_prompt: int = 16

    method = "recent"
    query_agnostic = True

    def __post_init__(self) -> None:
        check_budget(self, "no window", 0)

    def select(self, query, keys, values, attention_mask, layer_idx, num_layers, *, shared=False, **scoring):
        keys, values = first_head(keys, values, shared)
        length = keys.shape[-2]
        start = max(length - self.budget_for_layer(layer_idx, num_layers), 0)
        kept = torch.arange(start, length, device=keys.device).expand(keys.shape[0], keys.shape[1], -1)
        return keys[..., start:, :], values[..., start:, :], kept
