"""PyramidKV: SnapKV's votes, with budgets that shrink with depth."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require
from .snapkv import SnapKVConfig


@dataclass(frozen=True)
class PyramidKVConfig(SnapKVConfig):
    """PyramidKV: SnapKV votes with per-layer budgets that shrink linearly with depth.

    Budgets go linearly from ``top`` (first layer) to ``bottom`` (last layer), with
    ``bottom = window_size + (max_capacity_prompt - window_size) * min_ratio`` and
    ``top = 2 * max_capacity_prompt - bottom``, so that the mean over layers stays
    ``max_capacity_prompt``: the same total memory as SnapKV at that budget.
    """

    min_ratio: float = 0.2

    method = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0.0 < self.min_ratio <= 1.0, "min_ratio", f"must be in (0, 1], got {self.min_ratio!r}")

    def budget_for_layer(self, layer_idx: int, num_layers: int) -> int:
        bottom = self.window_size + (self.max_capacity_prompt - self.window_size) * self.min_ratio
        top = 2 * self.max_capacity_prompt - bottom
        if num_layers == 1:
            return self.max_capacity_prompt
        budget = top - (top - bottom) * layer_idx / (num_layers - 1)
        return max(self.window_size + 1, int(round(budget)))
