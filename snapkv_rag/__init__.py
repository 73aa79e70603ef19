"""snapkv-rag: retrieval-augmented answers from local LLMs with a SnapKV-compressed KV cache.

The names below load on first use, so that ``import snapkv_rag`` (and ``snapkv-rag --help``) does not
import torch and transformers until the engine is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_WHERE = {
    "SnapKVLLM": "engine", "ContextLengthError": "engine", "GenerationOutOfMemoryError": "engine",
    "SnapKVConfig": "config", "PyramidKVConfig": "config", "StreamingLLMConfig": "config",
    "H2OConfig": "config", "RandomConfig": "config", "DocSnapKVConfig": "config", "AdaSnapKVConfig": "config",
    "LookaheadSnapKVConfig": "config",
    "KeyNormConfig": "config", "KVzipConfig": "config",
    "PromptSpans": "config",
    "Document": "prompts", "parse_citations": "prompts",
    "GenerationResult": "results", "CompressionStats": "results", "Timings": "results", "Usage": "results",
    "ModelLoadError": "loading", "SchemaError": "structured",
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
    from .config import (AdaSnapKVConfig, DocSnapKVConfig, H2OConfig, KeyNormConfig, KVzipConfig, LookaheadSnapKVConfig, PromptSpans, PyramidKVConfig, RandomConfig, SnapKVConfig,
                         StreamingLLMConfig)
    from .engine import ContextLengthError, GenerationOutOfMemoryError, SnapKVLLM
    from .loading import ModelLoadError
    from .prompts import Document, parse_citations
    from .results import CompressionStats, GenerationResult, Timings, Usage
    from .structured import SchemaError
