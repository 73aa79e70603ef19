"""The OpenAI-compatible HTTP layer over one :class:`~snapkv_rag.engine.SnapKVLLM`:
:func:`create_app` puts together the routes (:mod:`.routes`, one router each), whose checks are
dependencies (:mod:`.deps`: parsing, admission at most ``max_batch + max_queue`` at a time, the
context window) and whose answers come from the engine's ``astream_result`` (:mod:`.answers`);
the bearer key and body size middleware (:mod:`.guard`); the errors in OpenAI's shape
(:mod:`.error_handlers`); the app's shared state (:mod:`.state`) on ``app.state``; and
``GET /openapi.json``, the schema of what the routes take and give (:mod:`.openapi`; it needs the
API key when the server has one)."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from . import error_handlers, openapi
from .guard import Guard
from .metrics import Metrics
from .protocol import ServerSettings
from .routes import ROUTERS
from .state import ServerState


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    app.state.server.accepting = False  # the server is stopping: nothing new is admitted


def _add_middleware(app: FastAPI, settings: ServerSettings) -> None:
    """The guard, and CORS around it when origins are configured (a browser's preflight carries no
    key, so CORS answers it before the guard would refuse it)."""
    app.add_middleware(Guard, settings=settings)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )


def create_app(llm, settings: ServerSettings) -> FastAPI:
    """The app for one engine: ``llm`` is a :class:`~snapkv_rag.engine.SnapKVLLM` (``request``,
    ``astream_result``, ``stats``, ``context_window``, ``max_new_tokens``).

    Besides the engine (``app.state.llm``), the settings (``app.state.settings``) and the shared
    :class:`~.state.ServerState` (``app.state.server``), ``app.state`` holds what other code calls:
    ``shutdown(grace_s)`` (what ``serve`` calls on SIGTERM), ``status`` (the same state, readable as
    ``status["in_flight"]``) and ``metrics``."""

    def load() -> tuple[int, int]:
        stats = llm.stats()
        return stats.queued, stats.running

    server = ServerState(Metrics(load, getattr(llm, "prefix_stats", None), getattr(llm, "doc_stats", None)))
    app = FastAPI(
        title="snapkv-rag",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        exception_handlers=error_handlers.HANDLERS,
    )
    document = openapi.schema(settings)
    app.openapi = lambda: document  # written to what the routes take (:mod:`.openapi`), not inferred
    for router in ROUTERS:
        app.include_router(router)
    _add_middleware(app, settings)
    app.state.llm, app.state.settings, app.state.server = llm, settings, server
    app.state.metrics, app.state.status, app.state.shutdown = server.metrics, server, server.shutdown
    return app
