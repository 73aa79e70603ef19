"""OpenAI request bodies to engine calls, engine results to OpenAI response bodies: pure functions,
no web framework. Every bad input is an :class:`APIError` carrying OpenAI's error body
``{"error": {"message", "type", "param", "code"}}`` and a 4xx status."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as fields_of
from typing import Any

from ..methods import DEFAULT_COMPRESSION, METHODS, SnapKVConfig
from ..request.tools import ToolPlan
from . import logprobs, tool_calls
from .errors import APIError, bad, typed

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
PER_REQUEST = ("spans",)  # method fields bound by the engine per request, never sent
# OpenAI parameters this server cannot honour: refused by name rather than ignored in silence
UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix")
FORMATS = ("text", "json_object", "json_schema")  # response_format.type


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer needs to know besides the engine."""

    model_name: str
    api_key: str | None = None
    max_batch: int = 16
    max_queue: int = 64
    max_body_bytes: int = 4 * 2**20
    """``--max-body-bytes``: a larger request body gets 413."""
    max_documents: int = 64
    """``--max-documents``: more documents in one request get 400."""
    max_prompt_tokens: int | None = None
    """``--max-prompt-tokens``: a longer prompt (documents and tools included) gets 400; ``None``:
    only the model's context window bounds it."""
    max_streams: int = 64
    """``--max-streams``: more streamed responses open at once get 429 (``stream: true``)."""
    cors_origins: tuple[str, ...] = ()
    compression: SnapKVConfig | None = DEFAULT_COMPRESSION
    """The server's default compression (``None``: the full cache; by default the engine's default,
    :data:`~snapkv_rag.methods.DEFAULT_COMPRESSION`); per-request ``snapkv`` objects change fields of
    it (or of ``base_compression`` when it is ``None``)."""
    base_compression: SnapKVConfig = DEFAULT_COMPRESSION


@dataclass
class Call:
    """One parsed request: what to pass to ``llm.stream_result`` and how to answer."""

    kind: str  # "chat" or "completion"
    model: str
    prompt: str | list[dict]  # the question (completions) or the messages (chat)
    documents: list[dict]
    options: dict
    stream: bool = False
    include_usage: bool = False
    tools: ToolPlan | None = None
    """The engine's plan for the request's tools (``None`` without tools)."""


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not UTF-8 text: {error}", code="invalid_json") from None
    except json.JSONDecodeError as error:
        raise APIError(
            400,
            f"the request body is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise APIError(
            400, f"the request body must be a JSON object, got a JSON {type(body).__name__}", code="invalid_json"
        )
    return body


def _documents(items: Any, param: str, limit: int, already: int = 0) -> list[dict]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise bad(param, 'expected a list of {"title", "text"} objects or strings', "invalid_type")
    if already + len(items) > limit:
        raise bad(
            param,
            f"{already + len(items)} documents, more than this server takes ({limit}); --max-documents sets the limit",
            "too_many_documents",
        )
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"text": item}
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise bad(f"{param}[{i}]", 'expected {"title", "text"} with "text" a string, or a string', "invalid_type")
        if item.get("title") is not None and not isinstance(item["title"], str):
            raise bad(f"{param}[{i}].title", "expected a string", "invalid_type")
        out.append(item)
    return out


def _content(content: Any, param: str) -> str:
    """A message's content: a string, or OpenAI's list of ``{"type": "text", "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{param}[{i}]", 'only {"type": "text", "text": ...} parts are supported', "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(param, "expected a string or a list of text parts", "invalid_type")


def _messages(body: dict, limit: int, documents: list[dict]) -> list[dict]:
    """The conversation: system/developer, user and assistant messages, and an agent loop's
    assistant messages with ``tool_calls`` (``content`` may be null) and ``tool`` results."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad(
            "messages",
            'expected a non-empty list of {"role", "content"} objects',
            "invalid_type" if messages is not None else "missing",
        )
    out: list[dict] = []
    calls_by_id: dict[str, str] = {}
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", 'expected an object with "role" and "content"', "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(
                f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {json.dumps(role)}", "invalid_role"
            )
        documents.extend(_documents(message.get("documents"), f"messages[{i}].documents", limit, len(documents)))
        loop = role == "tool" or (role == "assistant" and message.get("tool_calls"))
        content = message.get("content")
        content = None if loop and content is None else _content(content, f"messages[{i}].content")
        out.append(
            tool_calls.loop_message(message, i, content, calls_by_id)
            if loop
            else {"role": ROLES[role], "content": content}
        )
    return out


def snapkv_fields() -> tuple[str, ...]:
    """The fields a request's ``snapkv`` object may hold: ``method``, ``budget`` and every setting of
    a registered method (:data:`snapkv_rag.methods.METHODS`), SnapKV's first."""
    names = ["method", "max_capacity_prompt", "ratio", "budget"]
    for cls in (SnapKVConfig, *METHODS.values()):
        names += [f.name for f in fields_of(cls) if f.name not in names and f.name not in PER_REQUEST]
    return tuple(names)


def _switch_method(name: Any, base):
    """``base`` (the server's compression) as method ``name``: the budget carries over, and the other
    settings the server changed from its method's defaults where the method has them; the rest are
    the method's own defaults."""
    if not isinstance(name, str) or name not in METHODS:
        raise bad("snapkv.method", f"must be one of {', '.join(METHODS)}, got {json.dumps(name)}")
    plain, target = type(base)(), {f.name for f in fields_of(METHODS[name])}
    carried = {
        f.name: getattr(base, f.name)
        for f in fields_of(base)
        if f.name in target
        and (f.name in ("max_capacity_prompt", "ratio") or getattr(base, f.name) != getattr(plain, f.name, None))
    }
    return METHODS[name](**carried)


def _budget_fields(fields: dict) -> dict:
    """``budget`` (tokens, or a share such as ``"50%"``) as ``max_capacity_prompt`` / ``ratio``; giving
    either clears the other."""
    budget = fields.pop("budget", None)
    if isinstance(budget, str) and budget.endswith("%"):
        try:
            fields["ratio"] = float(budget[:-1]) / 100
        except ValueError:
            raise bad("snapkv.budget", f'expected tokens (512) or a share ("50%"), got {budget!r}') from None
    elif budget is not None:
        fields["max_capacity_prompt"] = budget
    if [k for k in ("max_capacity_prompt", "ratio") if fields.get(k) is not None]:
        fields.setdefault("max_capacity_prompt", None)
        fields.setdefault("ratio", None)
    return fields


def _compression(value: Any, settings: ServerSettings) -> SnapKVConfig | bool | None:
    """``"snapkv": false`` (full cache), ``true`` (the server's compression), or an object of method
    settings (:func:`snapkv_fields`); ``budget`` takes tokens (512) or a share (``"50%"``); ``method``
    names any registered method (``"snapkv"``, ``"docsnapkv"``, ``"adasnapkv"``, ``"lookahead"``,
    ``"keynorm"``, ``"kvzip"``, ...); a setting the chosen method does not have is refused by name."""
    if value is None:
        return None
    if isinstance(value, bool):
        return (settings.compression or settings.base_compression) if value else False
    if not isinstance(value, dict):
        raise bad("snapkv", 'expected false, true or an object such as {"max_capacity_prompt": 512}', "invalid_type")
    known = snapkv_fields()
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise bad(f"snapkv.{unknown[0]}", f"unknown field; the fields are {', '.join(known)}", "unknown_field")
    fields = dict(value)
    base = settings.compression or settings.base_compression
    method = fields.pop("method", None)
    if method is not None:
        base = _switch_method(method, base)
    own = {f.name for f in fields_of(base)}
    for name in fields:
        if name != "budget" and name not in own:
            raise bad(f"snapkv.{name}", f"not a setting of method {base.method}", "unknown_field")
    try:
        return replace(base, **_budget_fields(fields))
    except (ValueError, TypeError) as error:
        name = str(error).split(":")[0]
        raise bad(f"snapkv.{name}" if name in known else "snapkv", str(error)) from None


def _options(body: dict, settings: ServerSettings) -> tuple[dict, bool, bool]:
    for name in UNSUPPORTED:
        if body.get(name):
            raise bad(name, "not supported by this server", "unsupported_parameter")
    if typed(body, "echo", (bool,), "a boolean"):
        raise bad("echo", "not supported by this server", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if typed(body, name, (int, float), "a number"):
            raise bad(name, "only 0 is supported", "unsupported_parameter")
    options: dict[str, Any] = {}
    tokens = typed(body, "max_completion_tokens", (int,), "an integer")
    tokens = typed(body, "max_tokens", (int,), "an integer") if tokens is None else tokens
    if tokens is not None:
        if tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {tokens}")
        options["max_new_tokens"] = tokens
    temperature = typed(body, "temperature", (int, float), "a number")
    if temperature is not None:
        if not 0 <= temperature <= 2:
            raise bad("temperature", f"must be between 0 and 2, got {temperature}")
        options["temperature"] = float(temperature)
    top_p = typed(body, "top_p", (int, float), "a number")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {top_p}")
        options["top_p"] = float(top_p)
    stop = typed(body, "stop", (str, list), "a string or a list of strings")
    if stop is not None:
        if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
            raise bad("stop", "expected a string or a list of strings", "invalid_type")
        options["stop"] = stop
    seed = typed(body, "seed", (int,), "an integer")
    if seed is not None:
        options["seed"] = seed
    if typed(body, "ignore_eos", (bool,), "a boolean"):
        options["ignore_eos"] = True
    response_format = typed(body, "response_format", (dict,), "an object")
    if response_format is not None:
        kind = response_format.get("type")
        if kind not in FORMATS:
            raise bad("response_format.type", f"must be one of {', '.join(FORMATS)}, got {json.dumps(kind)}")
        inner = response_format.get("json_schema") if kind == "json_schema" else None
        for name, kind_, what in (("name", str, "a string"), ("strict", bool, "a boolean")):
            if isinstance(inner, dict) and inner.get(name) is not None and not isinstance(inner[name], kind_):
                raise bad(f"response_format.json_schema.{name}", f"expected {what}", "invalid_type")
        if kind != "text":
            options["response_format"] = response_format
    compression = _compression(body.get("snapkv"), settings)
    if compression is not None:
        options["snapkv"] = compression
    stream = bool(typed(body, "stream", (bool,), "a boolean"))
    stream_options = typed(body, "stream_options", (dict,), "an object") or {}
    include_usage = typed(stream_options, "include_usage", (bool,), "a boolean")
    if stream_options and not stream:
        raise bad("stream_options", "only allowed with stream: true")
    return options, stream, bool(include_usage)


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad(
            "model",
            "expected the model's id as a string (GET /v1/models lists it)",
            "missing" if model is None else "invalid_type",
        )
    return model


def parse_chat(body: dict, settings: ServerSettings) -> Call:
    """``POST /v1/chat/completions``: documents from the top-level ``documents`` list (vLLM's field)
    and from a ``documents`` list on any message, in that order."""
    documents = _documents(body.get("documents"), "documents", settings.max_documents)
    messages = _messages(body, settings.max_documents, documents)
    options, stream, usage = _options(body, settings)
    tool_options, plan = tool_calls.parse_tools(body, messages[-1]["role"])
    options.update(logprobs.parse(body, "chat"))
    return Call("chat", _model(body), messages, documents, {**options, **tool_options}, stream, usage, plan)


def parse_completion(body: dict, settings: ServerSettings) -> Call:
    """``POST /v1/completions``: the prompt is the question of one user turn (chat template applied)."""
    documents = _documents(body.get("documents"), "documents", settings.max_documents)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "expected one prompt as a string", "invalid_type" if prompt is not None else "missing")
    if not prompt.strip():
        raise bad("prompt", "must not be empty")
    given = tool_calls.any_tools(body)
    if given:
        raise bad(given, "only on /v1/chat/completions", "unsupported_parameter")
    options, stream, usage = _options(body, settings)
    options.update(logprobs.parse(body, "completion"))
    return Call("completion", _model(body), prompt, documents, options, stream, usage)


# ---------------------------------------------------------------------------------- responses
def usage(result) -> dict:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def extension(result) -> dict:
    """The ``snapkv`` field of a response: citations, the cited documents and the compression figures."""
    return {
        "citations": result.citations,
        "cited_documents": [
            {"number": n, "title": result.documents[n - 1].title, "id": result.documents[n - 1].id}
            for n in result.citations
        ],
        "compression": asdict(result.compression),
        "timings": {"prefill_s": result.timings.prefill_s, "decode_ms_per_token": result.timings.decode_ms_per_token},
    }


def response(call: Call, call_id: str, created: int, result) -> dict:
    """The response body: one choice per answer (``n``), ``usage`` with the prompt counted once."""
    choices = []
    for index, answer in enumerate(result.choices or [result]):
        content = {"message": tool_calls.message(answer, call.tools)} if call.kind == "chat" else {"text": answer.text}
        choices.append(
            {
                "index": index,
                **content,
                "finish_reason": answer.finish_reason,
                "logprobs": logprobs.of(call.kind, answer.logprobs),
            }
        )
    kind = "chat.completion" if call.kind == "chat" else "text_completion"
    return {
        "id": call_id,
        "object": kind,
        "created": created,
        "model": call.model,
        "choices": choices,
        "usage": usage(result),
        "snapkv": extension(result),
    }


def chunk(
    call: Call,
    call_id: str,
    created: int,
    piece: str | dict | None = None,
    result=None,
    role: bool = False,
    index: int = 0,
    entries: dict | None = None,
) -> dict:
    """One streamed event of choice ``index``: a text piece (or a chat ``delta``, such as a tool
    call's) with its tokens' logprobs (``entries``, shaped by :mod:`.logprobs`), the opening role
    (chat), or the closing finish reason (``result`` given; it carries the ``snapkv`` field)."""
    reason = result.finish_reason if result is not None else None
    if call.kind == "chat":
        delta = (
            {"role": "assistant", "content": ""}
            if role
            else {}
            if piece is None
            else piece
            if isinstance(piece, dict)
            else {"content": piece}
        )
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": entries}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": piece or "", "finish_reason": reason, "logprobs": entries}
        kind = "text_completion"
    event = {"id": call_id, "object": kind, "created": created, "model": call.model, "choices": [choice]}
    if call.include_usage:
        event["usage"] = None
    if result is not None:
        event["snapkv"] = extension(result)
    return event


def usage_chunk(call: Call, call_id: str, created: int, result) -> dict:
    kind = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
    return {
        "id": call_id,
        "object": kind,
        "created": created,
        "model": call.model,
        "choices": [],
        "usage": usage(result),
    }
