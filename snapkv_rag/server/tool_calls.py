"""Tools through the OpenAI API. The engine does the calling (:mod:`snapkv_rag.request.tools`: a call is
decoded under the JSON schema of ``{"name": ..., "arguments": {...}}``); this module only
translates: the request's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and agent-loop
messages in, OpenAI's ``message.tool_calls`` and streamed ``delta.tool_calls`` out.

``parallel_tool_calls`` is accepted either way and changes nothing: the engine decodes at most one
call per turn, which is what ``false`` asks for and what ``true`` allows (an agent loop makes its
next call in the next turn)."""

from __future__ import annotations

import json
import re
import uuid

from ..request.tools import ToolPlan, normalise_tool_calls
from .errors import APIError, bad, typed

# the start of a call as the engine decodes it (properties in schema order, xgrammar's separators)
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def parse_tools(body: dict, last_role: str) -> tuple[dict, ToolPlan | None]:
    """The engine options for the request's tools (``{}`` without them) and the engine's plan for
    them; a bad ``tools`` or ``tool_choice`` is a 400 naming the parameter (``tools[1].function.name``)."""
    typed(body, "parallel_tool_calls", (bool,), "a boolean")
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and choice is None:
        return {}, None
    try:
        plan = ToolPlan.of(tools, choice, last_role)
    except (TypeError, ValueError) as error:
        name = str(error).split(":")[0]
        raise APIError(400, str(error), param=name, code="invalid_value") from None
    if plan.choice == "required" and not plan.tools:
        raise bad("tool_choice", "'required' needs at least one tool in tools")
    return {"tools": tools, "tool_choice": choice}, plan


def loop_message(message: dict, i: int, content: str | None, calls_by_id: dict[str, str]) -> dict:
    """One agent-loop message for the engine: an assistant message with its ``tool_calls``
    (recorded in ``calls_by_id`` to name the results), or a ``tool`` message with its
    ``tool_call_id`` and the name of the call it answers."""
    if message["role"] == "assistant":
        try:
            calls = normalise_tool_calls(message["tool_calls"], f"messages[{i}]")
        except ValueError as error:
            raise APIError(400, str(error), param=f"messages[{i}].tool_calls", code="invalid_value") from None
        calls_by_id.update((c["id"], c["name"]) for c in calls)
        return {"role": "assistant", "content": content or "", "tool_calls": calls}
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers", "missing")
    if message.get("name") is not None and not isinstance(message["name"], str):
        raise bad(f"messages[{i}].name", "expected the name of the tool as a string", "invalid_type")
    name = message.get("name") or calls_by_id.get(call_id)
    return {"role": "tool", "content": content or "", "tool_call_id": call_id, **({"name": name} if name else {})}


def openai_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def message(result, plan: ToolPlan | None) -> dict:
    """The assistant message of a chat response: its tool calls, or its text. A call cut short
    (``max_tokens``) comes as far as it got once its name is complete, as in the stream."""
    if result.tool_calls:
        calls = [
            openai_call(c["id"], c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in result.tool_calls
        ]
        return {"role": "assistant", "content": None, "tool_calls": calls}
    if plan is not None and plan.call:
        stream = CallStream()
        deltas = stream.feed(result.text)
        if stream.name is not None:
            arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [openai_call(stream.id, stream.name, arguments)],
            }
    return {"role": "assistant", "content": result.text}


class CallStream:
    """The text of one streamed call turned into OpenAI's ``delta.tool_calls`` pieces: the call's
    id and name once the name is decoded, then the arguments' JSON as it comes (the object's
    closing brace is not part of them)."""

    def __init__(self) -> None:
        self.id = f"call_{uuid.uuid4().hex[:24]}"
        self.text, self.name = "", None
        self.start = self.scanned = 0  # where the arguments begin, and how far they are sent
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        deltas = []
        if self.name is None:
            head = _HEAD.match(self.text)
            if head is None:
                return []
            self.name, self.start = json.loads(head.group(1)), head.end()
            self.scanned = self.start
            deltas.append({"tool_calls": [{"index": 0, **openai_call(self.id, self.name, "")}]})
        sent = self.scanned
        while self.scanned < len(self.text) and not self.done:
            char = self.text[self.scanned]
            self.scanned += 1
            if self.depth == 0 and char.isspace():  # before the arguments' "{": not part of them
                sent = self.scanned
            else:
                self._scan(char)
        if self.scanned > sent:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": self.text[sent : self.scanned]}}]})
        return deltas

    def _scan(self, char: str) -> None:
        """Track strings and nesting; the arguments end where their outermost ``}`` closes."""
        if self.in_string:
            self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            self.done = self.depth == 0


def stream_end(stream: CallStream, result) -> list[dict]:
    """What a call's stream still owes at its end: nothing when the call's head went out, else
    the text the model wrote (no call could be read from it)."""
    return [] if stream.name is not None else [{"content": result.text}] if result.text else []


def any_tools(body: dict) -> str | None:
    """The tool parameter a request gives, if any (for endpoints that take none)."""
    return next((name for name in ("tools", "tool_choice", "parallel_tool_calls") if body.get(name) is not None), None)
