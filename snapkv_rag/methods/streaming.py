"""StreamingLLM (Xiao et al. 2023): the first few positions and the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require
from .base import Method, check_budget, first_head


@dataclass(frozen=True)
class StreamingLLMConfig(Method):
    """StreamingLLM (Xiao et al. 2023): the first ``sink_tokens`` positions plus the most recent ones."""

    max_capacity_prompt: int | None = None
    sink_tokens: int = 4
    ratio: float | None = None
    min_capacity_prompt: int = 128

    method = "streamingllm"
    query_agnostic = True

    def __post_init__(self) -> None:
        require(
            isinstance(self.sink_tokens, int) and self.sink_tokens >= 0,
            "sink_tokens",
            f"must be a non-negative integer, got {self.sink_tokens!r}",
        )
        check_budget(self, "sink_tokens", self.sink_tokens)

    def select(self, query, keys, values, attention_mask, layer_idx, num_layers, *, shared=False, **scoring):
        from . import selection  # the tensor work loads at the first selection, not with the settings

        keys, values = first_head(keys, values, shared)
        return selection.streaming_select(keys, values, self, attention_mask)
