"""KVzip (Kim et al. 2025): query-agnostic, the model votes by re-reading the prompt."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require
from .snapkv import SnapKVConfig


@dataclass(frozen=True)
class KVzipConfig(SnapKVConfig):
    """KVzip (Kim et al. 2025): query-agnostic, the model votes by re-reading. After the prompt, the
    model is run over a "repeat the previous context" instruction followed by the prompt again (in
    the same forward pass; nothing of that pass is kept or decoded); each prompt position scores the
    largest weight the re-reading queries give it (the maximum over those queries and over the
    query heads sharing the KV head, in chunks of ``chunk`` queries), pooled with ``kernel_size``
    (default 1: none). What the documents need to be rebuilt is kept, whatever the question. It
    costs a second prompt's worth of prefill; a model with recurrent layers one more (the re-read
    would run their states on: they are taken from a pass over the prompt alone).

    ``share`` says who shares the budget (:mod:`snapkv_rag.methods.shared_budget`). The budget is a
    memory bound: no layer keeps more than ``max_capacity_prompt`` slots per head (a request's cache
    is decoded with every layer padded to its widest head and as wide as its widest layer, so more in
    one head or layer would cost those bytes in all of them). ``"model"`` (default, the paper's):
    every position of every layer and KV head is ranked together, each layer's part of the ranking
    followed until its first head is full, plus the last ``window_size`` positions: heads hold
    different counts within SnapKV's bytes (``Compressed.kv_bytes`` says how many; a stored document
    set packs the heads without padding, :mod:`snapkv_rag.kv.ragged`). ``fit="slots"``: the best
    positions that fit the even split's slots once padded. ``"layer"``: the same ranking's count per
    layer, split evenly between its heads, and ``"head"``: every head of every layer the same count
    (both dense: within the bound, the even split). A shared ranking holds every layer's full K/V
    until the pass ends. ``sink_tokens``: the first positions, always kept (attention sinks).
    """

    kernel_size: int = 1
    chunk: int = 512
    share: str = "model"
    sink_tokens: int = 4
    fit: str = "positions"

    method = "kvzip"
    query_agnostic = True
    rereads = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            isinstance(self.chunk, int) and self.chunk > 0, "chunk", f"must be a positive integer, got {self.chunk!r}"
        )
        require(
            self.share in ("head", "layer", "model"), "share", f"must be 'head', 'layer' or 'model', got {self.share!r}"
        )
        require(
            isinstance(self.sink_tokens, int) and self.sink_tokens >= 0,
            "sink_tokens",
            f"must be a non-negative integer, got {self.sink_tokens!r}",
        )
        require(self.fit in ("positions", "slots"), "fit", f"must be 'positions' or 'slots', got {self.fit!r}")

    def ranked_across_layers(self, sliding: bool) -> bool:
        """Whether a layer's scores wait for the end of the pass, to be ranked with other layers'
        (``share`` "layer" or "model"; a sliding-window layer is always selected on its own)."""
        return self.share != "head" and not sliding

    def select(self, query, keys, values, attention_mask, layer_idx, num_layers, *, shared=False, **scoring):
        raise ValueError(
            "kvzip: its votes come from a re-read pass that the engine's prefill runs "
            "(kvzip_select takes the re-reading queries)"
        )
