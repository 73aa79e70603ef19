"""A document prefix cache: the full, uncompressed K/V of a prompt's instruction + documents,
kept after its prefill so that the next question over the same documents prefills only itself.

What is cached: for a RAG prompt (documents first, question last, see :mod:`snapkv_rag.request.prompts`)
the tokens before ``"Question: "`` -- chat template head, system turn, documents, instruction --
per attention layer their keys and values, and the queries of their last :data:`QUERY_TAIL`
positions (an observation window that reaches back into the instruction votes with them). The
boundary is where :class:`~snapkv_rag.config.PromptSpans` says the question starts; it is a
token boundary of the prompt as encoded, and a lookup compares token ids exactly, so a prompt that
differs anywhere before it (a document, its order, the instruction) never hits.

On a hit the runner prefills only the rest (question + chat template tail) on top of the cached
K/V, at their own positions; every layer is then compressed exactly as without the cache: the
observation window's votes are the window's queries over all the prompt's keys. The split prefill
computes the same sums in another order, so float rounding may differ in the last bits (measured in
``benchmarks/prefix_cache.py``).

Multi-head latent attention is cached as its latents (what the model's cache holds; the votes use
the keys the model expands from them over the whole prompt). Recurrent and hybrid layers: the
conv / SSM states at the prefix's end are stored too; a whole-prompt prefill does not pass through
that point, so a prompt whose prefix is stored runs in two passes (the prefix, kept; then the rest
from it, as on a hit), where the model continues a state through a multi-token pass
(:func:`snapkv_rag.models.layer_kinds.state_break`; else they are not cached, and the log says why). Not cached (a full prefill, said
once in the log): H2O, which votes with every prompt query.

Under an 8-bit ``kv_dtype`` (:mod:`snapkv_rag.kv.quantized`) entries stay in full precision: a
prefix is consumed by a prefill (the rest of the prompt attends to it, and the selection votes
over it as over a whole prompt's K/V), never by a decode step; only the compressed cache made
from it is quantized, after its selection, as any prompt's is.

Entries are immutable: stored as clones, and a hit concatenates them with the new tokens' K/V
into new tensors, so no request writes into them. The cache is bounded by bytes, least recently
used first out; one lock makes it safe for every caller of one engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.layer_kinds import FULL, LATENT, NONE, RECURRENT, SLIDING, LayerSpec
from .lru import ByteLRU

log = logging.getLogger("snapkv_rag")

DEFAULT_BYTES = 1 << 30
QUERY_TAIL = 64
"""Queries kept of a prefix's last positions: an observation window up to this many tokens
longer than the question is served from the cache."""


@dataclass(frozen=True)
class PrefixLayer:
    """One attention layer of a cached prefix: ``keys``/``values`` ``[1, H_kv, P, D]`` and the
    queries of its last positions ``[1, H, T, D]`` (RoPE applied, as the attention saw them)."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor


@dataclass(frozen=True)
class Prefix:
    """A cached prefix: its token ids and, per layer, a :class:`PrefixLayer` (``None`` for a layer
    that holds nothing, an MLP-only one)."""

    ids: tuple[int, ...]
    layers: tuple[PrefixLayer | None, ...]
    states: tuple = ()  # per layer its conv / SSM state at the prefix's end (None: none); () without any

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if layer is not None
            for t in (layer.keys, layer.values, layer.queries)
        ) + sum(map(state_bytes, self.states))

    @property
    def query_tail(self) -> int:
        return min((layer.queries.shape[-2] for layer in self.layers if layer is not None), default=0)


def state_bytes(state) -> int:
    """The bytes of a recurrent layer's state object (its conv and SSM tensors)."""
    if state is None:
        return 0
    tensors = [*state.conv_states.values(), *state.recurrent_states.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class PrefixStats:
    """Counters of a :class:`PrefixCache` (a snapshot)."""

    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    stored: int = 0
    evicted: int = 0
    entries: int = 0
    bytes_used: int = 0
    max_bytes: int = 0

    def snapshot(self, lru: ByteLRU) -> PrefixStats:
        """These counters with ``lru``'s puts, evictions, entries and bytes (a copy)."""
        return type(self)(
            self.hits,
            self.misses,
            self.tokens_saved,
            lru.stored,
            lru.evicted,
            len(lru.entries),
            lru.bytes,
            lru.max_bytes,
        )


def boundary(input_ids: Sequence[int], spans) -> int | None:
    """The prefix length of a prompt: the tokens before its question (``spans.question``, counted
    from the end); ``None`` without spans (no documents, or a tokenizer without offsets)."""
    if spans is None:
        return None
    at = len(input_ids) + spans.question
    return at if 0 < at < len(input_ids) else None


def unsupported(specs: Sequence[LayerSpec], state_break: str | None = "no multi-token continuation") -> str | None:
    """Why a model's prompts cannot be reused from a prefix (``None``: they can). ``state_break``: why
    a prompt's rest cannot run on from stored recurrent states in one pass
    (:func:`snapkv_rag.models.layer_kinds.state_break`; ``None``: it can)."""
    if state_break is not None and any(spec.state for spec in specs):
        return f"its recurrent layers cannot be continued: {state_break}"
    for i, spec in enumerate(specs):
        if spec.kind not in (FULL, SLIDING, LATENT, NONE, RECURRENT):
            return (
                f"layer {i} is {spec.kind}{' with a recurrent state' if spec.state else ''}: a prefix cache "
                "reuses plain attention K/V only"
            )
    return None


def queries_needed(methods: Mapping[str, Any]) -> int | None:
    """How many of the prompt's last queries the selection reads under ``methods`` (``None``: all
    of them, H2O's; it is then not served from a prefix)."""
    needed = 0
    for method in methods.values():
        wanted = 0 if method is None else method.prompt_queries
        if wanted is None:
            return None
        needed = max(needed, wanted)
    return needed


class PrefixCache:
    """A byte-bounded LRU of :class:`Prefix` entries, keyed by their token ids. ``max_bytes`` 0
    stores nothing (and counts nothing)."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prefix_cache_bytes: must be a number of bytes >= 0 (0 disables), got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._lru = ByteLRU(max_bytes, lambda prefix: prefix.nbytes)
        self._entries = self._lru.entries  # token ids -> Prefix, least recently used first
        self._lock = threading.Lock()
        self._counts = PrefixStats()
        self._said: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(self, ids: Sequence[int], limit: int | None = None, queries: int = 0) -> Prefix | None:
        """The longest cached prefix of ``ids``, at most ``limit`` tokens long and leaving at least
        one token to prefill, whose last queries and the rest of ``ids`` give ``queries`` queries
        (an observation window); it is then the most recently used. Counts a hit or a miss."""
        key = tuple(ids)
        limit = len(key) - 1 if limit is None else min(limit, len(key) - 1)
        with self._lock:
            best = None
            for ids_of, entry in self._entries.items():
                n = len(ids_of)
                if (
                    n <= limit
                    and (best is None or n > best.length)
                    and entry.query_tail + len(key) - n >= queries
                    and key[:n] == ids_of
                ):
                    best = entry
            if best is None:
                self._counts.misses += 1
                return None
            self._entries.move_to_end(best.ids)
            self._counts.hits += 1
            self._counts.tokens_saved += best.length
            return best

    def store(self, prefix: Prefix) -> bool:
        """Keep ``prefix`` (its tensors must be its own: clones), evicting the least recently used
        entries until it fits; one larger than the whole cache is not kept."""
        with self._lock:
            return self._lru.put(prefix.ids, prefix)

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    def stats(self) -> PrefixStats:
        with self._lock:
            return self._counts.snapshot(self._lru)

    def say_once(self, reason: str) -> None:
        """Log once per reason why a prompt was prefilled whole."""
        with self._lock:
            if reason in self._said:
                return
            self._said.add(reason)
        log.info("snapkv_rag: prefix cache not used: %s (prefilled whole, never reused)", reason)


@dataclass
class Capture:
    """While a prompt that will be stored runs: the first ``length`` positions of every attention
    layer (cloned), filled in by the compressor's hook. Past ``max_bytes`` it lets go of what it
    took and takes nothing more (``too_big``): a prompt longer than the cache can hold never keeps
    every layer's full K/V alive at once, which the layer-by-layer compression avoids."""

    length: int
    max_bytes: int
    queries: int = QUERY_TAIL  # the last positions whose queries are kept
    own: bool = True  # clone the K/V (False: keep the pass's own tensors, for a caller that holds them anyway)
    layers: list[PrefixLayer | None] = field(default_factory=list)
    nbytes: int = 0
    too_big: bool = False

    def __call__(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.too_big:
            return
        p = self.length
        tail = min(self.queries, p)
        parts = (keys[:, :, :p], values[:, :, :p], query[:, :, p - tail : p])
        self.nbytes += sum(t.numel() * t.element_size() for t in parts)
        if self.nbytes > self.max_bytes:
            self.too_big, self.layers = True, []
            return
        while len(self.layers) <= layer_idx:
            self.layers.append(None)
        keys, values, queries = parts
        if self.own:
            keys, values = keys.clone(), values.clone()
        self.layers[layer_idx] = PrefixLayer(keys, values, queries.clone())  # (a view would hold every query)

    def prefix(self, ids: Sequence[int], num_layers: int, states: tuple = ()) -> Prefix:
        layers = self.layers + [None] * (num_layers - len(self.layers))
        return Prefix(tuple(ids[: self.length]), tuple(layers), states)
