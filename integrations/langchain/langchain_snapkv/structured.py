"""Tools and structured output for ``ChatSnapKV``: LangChain's shapes to the engine's and back.

The engine decodes a tool call, or a structured answer, constrained to a JSON schema, so that it
always parses (see :mod:`snapkv_rag.request.tools`); this module only translates schemas, tool calls
and parsers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from snapkv_rag.request.tools import check_tool_choice, check_tools

METHODS = ("json_schema", "json_mode", "function_calling")


def engine_tools(tools: Sequence[Any], tool_choice: Any) -> tuple[list[dict], str | None]:
    """LangChain tools (``BaseTool``, functions, pydantic classes, TypedDicts, OpenAI dicts) as the
    engine's function dicts, and ``tool_choice`` checked (``True``: a call to the one tool)."""
    formatted = check_tools([convert_to_openai_tool(t) for t in tools])
    if tool_choice is True:
        if len(formatted) != 1:
            raise ValueError(f"tool_choice: True needs exactly one tool, got {len(formatted)}")
        tool_choice = formatted[0]["function"]["name"]
    if tool_choice is False:
        tool_choice = "none"
    return formatted, None if tool_choice is None else check_tool_choice(tool_choice, formatted)


def ai_message(result: Any, expects_call: bool, **fields: Any) -> AIMessage:
    """The ``AIMessage`` of an engine result: its tool call, or its text (and an invalid tool call
    when a call was asked for but cut short, e.g. by ``max_tokens``)."""
    calls = [tool_call(name=c["name"], args=c["arguments"], id=c["id"]) for c in result.tool_calls]
    if calls:
        return AIMessage(content="", tool_calls=calls, **fields)
    invalid = [
        invalid_tool_call(
            name=None,
            args=result.text,
            id=None,
            error=f"the call did not complete (finish_reason {result.finish_reason!r})",
        )
    ]
    return AIMessage(content=result.text, invalid_tool_calls=invalid if expects_call else [], **fields)


def call_chunk(result: Any) -> AIMessageChunk | None:
    """The streamed tool call, as one chunk at the end of the stream (``None`` without a call)."""
    if not result.tool_calls:
        return None
    return AIMessageChunk(
        content="",
        tool_call_chunks=[
            tool_call_chunk(name=c["name"], args=json.dumps(c["arguments"], ensure_ascii=False), id=c["id"], index=i)
            for i, c in enumerate(result.tool_calls)
        ],
    )


def structured_runnable(model: Any, schema: Any, method: str, include_raw: bool, kwargs: dict) -> Runnable:
    """``model.with_structured_output(schema, method=..., include_raw=...)``."""
    if kwargs:
        raise TypeError(f"with_structured_output: unexpected argument(s) {', '.join(sorted(kwargs))}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if schema is None and method != "json_mode":
        raise ValueError(f"schema: required with method={method!r} (only json_mode takes None)")
    pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    json_schema = None if schema is None else convert_to_json_schema(schema)
    traced = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": json_schema}}
    if method == "function_calling":
        tools, _ = engine_tools([schema], None)
        name = tools[0]["function"]["name"]
        llm = model.bind_tools([schema], tool_choice=name, **traced)
        parser: Runnable = (
            PydanticToolsParser(tools=[schema], first_tool_only=True)
            if pydantic
            else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        )
    else:
        response_format = {"type": "json_object"} if json_schema is None else json_schema
        llm = model.bind(response_format=response_format, **traced)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    failed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")
