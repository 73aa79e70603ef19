"""The real ``snapkv-rag serve`` process on a free loopback port with a tiny random model folder:
the exposure check, and SIGTERM (finish in-flight requests, or cancel them after the timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_testing import free_port, sse_events
from snapkv_testing import tiny_llama

from snapkv_rag.cli import main

LONG = 250_000
"""Tokens the long request asks for (EOS ignored): to finish them within the shutdown timeout a
machine would need under 25 us per streamed token, which no decode loop with a server around it
reaches, so the request is mid-decode when the timeout ends however fast the machine is."""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(len(tokenizer), max_position_embeddings=LONG + 1024).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def serve(folder: Path, *flags: str, startup_s: float = 180, output=subprocess.PIPE, env: dict | None = None):
    """A started server process and its base URL, once /health answers within ``startup_s``.
    ``output``: where its stdout and stderr go (a pipe, or a file that no reader has to drain while
    it starts: a Ray cluster logs a lot on a loaded machine); ``env``: variables set for it."""
    port = free_port()
    script = Path(sys.executable).with_name("snapkv-rag")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "snapkv_rag.cli"]
    process = subprocess.Popen(
        [*command, "serve", "--model", str(folder), "--port", str(port), *flags],
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "SNAPKV_RAG_API_KEY": "", **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {process.stdout.read() if process.stdout else ''}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError(f"the server did not start within {startup_s} s")


def stream_in_thread(url: str, folder: Path, max_tokens: int, ignore_eos: bool = False):
    events: list = []
    body = {
        "model": str(folder),
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def read():
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as reply:
                events.extend(sse_events(reply))
        except httpx.TransportError as error:  # cut by the server
            events.append(error)

    thread = threading.Thread(target=read)
    thread.start()
    deadline = time.monotonic() + 60
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(events) >= 3, "the stream did not start"
    return thread, events


def refused(url: str) -> bool:
    """Whether the server turns a new request away: the connection refused, or (while it closes its
    listening socket) accepted and closed again without a response."""
    try:
        httpx.get(url + "/health", timeout=1)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--host", "0.0.0.0"], "--host 0.0.0.0: listening beyond this machine without an API key"),
        (["--max-batch", "0"], "--max-batch 0: must be at least 1"),
        (["--port", "70000"], "--port 70000: must be at most 65535"),
        (["--replicas", "0"], "--replicas 0: must be at least 1"),
        (["--ray-address", "auto"], "--ray-address: only with --replicas"),
    ],
)
def test_bad_serve_flags_are_refused_before_the_model_loads(capsys, flags, words):
    assert main(["serve", "--model", "no/such-model-anywhere", *flags]) == 2
    assert words in capsys.readouterr().err


def test_sigterm_stops_accepting_finishes_what_it_can_cancels_the_rest_and_exits_cleanly(model_folder):
    timeout = 6
    process, url = serve(model_folder, "--shutdown-timeout", str(timeout))
    try:
        short, short_events = stream_in_thread(url, model_folder, 16)
        long, long_events = stream_in_thread(url, model_folder, LONG, ignore_eos=True)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not refused(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused(url), "still accepting connections after SIGTERM"
        assert process.wait(60) == 0
        waited = time.monotonic() - sent
        short.join(30)
        long.join(30)
    finally:
        process.kill()
    # the short request was answered in full, the long one cut at a token once the timeout was up
    assert short_events[-1] == "[DONE]" and short_events[-2]["usage"]["completion_tokens"] == 16
    assert short_events[-3]["choices"][0]["finish_reason"] == "length"
    assert "[DONE]" not in long_events and long_events[-1]["error"]["code"] == "shutting_down"
    assert timeout <= waited < timeout + 20
    output = process.stdout.read()
    assert "Traceback" not in output and "stopped" in output, output
