"""``snapkv-rag serve --replicas 2 --host 127.0.0.1`` on a Ray cluster it starts itself: every
socket of every Ray process listens on loopback (but what the server's own warning line names),
the replicas answer with the API key, and SIGTERM takes every Ray process down within a bound."""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import time

import httpx
import pytest
from test_serve_process import model_folder, serve  # noqa: F401  (model_folder: the tiny model's fixture)

from snapkv_rag.server.ray_local import is_loopback, listening

pytest.importorskip("ray.serve", reason="the ray extra (ray[serve]) is not installed")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.heavy  # Ray's start-up and two replicas loading: about a minute
KEY = "loopback-key"
STOP_BOUND_S = 30
STARTUP_S = 420  # Ray's start and two replicas loading, on a machine the rest of the suite keeps busy
WARNING = "Ray components listening beyond loopback"


def ray_processes(server: psutil.Process, ray_dir: str) -> list[psutil.Process]:
    """The server, its descendants (Ray's head processes and, under the raylet, its workers and
    agents) and any process started with this cluster's private Ray folder on its command line
    (one Ray would have started apart from the server). Other processes are not looked at."""
    found = {server, *server.children(recursive=True)}
    for process in psutil.process_iter(["cmdline"]):
        if any(ray_dir in part for part in process.info["cmdline"] or []):
            found.add(process)
    return sorted(found, key=lambda p: p.pid)


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.2)


def test_a_self_started_cluster_listens_on_loopback_answers_and_stops_fast(model_folder, monkeypatch, tmp_path):  # noqa: F811
    ray_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's unix sockets live under it
    monkeypatch.setenv("RAY_TMPDIR", ray_dir)
    log = tmp_path / "serve.log"

    def lines() -> list[str]:
        return log.read_text(errors="replace").splitlines()

    with log.open("w") as output:  # a file: Ray's logs never stall the server on a full pipe
        process, url = serve(
            model_folder, "--replicas", "2", "--host", "127.0.0.1", "--api-key", KEY, startup_s=STARTUP_S, output=output
        )
    processes: list[psutil.Process] = []
    try:
        wait_for(lambda: any("from 2 Ray Serve replicas" in line for line in lines()), 120, "both replicas up")
        server = psutil.Process(process.pid)
        processes = ray_processes(server, ray_dir)
        sockets = listening(processes)
        names = [p.name() for p in processes]
        # the listing sees what it should: the server's HTTP port and Ray's own processes
        assert ("ray::ProxyActor", "127.0.0.1", int(url.rsplit(":", 1)[1])) in sockets, sockets
        assert {"gcs_server", "raylet"} <= set(names) and sum(n.startswith("ray::ServeReplica") for n in names) == 2
        warned = " ".join(line for line in lines() if WARNING in line)
        exposed = [s for s in sockets if not is_loopback(s[1])]
        assert all(name in warned for name, _, _ in exposed), f"not on loopback, not warned of: {exposed}"
        reply = httpx.post(
            url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
            json={"model": str(model_folder), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401

        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(STOP_BOUND_S) == 0
        wait_for(
            lambda: not any(alive(p) for p in processes),
            max(1.0, STOP_BOUND_S - (time.monotonic() - sent)),
            "every Ray process gone after SIGTERM",
        )
        stopped_s = time.monotonic() - sent
    finally:  # a failed run leaves no process behind (psutil checks that a pid was not reused)
        process.kill()
        for p in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        shutil.rmtree(ray_dir, ignore_errors=True)
    output = "\n".join(lines())
    assert "Traceback" not in output and "stopped" in output, output
    print(f"stopped in {stopped_s:.1f} s; sockets: {sockets}")
