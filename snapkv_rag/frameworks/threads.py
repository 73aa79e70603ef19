"""Blocking iterators consumed from asyncio without blocking the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import closing
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Create, advance and close a blocking iterator in one worker thread, yielding its items on
    the event loop. A consumer that stops early closes it before this returns."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stopped = threading.Event()

    def produce() -> None:
        outcome: Any = _DONE
        try:
            with closing(make_iterator()) as iterator:
                for item in iterator:
                    loop.call_soon_threadsafe(queue.put_nowait, (item, None))
                    if stopped.is_set():
                        break
        except BaseException as error:  # re-raised on the event loop
            outcome = error
        loop.call_soon_threadsafe(queue.put_nowait, (_DONE, outcome))

    worker = loop.run_in_executor(None, produce)
    try:
        while True:
            item, outcome = await queue.get()
            if item is not _DONE:
                yield item
            elif outcome is _DONE:
                break
            else:
                raise outcome
    finally:
        stopped.set()
        await worker
