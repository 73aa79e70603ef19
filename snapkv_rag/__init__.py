"""snapkv-rag: retrieval-augmented answers from local LLMs with a SnapKV-compressed KV cache.

The names below load on first use, so that ``import snapkv_rag`` (and ``snapkv-rag --help``) does not
import torch and transformers until the engine is asked for.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING

try:
    __version__ = metadata.version("snapkv-rag")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_WHERE = {
    "SnapKVLLM": "engine",
    "ContextLengthError": "engine",
    "GenerationOutOfMemoryError": "engine",
    "SnapKVConfig": "methods",
    "PyramidKVConfig": "methods",
    "StreamingLLMConfig": "methods",
    "H2OConfig": "methods",
    "RandomConfig": "methods",
    "DocSnapKVConfig": "methods",
    "AdaSnapKVConfig": "methods",
    "LookaheadSnapKVConfig": "methods",
    "KeyNormConfig": "methods",
    "KVzipConfig": "methods",
    "PromptSpans": "config",
    "Document": "request.prompts",
    "parse_citations": "request.prompts",
    "GenerationResult": "request.results",
    "CompressionStats": "request.results",
    "Timings": "request.results",
    "Usage": "request.results",
    "ModelLoadError": "models.loading",
    "SchemaError": "request.structured",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'snapkv_rag' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .config import PromptSpans
    from .engine import ContextLengthError, GenerationOutOfMemoryError, SnapKVLLM
    from .methods import (
        AdaSnapKVConfig,
        DocSnapKVConfig,
        H2OConfig,
        KeyNormConfig,
        KVzipConfig,
        LookaheadSnapKVConfig,
        PyramidKVConfig,
        RandomConfig,
        SnapKVConfig,
        StreamingLLMConfig,
    )
    from .models.loading import ModelLoadError
    from .request.prompts import Document, parse_citations
    from .request.results import CompressionStats, GenerationResult, Timings, Usage
    from .request.structured import SchemaError
