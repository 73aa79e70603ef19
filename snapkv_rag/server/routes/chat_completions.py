"""``POST /v1/chat/completions``: messages (with documents, tools, ``n``, logprobs) answered by the
engine, whole or streamed."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from .. import answers, deps, protocol
from ..protocol import Call
from ..state import Ticket

ENDPOINT = "/v1/chat/completions"
router = APIRouter()
chat_call = deps.admitted_call(protocol.parse_chat)


@router.post(ENDPOINT)
async def chat_completions(
    request: Request,
    call: Annotated[Call, Depends(chat_call)],
    ticket: Annotated[Ticket, Depends(deps.admission)],
    llm: Annotated[Any, Depends(deps.engine)],
) -> Response:
    return await answers.answer(request, llm, call, ticket, ENDPOINT)
