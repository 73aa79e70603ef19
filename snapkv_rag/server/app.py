"""The OpenAI-compatible HTTP layer over one :class:`~snapkv_rag.engine.SnapKVLLM`.

It parses and checks requests (:mod:`.protocol`), admits at most ``max_batch + max_queue`` at a
time (429 beyond), counts the prompt against the context window before any work, then consumes the
engine's ``astream_result``. A client that goes away closes that iterator, which cancels its request
in the engine (its batch slot is free within one decode step). The batching itself is the engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..engine import ContextLengthError, GenerationOutOfMemoryError
from . import doc_reuse, protocol
from .metrics import Metrics
from .protocol import APIError, Call, ServerSettings
from .streams import Streams

log = logging.getLogger("snapkv_rag.server")


class Guard:
    """ASGI middleware: the bearer key (every path but ``/health``) and the body size limit, both
    before the route reads anything."""

    def __init__(self, app, settings: ServerSettings):
        self.app, self.settings = app, settings
        self.key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                error = APIError(401, "a valid API key is required: Authorization: Bearer <key>",
                                 code="invalid_api_key")
                return await JSONResponse(error.body(), 401)(scope, receive, send)
        limit = self.settings.max_body_bytes
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > limit:
            error = APIError(413, f"the request body is over this server's limit of {limit} bytes",
                             code="request_too_large")
            return await JSONResponse(error.body(), 413)(scope, receive, send)
        seen = 0

        async def counted():  # a chunked body has no Content-Length: count what arrives
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise APIError(413, f"the request body is over this server's limit of {limit} bytes",
                               code="request_too_large")
            return message

        return await self.app(scope, counted, send)


class Stream(StreamingResponse):
    """A streaming response that runs ``cleanup`` however it ends (finished, client gone, shutdown)."""

    def __init__(self, events, cleanup):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.cleanup()


def _sse(event: dict | str) -> str:
    return f"data: {event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)}\n\n"


def create_app(llm, settings: ServerSettings) -> FastAPI:
    """The app for one engine: ``llm`` is a :class:`~snapkv_rag.engine.SnapKVLLM` (``request``,
    ``astream_result``, ``stats``, ``context_window``, ``max_new_tokens``)."""
    state = {"in_flight": 0, "accepting": True, "cancel_at": None}

    def shutdown(grace_s: float) -> None:
        """Stop admitting; requests still running ``grace_s`` seconds from now are cancelled at
        their next token (a stream ends with an error event, a plain request gets 503)."""
        state["accepting"] = False
        state["cancel_at"] = time.monotonic() + grace_s

    def cancelled() -> bool:
        return state["cancel_at"] is not None and time.monotonic() >= state["cancel_at"]

    shutting_down = APIError(503, "the server is shutting down: this request was cancelled", type="server_error",
                             code="shutting_down")

    def load() -> tuple[int, int]:
        stats = llm.stats()
        return stats.queued, stats.running

    metrics = Metrics(load, getattr(llm, "prefix_stats", None), getattr(llm, "doc_stats", None))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state["accepting"] = False

    app = FastAPI(title="snapkv-rag", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        metrics.requests.labels(request.url.path, str(error.status)).inc()
        return JSONResponse(error.body(), error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        kind = "not_found" if error.status_code == 404 else "method_not_allowed" if error.status_code == 405 else None
        body = APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", code=kind).body()
        return JSONResponse(body, error.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        log.exception("%s failed", request.url.path)
        body = APIError(500, f"internal error: {type(error).__name__}: {error}", type="server_error").body()
        return JSONResponse(body, 500)

    async def parse(request: Request, parser) -> Call:
        call = parser(protocol.parse_json(await request.body()), settings)
        if call.model != settings.model_name:
            raise APIError(404, f"model: {call.model!r} is not served here; this server serves "
                           f"{settings.model_name!r}", param="model", code="model_not_found")
        return call

    def admit() -> None:
        if not state["accepting"]:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if state["in_flight"] >= settings.max_batch + settings.max_queue:
            raise APIError(429, f"the queue is full: {state['in_flight']} requests in flight (max batch "
                           f"{settings.max_batch} + queue {settings.max_queue}); retry later",
                           type="rate_limit_error", code="queue_full")
        state["in_flight"] += 1
        metrics.in_flight.set(state["in_flight"])

    async def check_length(call: Call) -> None:
        try:
            prompt = await asyncio.to_thread(llm.request, call.prompt, call.documents,
                                             tools=call.tools and call.tools.shown)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), param="messages" if call.kind == "chat" else "prompt") from None
        tokens, new = len(prompt.input_ids), call.options.get("max_new_tokens", llm.max_new_tokens)
        if tokens + new > llm.context_window:
            raise APIError(400, f"this model's context window is {llm.context_window} tokens; the prompt is "
                           f"{tokens} tokens and max_tokens is {new}: {tokens + new} in all",
                           param="messages" if call.kind == "chat" else "prompt", code="context_length_exceeded")

    async def start(call: Call):
        """The engine's iterator, advanced to its first item: bad input raises here, before any header."""
        pieces = llm.astream_result(call.prompt, call.documents, **call.options)
        try:
            return pieces, await anext(pieces)
        except ContextLengthError as error:
            raise APIError(400, str(error), code="context_length_exceeded") from None
        except (ValueError, TypeError) as error:  # the engine's messages start with the option's name
            name = str(error).split(":")[0]
            raise APIError(400, str(error), param=name if name.isidentifier() else None) from None
        except GenerationOutOfMemoryError as error:
            raise APIError(503, str(error), type="server_error", code="out_of_memory") from None

    async def answer(request: Request, call: Call, endpoint: str):
        arrived = time.perf_counter()
        admit()
        released = False

        async def release():
            nonlocal released
            if not released:
                released = True
                state["in_flight"] -= 1
                metrics.in_flight.set(state["in_flight"])

        try:
            await check_length(call)
            pieces, first = await start(await doc_reuse.over_stored(llm, call))
        except BaseException:
            await release()
            raise
        call_id, created = f"{'chatcmpl' if call.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

        if isinstance(first, str):  # a first piece of text (an answer of no tokens has none)
            metrics.first_token.labels(endpoint).observe(time.perf_counter() - arrived)

        if not call.stream:
            item = first
            try:
                while isinstance(item, str):
                    if cancelled():
                        raise shutting_down
                    if await request.is_disconnected():
                        metrics.requests.labels(endpoint, "499").inc()
                        return Response(status_code=499)
                    item = await anext(pieces)
            finally:
                await pieces.aclose()
                await release()
            metrics.finished(endpoint, item, time.perf_counter() - arrived)
            metrics.requests.labels(endpoint, "200").inc()
            return JSONResponse(protocol.response(call, call_id, created, item))

        async def events():
            item, streams = first, Streams(call, call_id, created)
            for event in streams.start():
                yield _sse(event)
            try:
                while isinstance(item, str):
                    for event in streams.piece(item):
                        yield _sse(event)
                    if cancelled():
                        yield _sse(shutting_down.body())
                        return
                    item = await anext(pieces)
            except (GenerationOutOfMemoryError, RuntimeError) as error:
                log.error("stream %s failed: %s", call_id, error)
                yield _sse(APIError(500, str(error), type="server_error").body())
                return
            finally:
                await pieces.aclose()
                await release()
            metrics.finished(endpoint, item, time.perf_counter() - arrived)
            metrics.requests.labels(endpoint, "200").inc()
            for event in streams.end(item):
                yield _sse(event)
            if call.include_usage:
                yield _sse(protocol.usage_chunk(call, call_id, created, item))
            yield _sse("[DONE]")

        async def cleanup():
            await pieces.aclose()
            await release()

        return Stream(events(), cleanup)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, await parse(request, protocol.parse_chat), "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, await parse(request, protocol.parse_completion), "/v1/completions")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "snapkv-rag", "max_model_len": llm.context_window}]}

    @app.get("/health")
    async def health():
        if not state["accepting"]:
            return JSONResponse({"status": "shutting down"}, 503)
        return {"status": "ok", "in_flight": state["in_flight"]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(Guard, settings=settings)
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    else:
        app.add_middleware(Guard, settings=settings)
    app.state.metrics, app.state.status, app.state.shutdown = metrics, state, shutdown
    return app
