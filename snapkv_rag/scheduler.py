"""Continuous batching: one worker thread owns the model; callers from any thread or event loop
submit requests and receive their text as it is decoded.

The worker's loop, top to bottom::

    job = next waiting request, if a batch slot (and KV memory) is free   # arrival order
    start(job):  prefill it alone, at its own length -> select (compress) -> first token
                 -> its cache joins the running batch (batching.merge)
    step():      one decode step for every running row, each row sampled with its own settings;
                 finished and cancelled rows leave at once (batching.keep_rows)

At most one prefill runs between two decode steps, so a running request waits at most one prefill
(the longest prompt admitted) for its next token. Prompts are never padded to each other: each is
prefilled alone, and after SnapKV every row holds about the budget, so rows decode together with
little padding. A row's tokens are those it gets alone: same cache contents, same positions, its
own sampling generator; only the batched arithmetic may round differently.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import torch

from . import batching
from .generation import Batch, Runner, SamplingOptions, decode_step, prefill, sample
from .results import CompressionStats, compression_stats
from .text import Request, RowText, TextState

_PIECE, _DONE, _ERROR = "piece", "done", "error"


@dataclass
class Outcome:
    """What the worker hands back for a finished request."""

    row: RowText
    compression: CompressionStats
    prefill_s: float
    queued_s: float
    batch_size: int


@dataclass
class SchedulerStats:
    """A snapshot: requests waiting, requests decoding, the batch limit, and totals so far."""

    queued: int
    running: int
    max_batch: int
    finished: int
    generated_tokens: int
    prompt_tokens: int
    kept_prompt_tokens: int


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


@dataclass
class Job:
    """One request inside the scheduler, and the worker's state for it."""

    request: Request
    sampling: SamplingOptions
    stop: list[str]
    config: Any
    ticket: Ticket
    submitted: float = field(default_factory=time.perf_counter)
    text: TextState | None = None
    generator: torch.Generator | None = None
    constraint: Any = None
    position: int = 0
    last: int = 0
    step_ms: list[float] = field(default_factory=list)
    batch_size: int = 1
    outcome: dict = field(default_factory=dict)


class Scheduler:
    """Runs submitted requests on ``runner`` in one continuously refilled decode batch of at most
    ``max_batch`` rows (and, if given, about ``max_kv_bytes`` of cache); the rest wait in arrival
    order. The worker thread starts with the first request; :meth:`close` stops it."""

    def __init__(self, runner: Runner, tokenizer, max_batch: int = 16, max_kv_bytes: int | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: must be a positive integer, got {max_batch!r}")
        if max_kv_bytes is not None and (isinstance(max_kv_bytes, bool) or not isinstance(max_kv_bytes, int)
                                         or max_kv_bytes <= 0):
            raise ValueError(f"max_kv_bytes: must be a positive number of bytes or None, got {max_kv_bytes!r}")
        self.runner, self.tokenizer = runner, tokenizer
        self.max_batch, self.max_kv_bytes = max_batch, max_kv_bytes
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._worker: threading.Thread | None = None
        self._closing = False
        self.running: list[Job] = []
        self.cache = None
        self._bytes_per_slot: float | None = None
        self._merge = True
        self._compiled = False
        self._totals = {"finished": 0, "generated_tokens": 0, "prompt_tokens": 0, "kept_prompt_tokens": 0}

    # ------------------------------------------------------------ callers' side
    def submit(self, request: Request, sampling: SamplingOptions, stop: list[str], config,
               loop: asyncio.AbstractEventLoop | None = None) -> Ticket:
        """Queue a request; its pieces and outcome come through the returned :class:`Ticket`
        (delivered on ``loop`` for async callers)."""
        ticket = Ticket(loop)
        job = Job(request, sampling, list(stop), config, ticket)
        with self._cond:
            if self._worker is None or not self._worker.is_alive():
                self._closing = False
                self._worker = threading.Thread(target=self._work, name="snapkv-scheduler", daemon=True)
                self._worker.start()
                _LIVE.add(self)
            self._waiting.append(job)
            self._cond.notify()
        return ticket

    def stats(self) -> SchedulerStats:
        with self._cond:
            return SchedulerStats(queued=len(self._waiting), running=len(self.running), max_batch=self.max_batch,
                                  **self._totals)

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the worker: requests still waiting or running end with an error (:class:`Closed`)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)

    # ------------------------------------------------------------ the worker
    def _work(self) -> None:
        while True:
            job = self._next_job()
            if job is _STOP:
                break
            if job is not None:
                self._start(job)
            if self.running:
                self._step()
        self._fail_all(Closed("the engine was closed while this request was running"))

    def _next_job(self) -> Job | None | object:
        with self._cond:
            while not self._closing and not self._waiting and not self.running:
                self._cond.wait()
            if self._closing:
                return _STOP
            while self._waiting and self._waiting[0].ticket.cancelled.is_set():
                self._waiting.popleft()
            limit = self.max_batch if self._merge else 1
            if self._waiting and len(self.running) < limit and self._fits(self._waiting[0]):
                return self._waiting.popleft()
        return None

    def _fits(self, job: Job) -> bool:
        if self.max_kv_bytes is None or not self.running or self._bytes_per_slot is None:
            return True
        def slots(j): return min(len(j.request.input_ids), getattr(j.config, "max_capacity_prompt", None) or 1 << 30
                                 ) + j.sampling.max_new_tokens
        needed = sum(slots(j) for j in [*self.running, job]) * self._bytes_per_slot
        return needed <= self.max_kv_bytes

    def _start(self, job: Job) -> None:
        """Prefill and select one request alone, sample its first token, and add its row."""
        ids = job.request.input_ids
        begin = time.perf_counter()
        try:
            pre = prefill(self.runner, Batch.of([ids], self.runner.pad_id, self.runner.device), {"": job.config},
                          room=job.sampling.max_new_tokens)
            cache = pre.caches[""]
            stats = compression_stats(cache, 0, len(ids), pre.selection_ms(""))
            job.outcome = {"compression": stats, "prefill_s": pre.prefill_s, "queued_s": begin - job.submitted}
            if batching.can_merge(cache):
                self._bytes_per_slot = stats.kv_bytes_kept / max(max(stats.kept_tokens), 1)
            else:
                self._merge = False
            job.text = TextState(self.tokenizer, job.stop)
            job.generator = job.sampling.generator()
            job.constraint = getattr(job.request, "constraint", None)
            job.position = len(ids)
            token = self._pick(pre.logits, [job])[0]
            if not self._advance(job, token):
                return
            room = max(j.sampling.max_new_tokens - len(j.text.ids) for j in [*self.running, job])
            merged = cache if self.cache is None else batching.merge([self.cache, cache], room)
        except Exception as error:  # noqa: BLE001 - handed to the caller, who raises it
            job.ticket.put(_ERROR, error)
            return
        self.cache = merged
        self.running.append(job)
        self._static()
        for j in self.running:
            j.batch_size = max(j.batch_size, len(self.running))

    def _step(self) -> None:
        """One decode step for the running batch; rows that finish (or were cancelled) leave."""
        running = self.running
        keep = [i for i, job in enumerate(running) if not job.ticket.cancelled.is_set()]
        if len(keep) < len(running):
            self._keep(keep)
            running = self.running
            if not running:
                return
        device = self.runner.device
        tokens = torch.tensor([job.last for job in running], device=device)
        positions = torch.tensor([job.position for job in running], device=device)
        begin = time.perf_counter()
        try:
            logits = decode_step(self.runner, self.cache, tokens, positions, self._compiled)
        except Exception as error:  # noqa: BLE001 - every row of the failed step gets the error
            for job in running:
                job.ticket.put(_ERROR, error)
            self.running, self.cache = [], None
            return
        ms = 1000 * (time.perf_counter() - begin)
        for job in running:
            job.step_ms.append(ms)
            job.position += 1
        picked = self._pick(logits, running)
        alive = [i for i, (job, token) in enumerate(zip(running, picked)) if self._advance(job, token)]
        if len(alive) < len(running):
            self._keep(alive)

    def _pick(self, logits: torch.Tensor, jobs: list[Job]) -> list[int]:
        """Each row's next token under its own settings (and grammar, if it has one)."""
        constraints = [job.constraint for job in jobs]
        if any(c is not None for c in constraints):
            from .structured import apply_masks  # only requests with a response format need it

            apply_masks(logits, constraints)
        picked = logits.argmax(dim=-1).tolist()  # greedy rows: one device-to-host copy for all
        for row, job in enumerate(jobs):
            if job.sampling.temperature > 0:
                picked[row] = int(sample(logits[row:row + 1], job.sampling, job.generator)[0])
        return picked

    def _advance(self, job: Job, token: int) -> bool:
        """Hand ``token`` to ``job``'s caller; whether the job goes on decoding."""
        if job.ticket.cancelled.is_set():
            return False
        if job.constraint is not None:
            job.constraint.accept(token)
        if token in self.runner.eos_ids and not job.sampling.ignore_eos:
            return self._finish(job, "stop")
        piece = job.text.push(token)
        if piece:
            job.ticket.put(_PIECE, piece)
        if job.text.finished:
            return self._finish(job, "stop")
        if len(job.text.ids) >= job.sampling.max_new_tokens:
            return self._finish(job, "length")
        job.last = token
        return True

    def _finish(self, job: Job, reason: str) -> bool:
        job.text.finished = job.text.finished or reason
        piece = job.text.flush()
        if piece:
            job.ticket.put(_PIECE, piece)
        steps = tuple(job.step_ms)
        row = RowText(text=job.text.text, finish_reason=job.text.finished, token_ids=job.text.ids,
                      decode_ms_per_token=sum(steps) / len(steps) if steps else 0.0, decode_step_ms=steps)
        with self._cond:
            self._totals["finished"] += 1
            self._totals["generated_tokens"] += len(job.text.ids)
            self._totals["prompt_tokens"] += job.outcome["compression"].prompt_tokens
            self._totals["kept_prompt_tokens"] += max(job.outcome["compression"].kept_tokens, default=0)
        job.ticket.put(_DONE, Outcome(row=row, batch_size=job.batch_size, **job.outcome))
        return False

    def _keep(self, rows: list[int]) -> None:
        self.running = [self.running[i] for i in rows]
        room = max((j.sampling.max_new_tokens - len(j.text.ids) for j in self.running), default=0)
        self.cache = batching.keep_rows(self.cache, rows, room)
        self._static()

    def _static(self) -> None:
        self._compiled = bool(self.runner.compile) and self.cache is not None and self.cache.make_static() is not None

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            jobs, self._waiting = [*self.running, *self._waiting], collections.deque()
        for job in jobs:
            job.ticket.put(_ERROR, error)
        self.running, self.cache = [], None


class Closed(RuntimeError):
    """The engine was closed while the request waited or ran."""


_STOP = object()
_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop the workers before the interpreter tears torch down under them."""
    for scheduler in list(_LIVE):
        scheduler.close(timeout=5.0)
