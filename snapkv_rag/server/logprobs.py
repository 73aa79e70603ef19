"""``n`` and ``logprobs`` through the OpenAI API: the request fields in, OpenAI's shapes out.

Chat: ``logprobs: true`` and ``top_logprobs: k`` (0..20) give ``choice.logprobs.content``, one
``{"token", "logprob", "bytes", "top_logprobs": [...]}`` per token. Completions: ``logprobs: k``
(0..20) gives the legacy ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``, offsets counted in characters from the start of the choice's text. A streamed
chunk carries the entries of the tokens its text completes (a chunk may have empty text and
entries only); concatenated, they are the plain response's."""

from __future__ import annotations

from ..config import MAX_LOGPROBS, MAX_N
from .errors import bad, typed


def parse(body: dict, kind: str) -> dict:
    """The engine options for ``n``, ``logprobs`` and ``top_logprobs`` (``{}`` without them)."""
    options = {}
    n = typed(body, "n", (int,), "an integer")
    if n is not None:
        if not 1 <= n <= MAX_N:
            raise bad("n", f"must be from 1 to {MAX_N}, got {n}")
        options["n"] = n
    if kind == "chat":
        wanted = typed(body, "logprobs", (bool,), "a boolean")
        k = typed(body, "top_logprobs", (int,), "an integer")
        if k is not None and not wanted:
            raise bad("top_logprobs", "needs logprobs: true")
        name = "top_logprobs"
    else:
        wanted = k = typed(body, "logprobs", (int,), "an integer")
        name = "logprobs"
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad(name, f"must be from 0 to {MAX_LOGPROBS}, got {k}")
    if wanted is not None and wanted is not False:
        options["logprobs"] = k or 0
    return options


def _top(entry) -> dict:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes}


def chat(entries: list | None) -> dict | None:
    """``choice.logprobs`` of a chat response or chunk (``None`` without logprobs)."""
    if entries is None:
        return None
    return {
        "content": [{**_top(e), "top_logprobs": [_top(t) for t in e.top_logprobs]} for e in entries],
        "refusal": None,
    }


def completion(entries: list | None, offset: int = 0) -> dict | None:
    """``choice.logprobs`` of a completion (or of a chunk whose text starts at ``offset``)."""
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }


def of(kind: str, entries: list | None, offset: int = 0) -> dict | None:
    return chat(entries) if kind == "chat" else completion(entries, offset)
