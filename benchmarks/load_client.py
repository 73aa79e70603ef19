"""The pieces the load benchmark and the soak share: servers started as subprocesses on loopback
ports (ours and ``transformers serve``), the peak RSS of a server's process tree, and an async
OpenAI-style client that streams one chat completion and times it.

Every server listens on 127.0.0.1 on a free port, is waited for through ``/health`` within a time
limit, and is stopped (SIGTERM, then SIGKILL) by the context manager that started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

HOST = "127.0.0.1"
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that the servers this process started are stopped on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def ours_command(model: str, port: int, max_batch: int | None = None, extra: list[str] | None = None) -> list[str]:
    """``snapkv-rag serve`` on a loopback port (run through this interpreter)."""
    command = [sys.executable, "-m", "snapkv_rag.cli", "serve", "--model", model, "--host", HOST, "--port", str(port)]
    if max_batch is not None:
        command += ["--max-batch", str(max_batch)]
    return command + list(extra or [])


def served_model_dir(model_dir: Path, scratch: Path) -> Path:
    """A folder ``transformers serve`` can load: the model's files linked, and ``config.json`` given
    the ``architectures`` entry it dispatches on (the embedded model's conversion has none)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("architectures"):
        return model_dir
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[AutoConfig.from_pretrained(model_dir).model_type]]
    target = scratch / "transformers-serve-model"
    target.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.name != "config.json" and not (target / path.name).exists():
            (target / path.name).symlink_to(path.resolve())
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


PAGE_TOKENS = 256  # transformers' continuous batching: tokens per cache block (its default page size)


def transformers_command(model_dir: Path, port: int, num_blocks: int | None = None) -> list[str]:
    """``transformers serve`` with continuous batching (paged, full cache), float32 on the CPU.
    ``num_blocks`` sizes its KV cache (blocks of 256 tokens); by default it takes most of the RAM."""
    command = [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--host",
        HOST,
        "--port",
        str(port),
        "--log-level",
        "error",
    ]
    return command + (["--cb-num-blocks", str(num_blocks)] if num_blocks else [])


def blocks_for(clients: int, longest_tokens: int) -> int:
    """Cache blocks for ``clients`` requests of up to ``longest_tokens`` (prompt + answer) at once."""
    return clients * -(-longest_tokens // PAGE_TOKENS) + 4


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its children (0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += process.memory_info().rss
    return total


class PeakRSS:
    """Samples a process tree's RSS in a thread; ``reset()`` starts a new window, ``peak`` reads it."""

    def __init__(self, pid: int, interval_s: float = 0.1):
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.interval_s)

    def reset(self) -> None:
        self.peak = tree_rss(self.pid)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Server:
    name: str
    base_url: str
    model: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


@contextlib.contextmanager
def running_server(
    name: str,
    command: list[str],
    port: int,
    model: str | None = None,
    start_timeout_s: float = 300,
    log_dir: Path | None = None,
    env: dict | None = None,
):
    """Start ``command`` (a server on ``port``), wait for ``/health`` and yield a :class:`Server`;
    stop it on exit. ``model`` None: the first id of ``/v1/models``."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="load-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET_ENV, **(env or {})},
            start_new_session=True,
        )
    server = Server(name, f"http://{HOST}:{port}", model or "", process, log_path)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"server {name} exited with {process.returncode} before it was healthy:\n{server.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"server {name} not healthy within {start_timeout_s:.0f} s:\n{server.log_tail()}")
            time.sleep(0.5)
        if not server.model:
            server.model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield server
    finally:
        stop(process)


def stop(process: subprocess.Popen, grace_s: float = 20) -> int | None:
    """SIGTERM the server's process group, then SIGKILL it after ``grace_s``; its exit status."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


@dataclass
class Outcome:
    """One streamed request, timed from just before it was sent."""

    status: int | None = None
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None
    finish_reason: str | None = None
    chunks: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict, timeout_s: float, cut_after_chunks: int | None = None
) -> Outcome:
    """POST ``body`` with ``stream: true`` and read the SSE stream to its end (or close it after
    ``cut_after_chunks`` content chunks: a client that goes away mid-answer)."""
    out, start = Outcome(), time.perf_counter()
    try:
        async with client.stream("POST", url, json={**body, "stream": True}, timeout=timeout_s) as response:
            out.status = response.status_code
            if response.status_code != 200:
                out.error = (await response.aread()).decode(errors="replace")[:500]
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])[:500]
                    break
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - start
                        out.text += piece
                        out.chunks += 1
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if chunk.get("usage"):
                    out.completion_tokens = chunk["usage"].get("completion_tokens")
                    out.prompt_tokens = chunk["usage"].get("prompt_tokens")
                if cut_after_chunks is not None and out.chunks >= cut_after_chunks:
                    break
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as error:
        out.error = f"{type(error).__name__}: {error}"
    out.latency_s = time.perf_counter() - start
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class LevelStats:
    clients: int
    requests: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    failed: int
    wrong_length: int
    latency_p50_s: float | None
    latency_p95_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    peak_rss_mib: float
    prompt_tokens: list[int | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def summarise(outcomes: list[Outcome], clients: int, wall_s: float, new_tokens: int, peak_rss: int) -> LevelStats:
    good = [o for o in outcomes if o.ok]
    tokens = sum(o.completion_tokens or 0 for o in good)
    return LevelStats(
        clients=clients,
        requests=len(outcomes),
        wall_s=round(wall_s, 3),
        output_tokens=tokens,
        tokens_per_s=round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        failed=len(outcomes) - len(good),
        wrong_length=sum(1 for o in good if o.completion_tokens != new_tokens),
        latency_p50_s=percentile([o.latency_s for o in good], 50),
        latency_p95_s=percentile([o.latency_s for o in good], 95),
        ttft_p50_s=percentile([o.ttft_s for o in good if o.ttft_s is not None], 50),
        ttft_p95_s=percentile([o.ttft_s for o in good if o.ttft_s is not None], 95),
        peak_rss_mib=round(peak_rss / 2**20, 1),
        prompt_tokens=[o.prompt_tokens for o in outcomes],
        errors=sorted({o.error for o in outcomes if o.error})[:5],
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
