"""Answering an admitted request from the engine's ``astream_result``: as one JSON body, or as
server-sent events (with ``stream_options.include_usage``, a last chunk of usage). The iterator is
advanced to its first item before any header goes out, so bad input is still an HTTP error. A
client that goes away closes that iterator, which cancels its request in the engine (its batch slot
is free within one decode step); after a shutdown's grace period the request is cancelled at its
next token. The batching itself is the engine's."""

from __future__ import annotations

import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import ContextLengthError, GenerationOutOfMemoryError
from . import doc_reuse, protocol
from .errors import APIError
from .protocol import Call
from .state import Ticket
from .streams import Streams

log = logging.getLogger("snapkv_rag.server")


def shutting_down() -> APIError:
    return APIError(
        503, "the server is shutting down: this request was cancelled", type="server_error", code="shutting_down"
    )


def sse(event: dict | str) -> str:
    """One server-sent event: a chunk as JSON, or ``[DONE]`` as it is."""
    return f"data: {event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)}\n\n"


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


async def start(llm, call: Call):
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


async def answer(request: Request, llm, call: Call, ticket: Ticket, endpoint: str) -> Response:
    """The response to ``call`` (over the stored cache of its documents when it can be,
    :mod:`.doc_reuse`): whole, or a :class:`Stream` when the request asked for one."""
    pieces, first = await start(llm, await doc_reuse.over_stored(llm, call))
    reply = Reply(request, call, ticket, endpoint, pieces)
    if isinstance(first, str):  # a first piece of text (an answer of no tokens has none)
        ticket.server.metrics.first_token.labels(endpoint).observe(time.perf_counter() - ticket.arrived)
    if not call.stream:
        return await reply.whole(first)
    return Stream(reply.events(first), reply.close)


class Reply:
    """One request being answered: the engine's iterator of its pieces (text, then its result),
    its ticket, and the id and time its chunks carry."""

    def __init__(self, request: Request, call: Call, ticket: Ticket, endpoint: str, pieces):
        self.request, self.call, self.ticket, self.endpoint, self.pieces = request, call, ticket, endpoint, pieces
        self.metrics, self.server = ticket.server.metrics, ticket.server
        self.id, self.created = f"{'chatcmpl' if call.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

    async def close(self) -> None:
        """Cancels the request in the engine if it still runs, and frees its place."""
        await self.pieces.aclose()
        self.ticket.release()

    def finished(self, result) -> None:
        self.metrics.finished(self.endpoint, result, time.perf_counter() - self.ticket.arrived)
        self.metrics.requests.labels(self.endpoint, "200").inc()

    async def whole(self, item) -> Response:
        """The answer as one JSON body; 499 (nothing sent) when the client has gone meanwhile."""
        try:
            while isinstance(item, str):
                if self.server.cancelled():
                    raise shutting_down()
                if await self.request.is_disconnected():
                    self.metrics.requests.labels(self.endpoint, "499").inc()
                    return Response(status_code=499)
                item = await anext(self.pieces)
        finally:
            await self.close()
        self.finished(item)
        return JSONResponse(protocol.response(self.call, self.id, self.created, item))

    async def events(self, item):
        """The answer's server-sent events; an engine failure or a shutdown ends them with an error event."""
        streams = Streams(self.call, self.id, self.created)
        for event in streams.start():
            yield sse(event)
        try:
            while isinstance(item, str):
                for event in streams.piece(item):
                    yield sse(event)
                if self.server.cancelled():
                    yield sse(shutting_down().body())
                    return
                item = await anext(self.pieces)
        except (GenerationOutOfMemoryError, RuntimeError) as error:
            log.error("stream %s failed: %s", self.id, error)
            yield sse(APIError(500, str(error), type="server_error").body())
            return
        finally:
            await self.close()
        self.finished(item)
        for event in streams.end(item):
            yield sse(event)
        if self.call.include_usage:
            yield sse(protocol.usage_chunk(self.call, self.id, self.created, item))
        yield sse("[DONE]")
