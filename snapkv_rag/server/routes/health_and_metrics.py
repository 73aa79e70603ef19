"""``GET /health`` (no API key needed: a load balancer's probe; 503 once shutting down) and
``GET /metrics`` (Prometheus text, :mod:`snapkv_rag.server.metrics`)."""

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import deps
from ..state import ServerState

router = APIRouter()


@router.get("/health")
async def health(server: Annotated[ServerState, Depends(deps.server_state)]):
    if not server.accepting:
        return JSONResponse({"status": "shutting down"}, 503)
    return {"status": "ok", "in_flight": server.in_flight}


@router.get("/metrics")
async def prometheus(server: Annotated[ServerState, Depends(deps.server_state)]) -> Response:
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)
