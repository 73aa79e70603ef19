"""What every framework adapter needs from the engine: one shared engine built from the adapter's
fields (or given), and blocking iterators turned into async ones without blocking the event loop."""

from __future__ import annotations

from typing import Any

from .engine import SnapKVLLM
from .threads import iterate_in_thread

__all__ = ["LOADING_DEFAULTS", "engine_from", "iterate_in_thread"]

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
