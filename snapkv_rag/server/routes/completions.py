"""``POST /v1/completions``: a prompt (with documents, ``n``, logprobs) answered by the engine,
whole or streamed."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from .. import answers, deps, protocol
from ..protocol import Call
from ..state import Ticket

ENDPOINT = "/v1/completions"
router = APIRouter()
completion_call = deps.admitted_call(protocol.parse_completion)


@router.post(ENDPOINT)
async def completions(
    request: Request,
    call: Annotated[Call, Depends(completion_call)],
    ticket: Annotated[Ticket, Depends(deps.admission)],
    llm: Annotated[Any, Depends(deps.engine)],
) -> Response:
    return await answers.answer(request, llm, call, ticket, ENDPOINT)
