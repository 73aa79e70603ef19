"""A least-recently-used map bounded by the bytes its entries hold: what the document prefix cache
(:mod:`snapkv_rag.kv.prefix_cache`) and the compressed document store (:mod:`snapkv_rag.documents.store`)
keep their entries in. Not locked: each owner holds its own lock around it."""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Any


class ByteLRU:
    """``entries`` (least recently used first), their total ``size`` in ``bytes`` at most
    ``max_bytes``; ``stored`` and ``evicted`` count puts and evictions."""

    def __init__(self, max_bytes: int, size: Callable[[Any], int]):
        self.max_bytes, self.size = max_bytes, size
        self.entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self.bytes = self.stored = self.evicted = 0

    def get(self, key: Hashable) -> Any:
        """The entry of ``key`` (then the most recently used), or ``None``."""
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> bool:
        """Keep ``value`` under ``key`` (replacing what was there), evicting the least recently used
        entries until it fits; one larger than ``max_bytes`` is not kept (``False``)."""
        size = self.size(value)
        if size > self.max_bytes:
            return False
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= self.size(old)
        while self.entries and self.bytes + size > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= self.size(evicted)
            self.evicted += 1
        self.entries[key] = value
        self.bytes += size
        self.stored += 1
        return True

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
