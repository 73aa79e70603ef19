"""Compression settings: one small dataclass per method, validated on construction.

Most methods keep, per (batch row, KV head), the same number of prompt positions, so the
compressed cache is an ordinary dense tensor of shape [B, H_kv, C, D] (head-adaptive SnapKV and
KVzip's shared budget are ragged: padded, their empty slots masked). The methods differ only in
how they score the prefix positions; the selection itself lives in :mod:`snapkv_rag.methods.selection`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

_POOLINGS = ("max", "avg")
DEFAULT_BUDGET = 1024


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _check_budget(config, floor_name: str, floor: int) -> None:
    """The budget in tokens (``max_capacity_prompt``, default 1024) or as a share of each prompt
    (``ratio``, never below ``min_capacity_prompt``): one of the two, validated against the kept
    window (``floor_name`` = ``floor``)."""
    if config.ratio is None:
        if config.max_capacity_prompt is None:
            object.__setattr__(config, "max_capacity_prompt", DEFAULT_BUDGET)
        _require(isinstance(config.max_capacity_prompt, int) and config.max_capacity_prompt > floor,
                 "max_capacity_prompt",
                 f"must be an integer larger than {floor_name}={floor}, got {config.max_capacity_prompt!r}")
        return
    _require(config.max_capacity_prompt is None, "ratio", "give max_capacity_prompt (tokens kept) or ratio (a "
             f"share of each prompt), not both; got max_capacity_prompt={config.max_capacity_prompt!r}")
    _require(isinstance(config.ratio, (int, float)) and not isinstance(config.ratio, bool) and 0 < config.ratio <= 1,
             "ratio", f"must be a share of the prompt in (0, 1], e.g. 0.5, got {config.ratio!r}")
    _require(isinstance(config.min_capacity_prompt, int) and config.min_capacity_prompt > floor,
             "min_capacity_prompt",
             f"must be an integer larger than {floor_name}={floor}, got {config.min_capacity_prompt!r}")


@dataclass(frozen=True)
class PromptSpans:
    """Where a RAG prompt's parts lie, in tokens counted back from the END of the prompt (so
    ``-n`` is the first of ``n`` tokens): ``documents`` one ``(start, stop)`` per document, in
    order, ``stop`` exclusive and ``<= 0``; ``question`` where the question starts. Counted from the
    end, they hold unchanged for any slice of the prompt that ends where it ends (a sliding layer's
    window, a left-padded row). Built by :func:`snapkv_rag.request.text.encode_request`."""

    documents: tuple[tuple[int, int], ...]
    question: int

    def __post_init__(self) -> None:
        last = None
        for start, stop in self.documents:
            _require(isinstance(start, int) and isinstance(stop, int) and start < stop <= 0, "spans",
                     f"each document span must be (start, stop) with start < stop <= 0, got {(start, stop)!r}")
            _require(last is None or start >= last, "spans", "document spans must be in order, not overlapping")
            last = stop
        _require(isinstance(self.question, int) and self.question < 0 and (last is None or self.question >= last),
                 "spans", f"question must start after the last document and before the end, got {self.question!r}")

    def in_slice(self, length: int) -> list[tuple[int, int]]:
        """The document spans as positions of a slice of ``length`` tokens that ends where the
        prompt ends; documents wholly before the slice are left out, one cut by it is clipped."""
        return [(max(length + start, 0), length + stop) for start, stop in self.documents if length + stop > 0]


class _Budget:
    """What the method configs share about their budget."""

    def with_spans(self, spans: PromptSpans | None):
        """This config bound to one prompt's document spans: only the document-aware methods use
        them (:class:`DocSnapKVConfig`); every other method is returned as it is."""
        return self

    def for_prompt(self, prompt_tokens: int):
        """This config with its budget in tokens for a prompt of ``prompt_tokens``: a ``ratio``
        becomes ``max(min_capacity_prompt, ceil(ratio * prompt_tokens))`` (a prompt no longer than
        that is kept whole); a budget in tokens is returned as it is."""
        if self.ratio is None:
            return self
        budget = max(self.min_capacity_prompt, math.ceil(self.ratio * prompt_tokens))
        return replace(self, max_capacity_prompt=budget, ratio=None)


@dataclass(frozen=True)
class SnapKVConfig(_Budget):
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
        _require(isinstance(self.window_size, int) and self.window_size > 0, "window_size",
                 f"must be a positive integer, got {self.window_size!r}")
        _check_budget(self, "window_size", self.window_size)
        _require(isinstance(self.kernel_size, int) and self.kernel_size > 0 and self.kernel_size % 2 == 1,
                 "kernel_size", f"must be a positive odd integer, got {self.kernel_size!r}")
        _require(self.pooling in _POOLINGS, "pooling", f"must be one of {_POOLINGS}, got {self.pooling!r}")

    def budget_for_layer(self, layer_idx: int, num_layers: int) -> int:
        return self.max_capacity_prompt


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
        _require(0.0 < self.min_ratio <= 1.0, "min_ratio", f"must be in (0, 1], got {self.min_ratio!r}")

    def budget_for_layer(self, layer_idx: int, num_layers: int) -> int:
        bottom = self.window_size + (self.max_capacity_prompt - self.window_size) * self.min_ratio
        top = 2 * self.max_capacity_prompt - bottom
        if num_layers == 1:
            return self.max_capacity_prompt
        budget = top - (top - bottom) * layer_idx / (num_layers - 1)
        return max(self.window_size + 1, int(round(budget)))


@dataclass(frozen=True)
class DocSnapKVConfig(SnapKVConfig):
    """Document-aware SnapKV: SnapKV's votes, read with the prompt's structure.

    Every token outside the documents (system turn, instruction, question, the window) is kept;
    the rest of the budget is shared out between the documents in proportion to the vote mass each
    receives (averaged over the layer's heads), so a document nobody attends to can go whole and
    the one the question reads keeps more; inside its share each head keeps its own best-voted
    tokens, pooled within the document only (a cluster never spills into the next one). ``spans``
    is bound per request by the engine (:meth:`with_spans`); without spans (no documents, or a
    prompt built by hand) this is plain SnapKV with the same settings.
    """

    spans: PromptSpans | None = None

    method = "docsnapkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.spans is None or isinstance(self.spans, PromptSpans), "spans",
                 f"must be a PromptSpans or None, got {type(self.spans).__name__}")

    def with_spans(self, spans: PromptSpans | None) -> DocSnapKVConfig:
        return replace(self, spans=spans)


@dataclass(frozen=True)
class AdaSnapKVConfig(SnapKVConfig):
    """Ada-SnapKV (Feng et al. 2024, AdaKV): SnapKV's votes with the layer's budget shared between its
    KV heads by vote, not split evenly. Each head keeps its ``floor`` share of the even split (the
    safeguard) and the window; the rest of the layer's ``H_kv x (max_capacity_prompt - window)``
    prefix slots go to the best-voted positions of any head, so a head whose attention is spread
    keeps more and a focused head less. The cache holds each layer padded only to its largest
    head: shorter heads' empty slots are masked, never attended (:mod:`snapkv_rag.methods.adaptive`).
    """

    floor: float = 0.2

    method = "adasnapkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(isinstance(self.floor, (int, float)) and not isinstance(self.floor, bool) and 0 <= self.floor <= 1,
                 "floor", f"must be a share between 0 and 1, got {self.floor!r}")


@dataclass(frozen=True)
class LookaheadSnapKVConfig(AdaSnapKVConfig):
    """Lookahead SnapKV: the observation window reaches past the prompt into the answer. Before
    compressing, the model drafts the first ``lookahead`` tokens of its greedy answer over the full
    cache; the queries of those drafted tokens vote beside the prompt's last ``window_size`` queries,
    then the draft is dropped and the answer is decoded from the compressed cache as for any method.
    By default (``floor=1.0``) every KV head keeps the same count: the cache has SnapKV's shapes and
    bytes at the same budget, so it decodes as fast; a lower ``floor`` shares each layer's budget
    between its heads by vote as :class:`AdaSnapKVConfig` does (ragged heads, padded: more bytes).
    The draft costs at most ``lookahead`` passes over the full prompt, fewer where its next tokens
    are guessed right from the prompt or the model's earlier drafts (counted in the selection time);
    sliding-window layers vote with the prompt's window alone. Not served from the prefix cache."""

    floor: float = 1.0
    lookahead: int = 8

    method = "lookahead"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(isinstance(self.lookahead, int) and not isinstance(self.lookahead, bool) and 1 <= self.lookahead <= 256,
                 "lookahead", f"must be a number of drafted tokens from 1 to 256, got {self.lookahead!r}")


@dataclass(frozen=True)
class KeyNormConfig(SnapKVConfig):
    """Key-norm selection (Devoto et al. 2024): query-agnostic, the prompt's own keys decide. Keys
    of small L2 norm draw the most attention in practice, so each head keeps the prefix positions
    whose keys are shortest (norms in float64, pooled with ``kernel_size`` like SnapKV's votes, so
    kept tokens come in clusters), plus the last ``window_size`` positions. No question is looked
    at: the same documents keep the same tokens whatever is asked of them, and no attention scores
    are computed (the cheapest method after StreamingLLM). Same fields as :class:`SnapKVConfig`.
    """

    method = "keynorm"


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

    ``share`` says who shares the budget (:mod:`snapkv_rag.methods.shared_budget`). ``"model"`` (default,
    the paper's): every position of every layer and KV head is ranked together and the best ones
    kept, as many as the even split would keep in all (``fit="positions"``), plus the last
    ``window_size`` positions; heads then hold different counts, and each layer is decoded padded
    to its widest head, so a request's cache holds more bytes than the kept share
    (``Compressed.kv_bytes`` says how many; a stored document set packs the heads without padding,
    :mod:`snapkv_rag.kv.ragged`). ``fit="slots"``: the best positions that fit the even split's slots once padded
    (the kept share's bytes, fewer positions). ``"layer"``: the same ranking's count per layer,
    split evenly between its heads; ``"head"``: every head of every layer the same count (both
    dense). A shared ranking holds every layer's full K/V until the pass ends. ``sink_tokens``: the
    first positions, always kept (attention sinks).
    """

    kernel_size: int = 1
    chunk: int = 512
    share: str = "model"
    sink_tokens: int = 4
    fit: str = "positions"

    method = "kvzip"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(isinstance(self.chunk, int) and self.chunk > 0, "chunk",
                 f"must be a positive integer, got {self.chunk!r}")
        _require(self.share in ("head", "layer", "model"), "share",
                 f"must be 'head', 'layer' or 'model', got {self.share!r}")
        _require(isinstance(self.sink_tokens, int) and self.sink_tokens >= 0, "sink_tokens",
                 f"must be a non-negative integer, got {self.sink_tokens!r}")
        _require(self.fit in ("positions", "slots"), "fit", f"must be 'positions' or 'slots', got {self.fit!r}")


@dataclass(frozen=True)
class StreamingLLMConfig(_Budget):
    """StreamingLLM (Xiao et al. 2023): the first ``sink_tokens`` positions plus the most recent ones."""

    max_capacity_prompt: int | None = None
    sink_tokens: int = 4
    ratio: float | None = None
    min_capacity_prompt: int = 128

    method = "streamingllm"

    def __post_init__(self) -> None:
        _require(isinstance(self.sink_tokens, int) and self.sink_tokens >= 0, "sink_tokens",
                 f"must be a non-negative integer, got {self.sink_tokens!r}")
        _check_budget(self, "sink_tokens", self.sink_tokens)

    def budget_for_layer(self, layer_idx: int, num_layers: int) -> int:
        return self.max_capacity_prompt


@dataclass(frozen=True)
class _RecentWindowConfig(_Budget):
    """Shared by the methods that keep the last ``recent_size`` positions plus scored prefix ones."""

    max_capacity_prompt: int | None = None
    recent_size: int = 32
    ratio: float | None = None
    min_capacity_prompt: int = 128

    def __post_init__(self) -> None:
        _require(isinstance(self.recent_size, int) and self.recent_size > 0, "recent_size",
                 f"must be a positive integer, got {self.recent_size!r}")
        _check_budget(self, "recent_size", self.recent_size)

    def budget_for_layer(self, layer_idx: int, num_layers: int) -> int:
        return self.max_capacity_prompt


@dataclass(frozen=True)
class H2OConfig(_RecentWindowConfig):
    """H2O-style heavy hitters: attention accumulated over *all* prompt queries, plus a recent window."""

    method = "h2o"


@dataclass(frozen=True)
class RandomConfig(_RecentWindowConfig):
    """Random prefix positions (seeded) plus a recent window: the floor any method must beat."""

    seed: int = 0

    method = "random"


CompressionConfig = SnapKVConfig | StreamingLLMConfig | H2OConfig | RandomConfig
"""Any of the method configs above; ``PyramidKVConfig``, ``DocSnapKVConfig``, ``KeyNormConfig`` and
``KVzipConfig`` are ``SnapKVConfig``s."""

COMPRESSION_CONFIGS = (SnapKVConfig, StreamingLLMConfig, H2OConfig, RandomConfig)

__all__ = [
    "SnapKVConfig",
    "PyramidKVConfig",
    "DocSnapKVConfig",
    "AdaSnapKVConfig",
    "LookaheadSnapKVConfig",
    "KeyNormConfig",
    "KVzipConfig",
    "PromptSpans",
    "StreamingLLMConfig",
    "H2OConfig",
    "RandomConfig",
    "CompressionConfig",
    "COMPRESSION_CONFIGS",
]

MAX_N, MAX_LOGPROBS = 16, 20  # answers per request; alternatives reported per token
