"""The evals on Ray actors: ``python -m evals ... --ray [auto|ADDRESS] [--ray-workers K]``.

Each actor loads the model once (one GPU per actor when the cluster has GPUs, else one CPU) and
runs ``SnapKVLLM.compare`` for the prompts it is sent; the comparisons stream back to the driver,
which turns them into rows with the same code as a single-process run (:mod:`evals.runner`) and
writes ``rows.jsonl`` in the same order, so resuming, the tables and the plots are unchanged. When an
actor's process dies, Ray restarts it (the model loads again) and the driver sends the prompts it
had in flight again: every prompt's rows are written exactly once. The driver never loads the model:
prompt lengths (for the per-cell budgets and the needle haystacks) come from the actors.

Bare ``--ray`` starts a one-machine cluster with every Ray port on loopback
(:mod:`snapkv_rag.server.ray_local`); a cluster joined with ``--ray auto|ADDRESS`` is its operator's to
secure. Ray is imported only here, and this module only when ``--ray`` is given. The ``evals`` package
travels to the cluster with the job (Ray's ``py_modules``, without its data and results folders);
the workers need ``snapkv-rag`` and Ray installed, like the driver.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from snapkv_rag.server import ray_local

from . import runner
from .datasets import Example
from .methods import MethodSpec

MAX_ATTEMPTS = 3  # a prompt whose actor died this many times is reported, not retried forever
IN_FLIGHT = 2  # prompts queued per actor, so that it never waits for the driver


class Worker:
    """Ray actor body: one engine, loaded once per (re)start of the actor's process."""

    def __init__(self, make_engine: Callable[[], Any], instruction: str):
        self.llm = make_engine()
        self.llm.instruction = instruction

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": str(self.llm.device),
            "context_window": self.llm.context_window,
        }

    def prompt_tokens(self, items: Sequence[tuple[str, list]]) -> list[int]:
        return [self.llm.prompt_tokens(question, documents) for question, documents in items]

    def compare(
        self,
        question: str,
        documents: list,
        configs: dict,
        max_new_tokens: int,
        stop: list,
        cite: str = "text",
        together: bool = False,
    ) -> Any:
        return self.llm.compare(
            question,
            documents,
            methods=configs,
            hit_rate=True,
            max_new_tokens=max_new_tokens,
            stop=stop,
            cite=cite,
            together=together,
        )


def _doc_key(question: str, documents: Sequence) -> tuple:
    return question, tuple((d.get("title"), d["text"]) if isinstance(d, dict) else d for d in documents)


class RayPool:
    """Actors on a Ray cluster, and the two things the driver asks of an engine (prompt lengths and
    the context window) answered by them."""

    def __init__(
        self,
        address: str,
        workers: int | None,
        make_engine: Callable[[], Any],
        instruction: str,
        device: str | None = None,
    ):
        try:
            import ray
        except ImportError:
            raise SystemExit("--ray needs Ray: pip install 'snapkv-rag[ray]'") from None
        self.ray = ray
        package = Path(__file__).resolve().parent
        runtime_env = {"py_modules": [str(package)], "excludes": ["/data/", "/results/", "__pycache__/"]}
        self.started = not ray.is_initialized()
        if self.started:
            if address == "local":  # Ray's ports on loopback: nothing beyond this machine needs them
                cpus = os.cpu_count() or 1
                ray_local.start(num_cpus=max(cpus, workers or 0), runtime_env=runtime_env, log_to_driver=False)
            else:
                try:
                    ray.init(address=address, runtime_env=runtime_env)
                except ConnectionError:  # Ray's own message is a 25-line traceback from inside ray.init
                    raise SystemExit(no_cluster(address)) from None
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0)) if device is None or device.startswith("cuda") else 0
        count = workers or gpus or int(resources.get("CPU", 1))
        per_actor = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": 1}
        if gpus and count > gpus:
            print(f"--ray-workers {count}: the cluster has {gpus} GPUs; {count - gpus} actors wait for one", flush=True)
        actor = ray.remote(Worker).options(max_restarts=-1, max_task_retries=0, **per_actor)
        self.actors = [actor.remote(make_engine, instruction) for _ in range(count)]
        try:
            self.infos = ray.get([a.info.remote() for a in self.actors])  # waits for every model to load
        except ray.exceptions.RayActorError as error:  # the engine's constructor raised (model, device, dtype)
            cause = getattr(error, "cause", None) or error
            self.close()
            raise SystemExit(
                f"--model/--device/--dtype: the Ray actors could not load the model: "
                f"{str(cause).strip().splitlines()[-1]}"
            ) from None
        exposed = ray_local.exposure_warning() if self.started and address == "local" else None
        if exposed:
            print(f"ray: warning: {exposed}", file=sys.stderr, flush=True)
        self.context_window = min(i["context_window"] for i in self.infos)
        self.device = self.infos[0]["device"]
        self._lengths: dict[tuple, int] = {}
        hosts = sorted({i["host"] for i in self.infos})
        print(
            f"ray: {count} actors ({'1 GPU' if gpus else '1 CPU'} each) on {len(hosts)} node(s), "
            f"model on {self.device}",
            flush=True,
        )

    def prompt_tokens(self, question: str, documents: Sequence | None = None) -> int:
        key = _doc_key(question, documents or [])
        if key not in self._lengths:
            self.count_many([(question, list(documents or []))])
        return self._lengths[key]

    def count_many(self, items: Sequence[tuple[str, list]], chunk: int = 64) -> None:
        """Prompt lengths of many prompts at once, spread over the actors (cached by content)."""
        todo = [it for it in items if _doc_key(*it) not in self._lengths]
        chunks = [todo[i : i + chunk] for i in range(0, len(todo), chunk)]
        refs = [self.actors[i % len(self.actors)].prompt_tokens.remote(c) for i, c in enumerate(chunks)]
        for c, lengths in zip(chunks, self.ray.get(refs)):
            self._lengths.update((_doc_key(*it), n) for it, n in zip(c, lengths))

    def pids(self, timeout_s: float = 300) -> list[int]:
        """The actors' current process ids (a restarted actor has a new one), waiting for restarts."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return [i["pid"] for i in self.ray.get([a.info.remote() for a in self.actors])]
            except self.ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        if self.started:
            self.ray.shutdown()

    def run(
        self,
        examples: Sequence[Example],
        specs: Sequence[MethodSpec],
        out: Path,
        *,
        settings: dict,
        max_new_tokens: int,
        stop: Sequence[str],
        resume: bool = True,
        progress: bool = True,
        on_result: Callable[[int], None] | None = None,
    ) -> Path:
        """Like :func:`evals.runner.run`, on the actors. ``on_result(k)`` is called after the k-th
        prompt of this run came back (tests use it to kill an actor mid-run)."""
        self.count_many([(e.question, list(e.documents)) for e in examples])
        path, todo, plans = runner.pending(
            self, examples, specs, out, settings=settings, max_new_tokens=max_new_tokens, resume=resume
        )
        bar = runner._progress(len(examples), len(examples) - len(todo), progress)
        errors = self.ray.exceptions
        queue = list(range(len(todo)))  # indices into todo, next to send
        attempts = [0] * len(todo)
        running: dict[Any, tuple[int, int]] = {}  # object ref -> (todo index, actor index)
        pings: dict[Any, int] = {}  # info() sent to an actor that failed: it is back when this answers
        finished: dict[int, list[dict]] = {}
        written = received = 0
        load = [0] * len(self.actors)
        with path.open("a", encoding="utf-8") as f:
            while written < len(todo):
                down = set(pings.values())
                for a in range(len(self.actors)):
                    while queue and load[a] < IN_FLIGHT and a not in down:
                        i = queue.pop(0)
                        configs, _, _ = plans[runner.cell_key(todo[i])]
                        ref = self.actors[a].compare.remote(
                            todo[i].question,
                            list(todo[i].documents),
                            configs,
                            max_new_tokens,
                            list(stop),
                            settings.get("citations") or "text",
                            bool(settings.get("batch_methods")),
                        )
                        running[ref] = (i, a)
                        load[a] += 1
                [ref], _ = self.ray.wait([*running, *pings], num_returns=1)
                if ref in pings:  # an actor that failed: back (restarted), or still restarting
                    a = pings.pop(ref)
                    try:
                        self.infos[a] = self.ray.get(ref)
                    except errors.RayActorError:
                        time.sleep(0.5)
                        pings[self.actors[a].info.remote()] = a
                    continue
                i, a = running.pop(ref)
                load[a] -= 1
                try:
                    comparison = self.ray.get(ref)
                except errors.RayActorError as error:  # the actor's process died (or is restarting)
                    attempts[i] += 1
                    bar.write(
                        f"ray: actor {a} died running {todo[i].id} ({type(error).__name__}); Ray restarts "
                        f"it and the prompt is sent again",
                        file=sys.stderr,
                    )
                    if attempts[i] >= MAX_ATTEMPTS:
                        raise RuntimeError(
                            f"{todo[i].id}: the actor running it died {attempts[i]} times; rows so far are in {path}"
                        ) from error
                    queue.insert(0, i)
                    if a not in pings.values():
                        pings[self.actors[a].info.remote()] = a
                    continue
                except errors.RayTaskError as error:  # the engine raised: the same error as in one process
                    raise error.as_instanceof_cause() from None
                _, budgets, mean_tokens = plans[runner.cell_key(todo[i])]
                finished[i] = runner.example_rows(todo[i], comparison, budgets, mean_tokens, settings)
                received += 1
                bar.update(1)
                while written in finished:  # rows go out in run order, as a single process writes them
                    runner.append_rows(f, finished.pop(written))
                    written += 1
                if on_result is not None:
                    on_result(received)
        bar.close()
        return path


def no_cluster(address: str) -> str:
    """The one line for ``--ray auto`` / ``--ray ADDRESS`` when there is no cluster to join there."""
    where = "running on this machine (or at RAY_ADDRESS)" if address == "auto" else f"at {address}"
    return (
        f"--ray {address}: found no Ray cluster {where}; use bare --ray to start Ray here, or start one "
        "with `ray start --head` and pass --ray auto (or its address, HEAD:6379 / ray://HEAD:10001)"
    )


def connect(
    address: str, workers: int | None, make_engine: Callable[[], Any], instruction: str, device: str | None = None
) -> RayPool:
    """Start (``local``) or join (``auto``, ``ray://host:10001``, ``host:6379``) a Ray cluster."""
    start = time.perf_counter()
    pool = RayPool(address, workers, make_engine, instruction, device)
    print(f"ray: actors ready in {time.perf_counter() - start:.0f} s", flush=True)
    return pool
