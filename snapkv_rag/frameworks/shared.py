"""The spec every framework adapter shares, written once: the fields that load a model
(:data:`LOADING_DEFAULTS`, :func:`engine_from`, one loaded engine per spec shared by every adapter
instance that names it), the per-call options (:data:`CALL_OPTIONS`, :func:`call_options`), what a
result reports back (:func:`result_metadata`), and blocking iterators turned into async ones without
blocking the event loop (:func:`iterate_in_thread`)."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..engine import SnapKVLLM
from ..request.results import GenerationResult
from .threads import iterate_in_thread

__all__ = [
    "LOADING_DEFAULTS",
    "CALL_OPTIONS",
    "IDLE_CLOSE_S",
    "Lease",
    "engine_from",
    "call_options",
    "result_metadata",
    "iterate_in_thread",
]

CALL_OPTIONS = ("max_new_tokens", "temperature", "top_p", "seed", "snapkv", "stop")
"""The engine options an adapter takes per call (or as a field: the call's value wins)."""

LOADING_DEFAULTS: dict[str, Any] = {
    "model": None,
    "tokenizer": None,
    "device": None,
    "dtype": None,
    "attn_implementation": None,
    "instruction": None,
    "trust_remote_code": False,
    "quantize": None,
    "kv_dtype": None,
}
"""The engine parameters that configure loading a model, with their defaults."""


IDLE_CLOSE_S = 30.0
"""How long a shared engine whose last adapter was garbage-collected stays loaded, so that adapters
made and dropped one after another (a chain built per request, a loop) load the model once."""


class Lease:
    """One adapter's hold on a shared engine. :meth:`release` (idempotent) closes the engine when it
    was the last hold: at once when ``now`` (the adapter's ``close()``), else after
    :data:`IDLE_CLOSE_S` unless another adapter of the same spec takes the engine first."""

    def __init__(self, pool: _EnginePool, key: Hashable):
        self.pool, self.key, self.released = pool, key, False

    def release(self, now: bool = False) -> None:
        if not self.released:
            self.released = True
            self.pool.release(self.key, now)


class _EnginePool:
    """Loaded engines by loading spec, each with how many adapters hold it (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.entries: dict[Hashable, list] = {}  # key -> [engine, holders, idle timer or None]

    def acquire(self, loading: Mapping[str, Any]) -> tuple[SnapKVLLM, Lease]:
        key = tuple((name, _identity(loading[name])) for name in sorted(loading))
        with self.lock:  # held while loading: a second adapter of the same spec waits and shares it
            entry = self.entries.get(key)
            if entry is None:
                options = {
                    name: value for name, value in loading.items() if not (name == "instruction" and value is None)
                }
                entry = self.entries[key] = [SnapKVLLM(**options), 0, None]
            if entry[2] is not None:
                entry[2].cancel()
                entry[2] = None
            entry[1] += 1
            return entry[0], Lease(self, key)

    def release(self, key: Hashable, now: bool) -> None:
        with self.lock:
            entry = self.entries[key]
            entry[1] -= 1
            if entry[1] > 0:
                return
            if not now:
                entry[2] = threading.Timer(IDLE_CLOSE_S, self._close_if_idle, (key, entry))
                entry[2].daemon = True
                entry[2].start()
                return
            del self.entries[key]
        entry[0].close()

    def _close_if_idle(self, key: Hashable, entry: list) -> None:
        with self.lock:
            if self.entries.get(key) is not entry or entry[1] > 0:
                return
            del self.entries[key]
        entry[0].close()


def _identity(value: Any) -> Hashable:
    """A spec value as part of the pool's key: names and numbers by value, a loaded model or
    tokenizer by identity (its engine holds it, so the id is not reused while the entry lives)."""
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool, torch.dtype)):
        return value
    return ("object", id(value))


_POOL = _EnginePool()


def engine_from(engine: Any, **loading: Any) -> tuple[SnapKVLLM, Lease | None]:
    """``engine`` itself when given (then no loading parameter may differ from its default: the
    model is already loaded; the caller owns it, so no lease), else the engine loaded for
    ``loading``, shared with every other adapter that gave the same values, and this adapter's lease
    on it. Compression and sampling are per call, so they are no part of the spec."""
    unknown = set(loading) - set(LOADING_DEFAULTS)
    if unknown:
        raise TypeError(f"unexpected loading parameter(s): {', '.join(sorted(unknown))}")
    if engine is not None:
        if not isinstance(engine, SnapKVLLM):
            raise TypeError(f"engine: expected a snapkv_rag.SnapKVLLM, got {type(engine).__name__}")
        clashing = [name for name, value in loading.items() if value != LOADING_DEFAULTS[name]]
        if clashing:
            raise ValueError(
                f"{', '.join(clashing)}: these configure loading a model; with engine= the model is "
                "already loaded, so set them on snapkv_rag.SnapKVLLM(...) instead"
            )
        return engine, None
    return _POOL.acquire({**LOADING_DEFAULTS, **loading})


def call_options(fields: Mapping[str, Any], kwargs: Mapping[str, Any], accepted: Sequence[str] = ()) -> dict[str, Any]:
    """Engine options for one call: each of :data:`CALL_OPTIONS` from ``kwargs`` if given there, else
    from the adapter's ``fields``; ``None`` means "the engine's default". Other ``kwargs`` besides
    the adapter's own ``accepted`` ones are a TypeError naming them and what is supported."""
    unknown = sorted(set(kwargs) - set(CALL_OPTIONS) - set(accepted))
    if unknown:
        raise TypeError(
            f"unexpected option(s) {', '.join(unknown)}; supported: {', '.join((*accepted, *CALL_OPTIONS))}"
        )
    options = {name: kwargs[name] if name in kwargs else fields.get(name) for name in CALL_OPTIONS}
    return {name: value for name, value in options.items() if value is not None}


def result_metadata(result: GenerationResult, model_name: str) -> dict[str, Any]:
    """What an adapter reports with a response: citations (1-based, in the order the documents were
    given), the cited documents, usage, and the compression and timing figures."""
    numbered = [(number, result.documents[number - 1]) for number in result.citations]
    return {
        "model_name": model_name,
        "finish_reason": result.finish_reason,
        "citations": list(result.citations),
        "cited_documents": [{"number": n, **asdict(doc), "metadata": dict(doc.metadata)} for n, doc in numbered],
        "usage": {
            "prompt_tokens": result.usage.prompt_tokens,
            "completion_tokens": result.usage.completion_tokens,
            "total_tokens": result.usage.total_tokens,
        },
        "compression": asdict(result.compression),
        "timings": asdict(result.timings),
    }
