"""What every test folder shares: a check that an event loop keeps running while a model computes, and
the engine default the tiny-model suites run under (:func:`plain_snapkv_default`)."""

from __future__ import annotations

import asyncio
import threading

import pytest


class LoopWatch:
    """Whether the event loop ran while the model was in the middle of a forward pass, decided by
    events rather than by counting ticks against the clock: the model's first forward (on whichever
    thread runs it) waits until the loop has ticked after that forward began. A loop blocked by the
    call cannot tick then, so the wait gives up after ``patience`` s; an unblocked loop ticks within
    a millisecond or so, on a fast machine or a slow one."""

    def __init__(self, model, patience: float = 30.0):
        self.model, self.patience = model, patience
        self.began, self.ticked = threading.Event(), threading.Event()
        self.waits: list[bool] = []

    def _hook(self, *_):
        if not self.waits:
            self.began.set()
            self.waits.append(self.ticked.wait(self.patience))

    async def _tick(self):
        while True:
            if self.began.is_set():
                self.ticked.set()
            await asyncio.sleep(0.001)

    async def __aenter__(self) -> LoopWatch:
        self._handle = self.model.register_forward_pre_hook(self._hook)
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        self._handle.remove()

    @property
    def loop_ran_during_forward(self) -> bool:
        return self.waits == [True]


@pytest.fixture
def loop_watch():
    """``async with loop_watch(model) as watch: ...``, then ``assert watch.loop_ran_during_forward``."""
    return LoopWatch


def pytest_collection_modifyitems(config, items):
    """Modules holding a test marked ``heavy`` (a minute or more) run first, each kept whole and in
    order: under ``-n auto`` the long tests then overlap the many short ones rather than running
    alone at the end. The order changes nothing else: every test is independent of it."""
    heavy = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("heavy")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in heavy)


@pytest.fixture(scope="session")
def plain_snapkv_default():
    """Engines built without ``snapkv`` compress with plain SnapKV at 1,024 tokens (``SnapKVConfig()``,
    the engine's default before lookahead SnapKV at 50% took its place, ``snapkv_rag.methods.default``)
    while the session runs: the tiny-model suites' tests are about other things, and so keep the
    caches their prompts had and their speed (a draft per request otherwise). Their conftest files use
    it for every test; a test about the default itself takes :func:`engine_default`. Yields the real
    default."""
    from snapkv_rag import SnapKVConfig, SnapKVLLM

    defaults = SnapKVLLM.__init__.__kwdefaults__
    real = defaults["snapkv"]
    defaults["snapkv"] = SnapKVConfig()
    yield real
    defaults["snapkv"] = real


@pytest.fixture
def engine_default(plain_snapkv_default):
    """The engine's real default compression for engines built during this test (yielded)."""
    from snapkv_rag import SnapKVLLM

    defaults = SnapKVLLM.__init__.__kwdefaults__
    plain, defaults["snapkv"] = defaults["snapkv"], plain_snapkv_default
    yield plain_snapkv_default
    defaults["snapkv"] = plain
