"""What every framework adapter needs from the engine: one shared engine built from the adapter's
fields (or given), and blocking iterators turned into async ones without blocking the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import closing
from typing import Any, TypeVar

from .engine import SnapKVLLM

T = TypeVar("T")

LOADING_DEFAULTS: dict[str, Any] = {"model": None, "tokenizer": None, "device": None, "dtype": None,
                                    "attn_implementation": "sdpa", "instruction": None, "trust_remote_code": False}
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
