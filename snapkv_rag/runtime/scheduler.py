"""Continuous batching: one worker thread owns the model; callers from any thread or event loop
submit requests and receive their text as it is decoded. The scheduler decides, the runner
(:mod:`snapkv_rag.runtime.runner`) executes. The worker's loop, top to bottom::

    job = next waiting request, if a row is free (and KV memory fits)        # arrival order
    start(job):  prefill it alone, at its own length -> select (compress) -> first token
                 -> its compressed cache is written into the lowest free row of the slot cache
    step():      one decode step for rows [0, bucket), tokens picked on the device, ONE copy of
                 them to the host; finished and cancelled rows are freed (metadata only)

At most one prefill runs between two decode steps, so a running request waits at most one prefill
for its next token. Prompts are never padded to each other: each is prefilled alone. A request
already prefilled (``compare``: one prefill, several methods) joins the same way, so every
decode -- the engine's, ``compare``'s, the evals' -- runs this one loop. A row's tokens are those
it gets alone: same cache contents, same positions, its own sampling seed and step.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..kv import prefix_cache
from ..kv.prompt_cache import Compressed
from ..kv.row_states import state_bytes
from ..kv.slot_cache import SlotCache, request_states
from ..request import structured
from ..request.results import CompressionStats, SchedulerStats, compression_stats  # noqa: F401 (SchedulerStats: re-exported)
from ..request.text import Request, RowText, TextState
from . import choices
from .runner import Prefilled, Runner, StepClock
from .sampling import SamplingOptions, SamplingSlots, sample
from .tickets import _DONE, _ERROR, _PIECE, Ticket  # noqa: F401 (Ticket: re-exported)


@dataclass
class Outcome:
    """What the worker hands back for a finished request."""

    row: RowText
    compression: CompressionStats
    prefill_s: float
    queued_s: float
    batch_size: int
    kept_positions: dict | None = None  # per layer, the prompt positions kept (requests of a group)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    constraint: Any = None  # the row's grammar state at its end (each choice has its own)
    choices: list = field(default_factory=list)  # n > 1: every choice's Outcome (this one is choice 0)


@dataclass
class Group:
    """Requests that share one prefill: one per compression method of ``methods`` (``compare``),
    or ``n`` choices of one request (one method, one selection, ``n`` rows)."""

    ids: list[int]
    methods: dict[str, Any]
    together: bool = False  # decode as rows of one batch; else one after another (own timings)
    prefilled: Prefilled | None = None
    n: int = 1
    finished: dict[int, Outcome] = field(default_factory=dict)

    def gather(self, outcome: Outcome, index: int) -> Outcome | None:
        """Choice ``index`` is done: once all ``n`` are, choice 0's outcome holding all of them."""
        self.finished[index] = outcome
        done = len(self.finished) == self.n
        return replace(self.finished[0], choices=[self.finished[i] for i in range(self.n)]) if done else None


@dataclass
class Job:
    """One request inside the scheduler, and the worker's state for it."""

    request: Request
    sampling: SamplingOptions
    stop: list[str]
    config: Any
    ticket: Ticket
    group: Group | None = None
    name: str = ""  # its method's name in ``group``
    choice: int = 0  # its index among the ``n`` choices of its request
    recorder: Any = None  # compare's hit-rate recorder (its row decodes eagerly)
    submitted: float = field(default_factory=time.perf_counter)
    text: TextState | None = None
    constraint: Any = None
    log: choices.ChoiceLog | None = None
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
        if max_kv_bytes is not None and (
            isinstance(max_kv_bytes, bool) or not isinstance(max_kv_bytes, int) or max_kv_bytes <= 0
        ):
            raise ValueError(f"max_kv_bytes: must be a positive number of bytes or None, got {max_kv_bytes!r}")
        self.runner, self.tokenizer = runner, tokenizer
        self.max_batch, self.max_kv_bytes = max_batch, max_kv_bytes
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._worker: threading.Thread | None = None
        self._closing = False
        self.running: dict[int, Job] = {}  # row of the slot cache -> its request
        self.slots: SlotCache | None = None
        self.sampling: SamplingSlots | None = None
        self._first = SamplingSlots(1, runner.device)  # picks a joining request's first token
        self._bytes_per_slot: float | None = None
        self._state_bytes = 0  # a request's conv / SSM states (models with recurrent layers)
        self._totals = {
            "finished": 0,
            "generated_tokens": 0,
            "prompt_tokens": 0,
            "kept_prompt_tokens": 0,
            "prefills": 0,
        }
        self._texts = choices.TokenTexts(tokenizer)
        self._logprobs = None  # the last pick's logprobs on the device (rows that asked for them)

    # ------------------------------------------------------------ callers' side
    def submit(
        self,
        request: Request,
        sampling: SamplingOptions,
        stop: list[str],
        config,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Ticket:
        """Queue a request; its pieces and outcome come through the returned :class:`Ticket`
        (delivered on ``loop`` for async callers). ``sampling.n > 1``: ``n`` rows share one prefill
        (:mod:`snapkv_rag.runtime.choices`) and one ticket, whose outcome holds all ``n``."""
        ticket, sampling = Ticket(loop), _seeded(sampling)
        group = Group(request.input_ids, {"": config}, together=True, n=sampling.n) if sampling.n > 1 else None
        self._queue(
            [
                Job(
                    choices.choice_request(request, i),
                    choices.choice_sampling(sampling, i),
                    list(stop),
                    config,
                    ticket,
                    group=group,
                    choice=i,
                )
                for i in range(sampling.n)
            ]
        )
        return ticket

    def submit_group(
        self,
        requests: dict[str, Request],
        methods: dict[str, Any],
        sampling: SamplingOptions,
        stop: list[str],
        recorders: dict[str, Any] | None = None,
        together: bool = False,
    ) -> dict[str, Ticket]:
        """Queue one request per method of ``methods`` (name -> config) over the same prompt: one
        prefill fills all their caches, then they join the batch like any request: ``together``,
        as rows of one step; else each after the previous one finished (so that each has its own
        decode timings). ``requests`` gives each its own :class:`Request` (its own grammar state);
        ``recorders`` a hit-rate recorder."""
        first = next(iter(requests.values()))
        group = Group(first.input_ids, dict(methods), together)
        sampling = _seeded(sampling)
        jobs = [
            Job(
                requests[name],
                sampling,
                list(stop),
                methods[name],
                Ticket(),
                group=group,
                name=name,
                recorder=(recorders or {}).get(name),
            )
            for name in methods
        ]
        self._queue(jobs)
        return {job.name: job.ticket for job in jobs}

    def _queue(self, jobs: list[Job]) -> None:
        with self._cond:
            if self._worker is None or not self._worker.is_alive():
                self._closing = False
                self._worker = threading.Thread(target=self._work, name="snapkv-scheduler", daemon=True)
                self._worker.start()
                _LIVE.add(self)
            self._waiting.extend(jobs)
            self._cond.notify()

    def stats(self) -> SchedulerStats:
        with self._cond:
            return SchedulerStats(
                queued=len(self._waiting), running=len(self.running), max_batch=self.max_batch, **self._totals
            )

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
            head = self._waiting[0] if self._waiting else None
            if (
                head is not None
                and head.group is not None
                and not head.group.together
                and any(job.group is head.group for job in self.running.values())
            ):
                return None  # the previous method of its group is still decoding
            if head is not None and len(self.running) < self.max_batch and self._fits(head):
                return self._waiting.popleft()
        return None

    def _fits(self, job: Job) -> bool:
        if self.max_kv_bytes is None or not self.running or self._bytes_per_slot is None:
            return True

        def slots(j):
            return (
                min(len(j.request.input_ids), getattr(j.config, "max_capacity_prompt", None) or 1 << 30)
                + j.sampling.max_new_tokens
            )

        needed = (
            sum(slots(j) for j in [*self.running.values(), job]) * self._bytes_per_slot
            + (len(self.running) + 1) * self._state_bytes
        )
        return needed <= self.max_kv_bytes

    def _prefill(self, job: Job) -> tuple[Compressed, torch.Tensor, float]:
        """The request's compressed cache, its prompt's next-token logits ``[1, V]`` and the prefill
        time; the jobs of one group (n choices, compared methods) share one prefill."""
        group, request = job.group, job.request
        pre = group.prefilled if group is not None else None
        if pre is None:
            if request.stored is not None:  # only the tail, over a stored document set
                pre = self.runner.prefill_stored(request.stored, request.input_ids)
            else:
                ids, methods = (request.input_ids, {"": job.config}) if group is None else (group.ids, group.methods)
                pre = self.runner.prefill([ids], methods, prefix_cache.boundary(ids, request.spans))
            self._totals["prefills"] += 1
            if group is not None:
                group.prefilled = pre
        job.outcome["cached_tokens"] = pre.cached_tokens
        return pre.compressed[job.name][0], pre.logits, pre.prefill_s

    def _start(self, job: Job) -> None:
        """Prefill and select one request alone (or take its group's prefill), sample its first
        token, and write its cache into the lowest free row."""
        begin = time.perf_counter()
        try:
            compressed, logits, prefill_s = self._prefill(job)
            stats = compression_stats(compressed, 1000 * compressed.selection_s)
            job.outcome.update(
                compression=stats,
                prefill_s=prefill_s,
                queued_s=begin - job.submitted,
                kept_positions=compressed.kept_positions() if job.group is not None else None,
            )
            self._bytes_per_slot = stats.kv_bytes_kept / max(max(stats.kept_tokens), 1)
            self._state_bytes = state_bytes(request_states(compressed, self.runner.specs))
            job.text = TextState(self.tokenizer, job.stop)
            job.constraint = getattr(job.request, "constraint", None)
            job.log = choices.ChoiceLog.of(job.choice, job.sampling, self._texts)
            self._first.set_row(0, job.sampling)
            token = self.runner.to_host(self._pick(logits.clone(), [job], self._first, 1, choices.wanted([job])))[0]
            if not self._advance(job, token, choices.to_host(self._logprobs).get(0)):
                return
            if self.slots is None:
                self.slots = self.runner.new_slots(self.max_batch)
                self.sampling = SamplingSlots(self.slots.max_rows, self.runner.device)
            row = self.slots.free_row()
            self.slots.join(
                row,
                compressed,
                room=job.sampling.max_new_tokens,
                token=token,  # a lone prefill's
                consume=job.group is None and job.request.stored is None,
            )  # layers go as written
        except Exception as error:  # noqa: BLE001 - handed to the caller, who raises it
            job.ticket.put(_ERROR, error)
            return
        self.sampling.set_row(row, job.sampling)
        self.sampling.step[row] = 1  # its first token drew step 0
        if job.recorder is not None:
            job.recorder.bind(self.slots, row)
        self.running[row] = job
        for j in self.running.values():
            j.batch_size = max(j.batch_size, len(self.running))

    def _step(self) -> None:
        """One decode step for the running batch; rows that finish (or were cancelled) leave."""
        for row in [r for r, job in self.running.items() if job.ticket.cancelled.is_set()]:
            self._leave(row)
        if not self.running:
            return
        slots = self.slots
        b = slots.batch_rows()
        jobs = [self.running.get(row) for row in range(b)]
        wanted = choices.wanted(jobs)  # each row's logprobs count, or None
        outside = any(job is not None and job.constraint is not None for job in jobs) or any(
            k is not None for k in wanted
        )  # a grammar, or logprobs: the logits leave the step; else it samples inside itself
        self._logprobs = None
        pick = (lambda logits: self._pick(logits, jobs, self.sampling, b, wanted)) if outside else None
        clock = StepClock(self.runner.device)
        try:
            tokens = self.runner.to_host(self.runner.decode_step(slots, b, pick, self.sampling))
        except Exception as error:  # noqa: BLE001 - every row of the failed step gets the error
            for job in self.running.values():
                job.ticket.put(_ERROR, error)
            self.running, self.slots = {}, None
            return
        found = choices.to_host(self._logprobs)
        ms = clock.ms() - 1000 * slots.record_s
        slots.record_s = 0.0
        for row, job in list(self.running.items()):
            job.step_ms.append(ms)
            try:
                going = self._advance(job, tokens[row], found.get(row))
            except Exception as error:  # noqa: BLE001 - this row's caller gets it; the worker goes on
                job.ticket.put(_ERROR, error)
                going = False
            if not going:
                self._leave(row)

    def _pick(
        self, logits: torch.Tensor, jobs: list[Job | None], sampling: SamplingSlots, rows: int, wanted: list[int | None]
    ) -> torch.Tensor:
        """Each row's next token under its own settings (and grammar, if it has one), on the device."""
        constraints = [job.constraint if job is not None else None for job in jobs]
        if any(c is not None for c in constraints):
            structured.apply_masks(logits, constraints)
        tokens = sample(logits, sampling, rows)
        self._logprobs = choices.on_device(logits, tokens, wanted)  # masked, before temperature
        return tokens

    def _advance(self, job: Job, token: int, found: tuple | None = None) -> bool:
        """Hand ``token`` (and ``found``, its logprobs if asked) to ``job``'s caller; whether the job goes on."""
        if job.ticket.cancelled.is_set():
            return False
        if job.constraint is not None:
            job.constraint.accept(token)
        if token in self.runner.eos_ids and not job.sampling.ignore_eos:
            return self._finish(job, "stop")
        if job.log is not None:
            job.log.add(token, found)
        self._emit(job, job.text.push(token))
        if job.text.finished:
            return self._finish(job, "stop")
        if len(job.text.ids) >= job.sampling.max_new_tokens:
            return self._finish(job, "length")
        return True

    def _finish(self, job: Job, reason: str) -> bool:
        job.text.finished = job.text.finished or reason
        self._emit(job, job.text.flush(), final=True)
        steps = tuple(job.step_ms)
        row = RowText(
            text=job.text.text,
            finish_reason=job.text.finished,
            token_ids=job.text.ids,
            decode_ms_per_token=sum(steps) / len(steps) if steps else 0.0,
            decode_step_ms=steps,
            logprobs=job.log and job.log.all,
        )
        with self._cond:
            self._totals["finished"] += 1
            self._totals["generated_tokens"] += len(job.text.ids)
            self._totals["prompt_tokens"] += job.outcome["compression"].prompt_tokens
            self._totals["kept_prompt_tokens"] += max(job.outcome["compression"].kept_tokens, default=0)
        done = Outcome(row=row, batch_size=job.batch_size, constraint=job.constraint, **job.outcome)
        if job.group is not None and job.group.n > 1:
            done = job.group.gather(done, job.choice)
        if done is not None:
            job.ticket.put(_DONE, done)
        return False

    def _emit(self, job: Job, text: str, final: bool = False) -> None:
        """Send ``text`` (a :class:`~snapkv_rag.runtime.choices.Piece` when the job reports its choice or logprobs)."""
        piece = job.log.piece(text, final) if job.log is not None else text or None
        if piece is not None:
            job.ticket.put(_PIECE, piece)

    def _leave(self, row: int) -> None:
        job = self.running.pop(row)
        if job.recorder is not None:
            self.slots.recorder = None
        self.slots.leave(row)
        self.sampling.clear_row(row)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            jobs, self._waiting = [*self.running.values(), *self._waiting], collections.deque()
        for job in jobs:
            job.ticket.put(_ERROR, error)
        self.running, self.slots = {}, None


def _seeded(sampling: SamplingOptions) -> SamplingOptions:
    """A sampled request's seed fixed once (the clock's, if none was given): its first token and the
    rest of its tokens draw from the same seed, alone or in a batch."""
    if sampling.temperature > 0 and sampling.seed is None:
        return replace(sampling, seed=time.time_ns() % 2**62)
    return sampling


class Closed(RuntimeError):
    """The engine was closed while the request waited or ran."""


_STOP = object()
_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop the workers before the interpreter tears torch down under them."""
    for scheduler in list(_LIVE):
        scheduler.close(timeout=5.0)
