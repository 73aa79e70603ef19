"""The spec every framework adapter shares, written once: the fields that load a model
(:data:`LOADING_DEFAULTS`, :func:`engine_from`), the per-call options (:data:`CALL_OPTIONS`,
:func:`call_options`), what a result reports back (:func:`result_metadata`), and blocking iterators
turned into async ones without blocking the event loop (:func:`iterate_in_thread`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from .engine import SnapKVLLM
from .results import GenerationResult
from .threads import iterate_in_thread

__all__ = ["LOADING_DEFAULTS", "CALL_OPTIONS", "engine_from", "call_options", "result_metadata", "iterate_in_thread"]

CALL_OPTIONS = ("max_new_tokens", "temperature", "top_p", "seed", "snapkv", "stop")
"""The engine options an adapter takes per call (or as a field: the call's value wins)."""

LOADING_DEFAULTS: dict[str, Any] = {"model": None, "tokenizer": None, "device": None, "dtype": None,
                                    "attn_implementation": None, "instruction": None, "trust_remote_code": False}
"""The engine parameters that configure loading a model, with their defaults."""


def engine_from(engine: Any, snapkv: Any = None, **loading: Any) -> SnapKVLLM:
    """``engine`` itself when given (then no loading parameter may differ from its default: the
    model is already loaded), else a new engine built from ``loading`` and ``snapkv``."""
    unknown = set(loading) - set(LOADING_DEFAULTS)
    if unknown:
        raise TypeError(f"unexpected loading parameter(s): {', '.join(sorted(unknown))}")
    if engine is not None:
        if not isinstance(engine, SnapKVLLM):
            raise TypeError(f"engine: expected a snapkv_rag.SnapKVLLM, got {type(engine).__name__}")
        clashing = [name for name, value in loading.items() if value != LOADING_DEFAULTS[name]]
        if clashing:
            raise ValueError(f"{', '.join(clashing)}: these configure loading a model; with engine= the model is "
                             "already loaded, so set them on snapkv_rag.SnapKVLLM(...) instead")
        return engine
    options = {name: value for name, value in loading.items() if not (name == "instruction" and value is None)}
    if snapkv is not None:
        options["snapkv"] = snapkv
    return SnapKVLLM(**options)


def call_options(fields: Mapping[str, Any], kwargs: Mapping[str, Any], accepted: Sequence[str] = ()) -> dict[str, Any]:
    """Engine options for one call: each of :data:`CALL_OPTIONS` from ``kwargs`` if given there, else
    from the adapter's ``fields``; ``None`` means "the engine's default". Other ``kwargs`` besides
    the adapter's own ``accepted`` ones are a TypeError naming them and what is supported."""
    unknown = sorted(set(kwargs) - set(CALL_OPTIONS) - set(accepted))
    if unknown:
        raise TypeError(f"unexpected option(s) {', '.join(unknown)}; supported: "
                        f"{', '.join((*accepted, *CALL_OPTIONS))}")
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
        "usage": {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens,
                  "total_tokens": result.usage.total_tokens},
        "compression": asdict(result.compression),
        "timings": asdict(result.timings),
    }
