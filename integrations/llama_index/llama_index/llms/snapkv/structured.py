"""Structured output and function calling for ``SnapKVLLM``: LlamaIndex's shapes to the engine's.

``structured_predict`` and friends decode the answer under the output class's JSON schema (the
engine's ``response_format``), so it always parses: no prompt-and-parse program. Tool calls are
decoded under the schema of one call (see :mod:`snapkv_rag.request.tools`) and come back as
``ToolCallBlock``s of the assistant message (also in ``additional_kwargs["tool_calls"]``, OpenAI's
shape), which :func:`tool_selections` reads back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.program.utils import FlexibleModel, create_flexible_model
from pydantic import BaseModel
from pydantic_core import from_json

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.TOOL: "tool",
}


def check_output_cls(output_cls: Any) -> type[BaseModel]:
    if not (isinstance(output_cls, type) and issubclass(output_cls, BaseModel)):
        raise TypeError(f"output_cls: expected a pydantic model class, got {output_cls!r}")
    return output_cls


def partial_objects(output_cls: type[BaseModel], pieces: Iterator[str]) -> Iterator[BaseModel | FlexibleModel]:
    """As the JSON text grows: the object so far (a flexible copy of ``output_cls`` with the fields
    decoded yet), each time it changes; the last one is a validated ``output_cls``."""
    flexible = create_flexible_model(output_cls)
    text, last = "", None
    for piece in pieces:
        text += piece
        try:
            data = from_json(text, allow_partial=True)
        except ValueError:
            continue
        if isinstance(data, dict) and data != last:
            last = data
            yield flexible.model_validate(data)
    yield output_cls.model_validate_json(text)


def engine_tools(tools: Sequence[Any]) -> list[dict]:
    """LlamaIndex tools (``BaseTool``: ``FunctionTool``, ``QueryEngineTool``, ...) as function dicts."""
    return [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Role/content dicts for the engine: system, user, assistant (with its tool calls, from
    ``ToolCallBlock``s or ``additional_kwargs["tool_calls"]``) and tool messages (with
    ``additional_kwargs["tool_call_id"]``)."""
    converted = []
    for index, message in enumerate(messages):
        if message.role not in _ROLES:
            raise ValueError(
                f"messages[{index}]: role {message.role.value!r} is not supported; "
                "SnapKVLLM takes system, user, assistant and tool messages"
            )
        texts, calls = [], []
        for block in message.blocks:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolCallBlock) and message.role == MessageRole.ASSISTANT:
                calls.append({"id": block.tool_call_id, "name": block.tool_name, "arguments": block.tool_kwargs})
            else:
                raise ValueError(
                    f"messages[{index}]: {type(block).__name__} content is not supported (text, and "
                    "tool calls in assistant messages)"
                )
        item: dict[str, Any] = {"role": _ROLES[message.role], "content": "".join(texts)}
        calls = calls or message.additional_kwargs.get("tool_calls") or []
        if calls and message.role == MessageRole.ASSISTANT:
            item["tool_calls"] = calls
        if message.role == MessageRole.TOOL:
            item.update(
                {
                    k: message.additional_kwargs[k]
                    for k in ("tool_call_id", "name")
                    if message.additional_kwargs.get(k) is not None
                }
            )
        converted.append(item)
    return converted


def assistant_message(text: str, tool_calls: list[dict]) -> ChatMessage:
    """The assistant's message: its text, or its tool calls (as blocks and OpenAI-style kwargs)."""
    if not tool_calls:
        return ChatMessage(role=MessageRole.ASSISTANT, content=text)
    blocks = [ToolCallBlock(tool_call_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]) for c in tool_calls]
    openai = [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for c in tool_calls
    ]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs={"tool_calls": openai})


def tool_selections(message: ChatMessage, error_on_no_tool_call: bool) -> list[ToolSelection]:
    selections = [
        ToolSelection(tool_id=b.tool_call_id or "", tool_name=b.tool_name, tool_kwargs=b.tool_kwargs)
        for b in message.blocks
        if isinstance(b, ToolCallBlock)
    ]
    if not selections and error_on_no_tool_call:
        raise ValueError(f"expected a tool call in the response, got text: {message.content!r}")
    return selections
