"""Compression methods, one module each: a method is one frozen settings object that validates
itself, resolves its budget, selects each layer's K/V and answers the few questions the engine asks
of it (:class:`~snapkv_rag.methods.base.Method`). :mod:`~snapkv_rag.methods.registry` knows them by
name; :mod:`~snapkv_rag.methods.selection` holds the pure tensor functions they build on, with
:mod:`~snapkv_rag.methods.adaptive` (ragged heads) and :mod:`~snapkv_rag.methods.shared_budget`
(one budget across layers)."""

from .ada import AdaSnapKVConfig
from .base import Method
from .default import DEFAULT_COMPRESSION
from .docsnapkv import DocSnapKVConfig
from .h2o import H2OConfig
from .keynorm import KeyNormConfig
from .kvzip import KVzipConfig
from .lookahead import LookaheadSnapKVConfig
from .pyramid import PyramidKVConfig
from .random import RandomConfig
from .registry import METHODS, is_method, method_class, register
from .snapkv import SnapKVConfig
from .streaming import StreamingLLMConfig

__all__ = [
    "Method",
    "DEFAULT_COMPRESSION",
    "METHODS",
    "register",
    "method_class",
    "is_method",
    "SnapKVConfig",
    "PyramidKVConfig",
    "DocSnapKVConfig",
    "AdaSnapKVConfig",
    "LookaheadSnapKVConfig",
    "KeyNormConfig",
    "KVzipConfig",
    "StreamingLLMConfig",
    "H2OConfig",
    "RandomConfig",
]
