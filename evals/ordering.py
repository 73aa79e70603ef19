"""The order rows are shown in, shared by the tables (``report``) and the plots (``plots``)."""

from __future__ import annotations

from collections.abc import Iterable

_POSITION_ORDER = {"first": 0, "middle": 1, "last": 2, "shuffled": 3}


def method_order(rows: Iterable[dict]) -> list[str]:
    """The methods in the order they first appear (the run's order)."""
    seen: list[str] = []
    for r in rows:
        if r["method"] not in seen:
            seen.append(r["method"])
    return seen


def position_key(position: str) -> tuple:
    """first, middle, last, shuffled, then any other position by name."""
    return (_POSITION_ORDER.get(position, 4), position)
