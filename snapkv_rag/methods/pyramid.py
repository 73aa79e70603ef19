"""PyramidKV: SnapKV's votes, with budgets that shrink with depth."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require
from .snapkv import SnapKVConfig


@dataclass(frozen=True)
class PyramidKVConfig(SnapKVConfig):
    """PyramidKV: SnapKV votes with per-layer budgets that shrink linearly with depth.

    Budgets go linearly from ``max_capacity_prompt`` (first layer) to
    ``bottom = window_size + (max_capacity_prompt - window_size) * min_ratio`` (last layer). The
    budget is a memory bound: no layer keeps more than ``max_capacity_prompt`` (a request's cache is
    decoded with every layer as wide as its widest, so a layer above the budget would cost its bytes
    in every layer); the deeper layers keep fewer positions in those bytes, their slots left empty.
    (The paper's pyramid keeps the mean at the budget, with its first layers above it.)
    """

    min_ratio: float = 0.2

    method = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0.0 < self.min_ratio <= 1.0, "min_ratio", f"must be in (0, 1], got {self.min_ratio!r}")

    def budget_for_layer(self, layer_idx: int, num_layers: int) -> int:
        bottom = self.window_size + (self.max_capacity_prompt - self.window_size) * self.min_ratio
        top = self.max_capacity_prompt
        if num_layers == 1:
            return top
        budget = top - (top - bottom) * layer_idx / (num_layers - 1)
        return min(top, max(self.window_size + 1, int(round(budget))))
