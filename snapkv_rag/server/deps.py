"""The FastAPI dependencies of the routes. The engine, the settings and the :class:`~.state.ServerState`
come from ``app.state``; a route that runs the engine takes its request through three checks, in
this order: its body parsed and its model checked (400, 404: before anything is counted), its
admission (503 once shutting down, 429 beyond ``max_batch + max_queue`` in flight, or beyond
``max_streams`` open streams), and its prompt counted against ``max_prompt_tokens`` and the context
window (400), so that a malformed body is a 400 even when the queue is
full. The bearer key and the body size are not here: they must be checked before the body is read
(:mod:`.guard`)."""

# no `from __future__ import annotations`: FastAPI reads the Annotated[..., Depends(...)] of the
# dependencies built inside functions (parsed_call, admitted_call), which strings could not name

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Depends, Request

from . import protocol
from .errors import APIError
from .protocol import Call, ServerSettings
from .state import ServerState, Ticket


async def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def engine(request: Request) -> Any:
    """The app's :class:`~snapkv_rag.engine.SnapKVLLM`."""
    return request.app.state.llm


async def server_settings(request: Request) -> ServerSettings:
    return request.app.state.settings


async def admission(
    server: Annotated[ServerState, Depends(server_state)], settings: Annotated[ServerSettings, Depends(server_settings)]
) -> AsyncIterator[Ticket]:
    """A place among the requests in flight, or 503 (shutting down) or 429 (full). The answer
    releases it as soon as the engine is done (:mod:`.answers`); here only a request that fails
    before its answer takes over is released. Not on every exit: FastAPI 0.106 to 0.117 run a
    dependency's exit before a streamed response is sent, which would free a stream's place early."""
    if not server.accepting:
        raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    if server.in_flight >= settings.max_batch + settings.max_queue:
        raise APIError(
            429,
            f"the queue is full: {server.in_flight} requests in flight (max batch "
            f"{settings.max_batch} + queue {settings.max_queue}; --max-batch and --max-queue set them); retry later",
            type="rate_limit_error",
            code="queue_full",
        )
    ticket = Ticket(server)
    try:
        yield ticket
    except BaseException:
        ticket.release()
        raise


def parsed_call(parser: Callable[[dict, ServerSettings], Call]) -> Callable:
    """A dependency: the JSON body as a :class:`~.protocol.Call` by ``parser``
    (:func:`~.protocol.parse_chat` or :func:`~.protocol.parse_completion`), for the model this
    server serves (404 for any other)."""

    async def parsed(request: Request, settings: Annotated[ServerSettings, Depends(server_settings)]) -> Call:
        call = parser(protocol.parse_json(await request.body()), settings)
        if call.model != settings.model_name:
            raise APIError(
                404,
                f"model: {call.model!r} is not served here; this server serves {settings.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return call

    return parsed


async def check_context_length(llm, call: Call, settings: ServerSettings) -> None:
    """400 unless the prompt as the engine builds it (documents, tools) is within
    ``--max-prompt-tokens`` and, with ``max_tokens``, fits the context window: said before any
    engine work, with the numbers. Tokenizing runs in a thread."""
    param = "messages" if call.kind == "chat" else "prompt"
    try:
        prompt = await asyncio.to_thread(
            llm.request, call.prompt, call.documents, tools=call.tools and call.tools.shown
        )
    except (ValueError, TypeError) as error:
        raise APIError(400, str(error), param=param) from None
    tokens, new = len(prompt.input_ids), call.options.get("max_new_tokens", llm.max_new_tokens)
    limit = settings.max_prompt_tokens
    if limit is not None and tokens > limit:
        raise APIError(
            400,
            f"the prompt is {tokens} tokens, over this server's limit of {limit} prompt tokens; "
            "--max-prompt-tokens sets the limit",
            param=param,
            code="prompt_too_long",
        )
    if tokens + new > llm.context_window:
        raise APIError(
            400,
            f"this model's context window is {llm.context_window} tokens; the prompt is "
            f"{tokens} tokens and max_tokens is {new}: {tokens + new} in all",
            param=param,
            code="context_length_exceeded",
        )


def admitted_call(parser: Callable[[dict, ServerSettings], Call]) -> Callable:
    """A dependency of a route that runs the engine: its :func:`parsed_call`, once :func:`admission`
    has let it in and :func:`check_context_length` has passed it. The route takes the same
    :class:`~.state.Ticket` with ``Depends(admission)`` (FastAPI solves it once per request)."""
    parsed = parsed_call(parser)

    async def admitted(
        call: Annotated[Call, Depends(parsed)],
        ticket: Annotated[Ticket, Depends(admission)],
        llm: Annotated[Any, Depends(engine)],
        settings: Annotated[ServerSettings, Depends(server_settings)],
    ) -> Call:
        # the ticket is asked for so that admission comes after parsing and before the length check
        if call.stream:
            if ticket.server.streams >= settings.max_streams:
                raise APIError(
                    429,
                    f"too many streams: {ticket.server.streams} streamed responses open, this server's "
                    f"limit is {settings.max_streams}; --max-streams sets it; retry later",
                    type="rate_limit_error",
                    code="too_many_streams",
                )
            ticket.streamed()
        await check_context_length(llm, call, settings)
        return call

    return admitted
