"""What the methods that keep a recent window plus scored prefix positions share (H2O, random)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require
from .base import Method, check_budget


@dataclass(frozen=True)
class RecentWindowConfig(Method):
    """The last ``recent_size`` positions plus ``max_capacity_prompt - recent_size`` scored prefix ones."""

    max_capacity_prompt: int | None = None
    recent_size: int = 32
    ratio: float | None = None
    min_capacity_prompt: int = 128

    def __post_init__(self) -> None:
        require(
            isinstance(self.recent_size, int) and self.recent_size > 0,
            "recent_size",
            f"must be a positive integer, got {self.recent_size!r}",
        )
        check_budget(self, "recent_size", self.recent_size)
