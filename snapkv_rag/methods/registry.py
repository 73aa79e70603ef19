"""The methods by name: what ``method=`` strings (CLI, server, evals) and saved files resolve.

A new method is one module in this package and one line in :data:`METHODS`' tuple below (or
:func:`register` at run time, for a method defined outside the package)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .ada import AdaSnapKVConfig
from .base import Method
from .docsnapkv import DocSnapKVConfig
from .h2o import H2OConfig
from .keynorm import KeyNormConfig
from .kvzip import KVzipConfig
from .lookahead import LookaheadSnapKVConfig
from .pyramid import PyramidKVConfig
from .random import RandomConfig
from .snapkv import SnapKVConfig
from .streaming import StreamingLLMConfig

METHODS: dict[str, type[Method]] = {
    cls.method: cls
    for cls in (
        SnapKVConfig,
        PyramidKVConfig,
        DocSnapKVConfig,
        AdaSnapKVConfig,
        LookaheadSnapKVConfig,
        KeyNormConfig,
        KVzipConfig,
        StreamingLLMConfig,
        H2OConfig,
        RandomConfig,
    )
}
"""Every method by its name (``config.method``)."""


def register(cls: type[Method]) -> type[Method]:
    """Add a method class (a frozen dataclass subclassing :class:`Method`, with its own ``method``
    name) to :data:`METHODS`; usable as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Method) and cls.method):
        raise TypeError(f"register: expected a Method subclass with a `method` name, got {cls!r}")
    METHODS[cls.method] = cls
    return cls


def method_class(name: str) -> type[Method]:
    """The method class called ``name``; a ``ValueError`` listing the names otherwise."""
    if name not in METHODS:
        raise ValueError(f"method: must be one of {', '.join(METHODS)}, got {name!r}")
    return METHODS[name]


def names_with(*settings: str) -> list[str]:
    """The names of the methods that have every one of ``settings`` (dataclass fields), in
    :data:`METHODS` order: e.g. those the command line's window and pooling flags apply to."""
    return [name for name, cls in METHODS.items() if set(settings) <= {f.name for f in fields(cls)}]


def is_method(value: Any) -> bool:
    """Whether ``value`` is a method config (an instance of a :class:`Method` subclass)."""
    return isinstance(value, Method)


def by_class_name(name: str) -> type[Method] | None:
    """The registered method class named ``name`` (its Python class name: saved files record it)."""
    return next((cls for cls in METHODS.values() if cls.__name__ == name), None)
