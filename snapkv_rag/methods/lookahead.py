"""Lookahead SnapKV: the observation window reaches into a drafted answer."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require
from .ada import AdaSnapKVConfig


@dataclass(frozen=True)
class LookaheadSnapKVConfig(AdaSnapKVConfig):
    """Lookahead SnapKV: the observation window reaches past the prompt into the answer. Before
    compressing, the model drafts the first ``lookahead`` tokens of its greedy answer over the full
    cache; the queries of those drafted tokens vote beside the prompt's last ``window_size`` queries,
    then the draft is dropped and the answer is decoded from the compressed cache as for any method.
    By default (``floor=1.0``) every KV head keeps the same count: the cache has SnapKV's shapes and
    bytes at the same budget, so it decodes as fast; a lower ``floor`` shares each layer's budget
    between its heads by vote as :class:`AdaSnapKVConfig` does (ragged heads, padded to the widest,
    which holds at most the budget: the same bytes, fewer positions kept).
    The draft costs at most ``lookahead`` passes over the full prompt, fewer where its next tokens
    are guessed right from the prompt or the model's earlier drafts (counted in the selection time);
    sliding-window layers vote with the prompt's window alone. Not served from the prefix cache.
    The draft itself runs in :mod:`snapkv_rag.runtime.draft`."""

    floor: float = 1.0
    lookahead: int = 8

    method = "lookahead"
    drafts = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            isinstance(self.lookahead, int) and not isinstance(self.lookahead, bool) and 1 <= self.lookahead <= 256,
            "lookahead",
            f"must be a number of drafted tokens from 1 to 256, got {self.lookahead!r}",
        )
