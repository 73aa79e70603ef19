"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, and the checks on a
request field that raise it (shared by :mod:`.protocol` and :mod:`.tool_calls`)."""

from __future__ import annotations

import json
from typing import Any


class APIError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    """A 400 naming ``param``; the message starts with it."""
    return APIError(400, f"{param}: {message}", param=param, code=code)


def typed(body: dict, name: str, kinds: tuple, what: str) -> Any:
    """``body[name]`` when it is present and not null, checked against ``kinds`` (bools are not numbers)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad(name, f"expected {what}, got {json.dumps(value)[:60]}", "invalid_type")
    return value
