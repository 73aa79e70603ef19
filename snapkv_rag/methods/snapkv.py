"""SnapKV (Li et al. 2024): the prefix positions the question's window votes for."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require
from .base import POOLINGS, Method, check_budget


@dataclass(frozen=True)
class SnapKVConfig(Method):
    """SnapKV (Li et al. 2024): keep the prefix positions that the last ``window_size`` prompt
    queries attend to most, clustered by 1-D pooling, plus the whole observation window.

    ``max_capacity_prompt`` is the number of prompt positions kept per layer and KV head
    (window included; default 1024). Prompts of at most that many tokens are not compressed.
    Or give ``ratio``, the share of each prompt to keep (``ratio=0.5`` keeps half), never fewer
    than ``min_capacity_prompt`` tokens (default 128): short prompts are not cut to nothing.
    """

    max_capacity_prompt: int | None = None
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    ratio: float | None = None
    min_capacity_prompt: int = 128

    method = "snapkv"

    def __post_init__(self) -> None:
        require(
            isinstance(self.window_size, int) and self.window_size > 0,
            "window_size",
            f"must be a positive integer, got {self.window_size!r}",
        )
        check_budget(self, "window_size", self.window_size)
        require(
            isinstance(self.kernel_size, int) and self.kernel_size > 0 and self.kernel_size % 2 == 1,
            "kernel_size",
            f"must be a positive odd integer, got {self.kernel_size!r}",
        )
        require(self.pooling in POOLINGS, "pooling", f"must be one of {POOLINGS}, got {self.pooling!r}")

    @property
    def prompt_queries(self) -> int:
        return self.window_size

    def select(self, query, keys, values, attention_mask, layer_idx, num_layers, *, shared=False, **scoring):
        from . import selection  # the tensor work loads at the first selection, not with the settings

        return selection.snapkv_select(
            query[..., -self.window_size :, :],
            keys,
            values,
            self,
            attention_mask,
            capacity=self.budget_for_layer(layer_idx, num_layers),
            shared=shared,
            **scoring,
        )
