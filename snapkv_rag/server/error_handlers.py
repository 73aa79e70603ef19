"""The app's exception handlers: every error leaves in OpenAI's shape (:mod:`.errors`), the ones
this server raises (counted in ``/metrics``), Starlette's 404 and 405, and anything unexpected (500,
logged with its traceback)."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .errors import APIError

log = logging.getLogger("snapkv_rag.server")


async def api_error(request: Request, error: APIError) -> JSONResponse:
    request.app.state.server.metrics.requests.labels(request.url.path, str(error.status)).inc()
    return JSONResponse(error.body(), error.status)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    kind = "not_found" if error.status_code == 404 else "method_not_allowed" if error.status_code == 405 else None
    body = APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", code=kind).body()
    return JSONResponse(body, error.status_code, headers=error.headers)  # a 405's Allow


async def server_error(request: Request, error: Exception) -> JSONResponse:
    log.exception("%s failed", request.url.path)
    body = APIError(500, f"internal error: {type(error).__name__}: {error}", type="server_error").body()
    return JSONResponse(body, 500)


HANDLERS = {APIError: api_error, HTTPException: http_error, Exception: server_error}
"""For ``FastAPI(exception_handlers=...)``."""
