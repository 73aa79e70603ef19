"""H2O-style heavy hitters: attention accumulated over every prompt query."""

from __future__ import annotations

from dataclasses import dataclass

from .recent import RecentWindowConfig


@dataclass(frozen=True)
class H2OConfig(RecentWindowConfig):
    """H2O-style heavy hitters: attention accumulated over *all* prompt queries, plus a recent window."""

    method = "h2o"

    @property
    def prompt_queries(self) -> None:
        return None  # every prompt query votes: never served from a cached prefix

    def select(self, query, keys, values, attention_mask, layer_idx, num_layers, *, shared=False, **scoring):
        from . import selection  # the tensor work loads at the first selection, not with the settings

        return selection.h2o_select(query, keys, values, self, attention_mask, shared=shared, **scoring)
