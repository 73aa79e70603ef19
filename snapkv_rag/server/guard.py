"""The checks that must come before a route reads the request body, as ASGI middleware rather
than FastAPI dependencies (a dependency runs after routing and cannot stop a body being read):
the bearer key and the body size limit."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from .errors import APIError
from .protocol import ServerSettings


def _too_large(limit: int, size: int | None = None) -> APIError:
    what = f"the request body ({size} bytes)" if size is not None else "the request body"
    return APIError(
        413,
        f"{what} is over this server's limit of {limit} bytes; --max-body-bytes sets the limit",
        code="request_too_large",
    )


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
        if self.key is not None and scope["path"] != "/health" and not self.authorized(headers):
            error = APIError(401, "a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key")
            return await JSONResponse(error.body(), 401)(scope, receive, send)
        limit = self.settings.max_body_bytes
        length = headers.get(b"content-length", b"0").strip()
        if not length.isdigit():
            error = APIError(400, "the Content-Length header is not a number of bytes", code="invalid_request")
            return await JSONResponse(error.body(), 400)(scope, receive, send)
        if int(length) > limit:
            return await JSONResponse(_too_large(limit, int(length)).body(), 413)(scope, receive, send)
        seen = 0

        async def counted():  # a chunked body has no Content-Length: count what arrives
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large(limit)
            return message

        return await self.app(scope, counted, send)

    def authorized(self, headers: dict) -> bool:
        """Whether ``Authorization: Bearer <key>`` names this server's key (compared in constant time)."""
        given = headers.get(b"authorization", b"")
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(token, self.key)
