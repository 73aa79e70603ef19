"""A caller's side of one submitted request (:class:`Ticket`): the worker thread puts the request's
text pieces, then its outcome (or an error) on it; the caller iterates it, from a thread or an
event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the worker puts last (the scheduler builds it)
    from .scheduler import Outcome

_PIECE, _DONE, _ERROR = "piece", "done", "error"


class Ticket:
    """The caller's side of one submitted request: its text pieces, then its :class:`Outcome`.
    ``cancel()`` (or closing the iterator) ends it; its batch slot is freed within one step."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.cancelled = threading.Event()
        self._loop = loop
        self._queue: Any = asyncio.Queue() if loop is not None else queue.Queue()

    def put(self, kind: str, value: Any) -> None:  # worker side
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))
            except RuntimeError:  # the caller's event loop is gone: nobody is listening
                self.cancelled.set()
        else:
            self._queue.put((kind, value))

    def cancel(self) -> None:
        self.cancelled.set()

    @staticmethod
    def _unpack(event: tuple[str, Any]) -> tuple[Any, bool]:
        kind, value = event
        if kind == _ERROR:
            raise value
        return value, kind == _DONE

    def __iter__(self) -> Iterator[str | Outcome]:
        done = False
        try:
            while not done:
                value, done = self._unpack(self._queue.get())
                yield value
        finally:
            self.cancel()  # a no-op once done; frees the slot when the caller stopped early

    async def __aiter__(self) -> AsyncIterator[str | Outcome]:
        done = False
        try:
            while not done:
                value, done = self._unpack(await self._queue.get())
                yield value
        finally:
            self.cancel()
