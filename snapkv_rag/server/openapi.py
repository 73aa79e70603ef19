"""``GET /openapi.json``: the server's OpenAPI 3.1 schema, written to what the routes really take
and give, so that a schema-driven fuzzer (the tests run schemathesis over it) or a generated client
sees this server, not a generic OpenAI one.

The routes parse their bodies themselves (:mod:`.protocol`: OpenAI's error shape, the field named in
each 400), so the request models here are the schema only: they state the same rules (types,
ranges, the one model id served, ``--max-documents``), and what a schema cannot state (the context
window, ``--max-prompt-tokens``, a method's own settings, tools that must name each other) is a 400
from the server. Unknown fields are ignored, as OpenAI's API ignores them, so the bodies allow
additional properties. Responses: the JSON bodies (``chat.completion``, ``text_completion``, the
model list, ``/health``), SSE for ``"stream": true``, and the error body of every 4xx and 5xx.

With an API key (``--api-key``) the schema itself needs the key, as every path but ``/health``
does: it says which limits and methods the server has. The schema declares the bearer scheme, and
``/health`` needs none.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING
from dataclasses import fields as fields_of
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..config import MAX_LOGPROBS, MAX_N
from ..methods import METHODS, SnapKVConfig
from .protocol import PER_REQUEST, ServerSettings, snapkv_fields

REF = "#/components/schemas/{model}"


class _Open(BaseModel):
    """A body that may carry fields the server ignores (as OpenAI's does)."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Open):
    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], Field(description="a string, or text parts")]


class DocumentObject(_Open):
    text: str
    title: str | None = None
    id: Any = Field(None, description="any JSON value, returned as a string in cited_documents")


Document = str | DocumentObject


class PlainMessage(_Open):
    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    documents: list[Document] | None = None


class FunctionCall(_Open):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class AssistantCallMessage(_Open):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] = Field(min_length=1)
    documents: list[Document] | None = None


class ToolMessage(_Open):
    role: Literal["tool"]
    content: Content | None = None
    tool_call_id: str = Field(min_length=1)
    name: str | None = None
    documents: list[Document] | None = None


class Function(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="the JSON schema of an object")


class Tool(_Open):
    type: Literal["function"]
    function: Function


class NamedFunction(_Open):
    name: str


class NamedTool(_Open):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Open):
    include_usage: bool | None = None


class JSONSchemaFormat(_Open):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the answer follows")
    strict: bool | None = None


class TextFormat(_Open):
    type: Literal["text", "json_object"]


class SchemaFormat(_Open):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


_PYTHON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def _setting_schema(annotation) -> dict:
    """A method setting's JSON schema from its dataclass annotation (any value when it has no plain type)."""
    if typing.get_origin(annotation) is Literal:
        return {"enum": list(typing.get_args(annotation))}
    args = typing.get_args(annotation) or (annotation,)
    literal = [a for a in args if typing.get_origin(a) is Literal]
    if literal:
        values = [v for a in literal for v in typing.get_args(a)]
        return {"enum": values + ([None] if type(None) in args else [])}
    found = {_PYTHON_TYPES[a] for a in args if a in _PYTHON_TYPES}
    if float in args:
        found.add("integer")
    if not found:
        return {}
    if type(None) in args:
        found.add("null")
    return {"type": sorted(found)}


def snapkv_schema() -> dict:
    """The ``snapkv`` field: ``true``, ``false``, or an object of method settings (unknown ones are a 400)."""
    properties: dict[str, dict] = {
        "method": {"enum": list(METHODS)},
        "budget": {
            "anyOf": [{"type": "integer"}, {"type": "string", "pattern": "%$"}],
            "description": 'tokens (512) or a share of the prompt ("50%")',
        },
    }
    for cls in (SnapKVConfig, *METHODS.values()):
        hints = typing.get_type_hints(cls)
        for f in fields_of(cls):
            if f.name in PER_REQUEST or f.name in properties or f.name not in snapkv_fields():
                continue
            schema = _setting_schema(hints.get(f.name, f.type))
            if f.default is not MISSING and f.default is None:
                schema = {**schema, "type": sorted({*schema.get("type", []), "null"})} if schema else {}
            properties[f.name] = schema
    return {
        "anyOf": [
            {"type": "boolean"},
            {
                "type": "object",
                "properties": properties,
                "additionalProperties": False,
                "description": "settings of the compression method; a setting the method lacks is a 400",
            },
            {"type": "null"},
        ]
    }


class _Request(_Open):
    model: str
    documents: list[Document] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    ignore_eos: bool | None = None
    echo: Literal[False] | None = Field(None, description="true is not supported")
    presence_penalty: Literal[0] | None = Field(None, description="only 0 is supported")
    frequency_penalty: Literal[0] | None = Field(None, description="only 0 is supported")
    response_format: TextFormat | SchemaFormat | None = None
    snapkv: Any = None


class ChatRequest(_Request):
    messages: list[PlainMessage | AssistantCallMessage | ToolMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "required", "any", "none"] | str | NamedTool | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Request):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] = Field(
        description="one prompt (a list of one string is taken too); not blank"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None


class Extension(_Open):
    citations: list[int]
    cited_documents: list[dict[str, Any]]
    compression: dict[str, Any]
    timings: dict[str, Any]


class ResponseToolCall(_Open):
    id: str
    type: Literal["function"]
    function: dict[str, Any]


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    snapkv: Extension


class TextChoice(_Open):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class TextCompletion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    snapkv: Extension


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(_Open):
    error: ErrorDetail


class Model(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Open):
    object: Literal["list"]
    data: list[Model]


class Health(_Open):
    status: str
    in_flight: int | None = None


MODELS = (
    ChatRequest,
    CompletionRequest,
    ChatCompletion,
    TextCompletion,
    Error,
    ModelList,
    Health,
)

ERRORS = {
    "400": "bad input (the field is named in error.param), or a prompt over the context window or --max-prompt-tokens",
    "401": "no valid API key (Authorization: Bearer <key>) when the server has one",
    "404": "another model than the one served",
    "413": "a body over --max-body-bytes",
    "429": "more requests in flight than --max-batch + --max-queue, or more streams than --max-streams",
    "503": "the server is shutting down, or out of memory for this request",
}


def _json(name: str) -> dict:
    return {"application/json": {"schema": {"$ref": REF.format(model=name)}}}


def _errors(*codes: str) -> dict:
    return {code: {"description": ERRORS[code], "content": _json("Error")} for code in codes}


def _generation(request: str, response: str, summary: str) -> dict:
    events = {  # OpenAPI 3.1: the schema of each event
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "description": "a chunk's JSON, an error's, or [DONE] last"}},
    }
    return {
        "post": {
            "summary": summary,
            "operationId": request,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": "the answer (JSON), or its chunks as server-sent events with stream: true",
                    "content": {**_json(response), "text/event-stream": {"schema": events}},
                },
                **_errors("400", "401", "404", "413", "429", "503"),
            },
        }
    }


def schema(settings: ServerSettings) -> dict:
    """The OpenAPI document of an app with ``settings``."""
    from pydantic.json_schema import models_json_schema

    _, defs = models_json_schema([(m, "validation") for m in MODELS], ref_template=REF)
    components = _tailored(defs["$defs"], settings)
    document = {
        "openapi": "3.1.0",
        "info": {
            "title": "snapkv-rag",
            "version": _version(),
            "description": "OpenAI-compatible chat and completions over documents, with SnapKV compression",
        },
        "paths": _paths(),
        "components": {"schemas": components},
    }
    if settings.api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document


def _tailored(components: dict, settings: ServerSettings) -> dict:
    """The request bodies as this server checks them: its one model name, the ``snapkv`` options,
    at most ``--max-documents`` documents, and prompts that are not blank."""
    for name in ("ChatRequest", "CompletionRequest"):
        body = components[name]
        body["properties"]["model"] = {"type": "string", "enum": [settings.model_name], "description": "GET /v1/models"}
        body["properties"]["snapkv"] = snapkv_schema()
        documents = {
            "type": "array",
            "items": {"anyOf": [{"type": "string"}, {"$ref": REF.format(model="DocumentObject")}]},
            "maxItems": settings.max_documents,
            "description": "--max-documents, counted over the whole request",
        }
        body["properties"]["documents"] = {"anyOf": [documents, {"type": "null"}]}
    completion = components["CompletionRequest"]["properties"]["prompt"]
    completion["anyOf"][0]["pattern"] = r"\S"
    completion["anyOf"][1]["items"] = {"type": "string", "pattern": r"\S"}
    return components


def _paths() -> dict:
    """Each route's operation: the two generation routes, the model list, health and metrics."""
    models = {
        "summary": "the model served",
        "operationId": "models",
        "responses": {"200": {"description": "one model", "content": _json("ModelList")}, **_errors("401")},
    }
    health = {
        "summary": "liveness (no API key needed)",
        "operationId": "health",
        "security": [],
        "responses": {
            "200": {"description": "serving", "content": _json("Health")},
            "503": {"description": "shutting down", "content": _json("Health")},
        },
    }
    metrics = {
        "summary": "Prometheus metrics",
        "operationId": "metrics",
        "responses": {
            "200": {"description": "the metrics", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors("401"),
        },
    }
    return {
        "/v1/chat/completions": _generation("ChatRequest", "ChatCompletion", "a chat answer"),
        "/v1/completions": _generation("CompletionRequest", "TextCompletion", "a completion"),
        "/v1/models": {"get": models},
        "/health": {"get": health},
        "/metrics": {"get": metrics},
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("snapkv-rag")
    except Exception:  # not installed (a source tree)
        return "0"
