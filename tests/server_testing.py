"""Helpers for the server tests: an app on a free loopback port, run by uvicorn in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from snapkv_rag.server.app import create_app
from snapkv_rag.server.protocol import ServerSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(llm, **settings):
    """``(base_url, app)`` of a server for ``llm`` on 127.0.0.1, stopped on exit. Its compression is
    the engine's default (as ``snapkv-rag serve`` makes them one), unless ``settings`` say otherwise."""
    own = {"compression": llm.default_snapkv, "base_compression": llm.default_snapkv or ServerSettings.base_compression}
    app = create_app(llm, ServerSettings(**{"model_name": "tiny", **own, **settings}))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)


def sse_events(response) -> list:
    """The ``data:`` payloads of a streamed httpx response, as they arrive."""
    import json

    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)
