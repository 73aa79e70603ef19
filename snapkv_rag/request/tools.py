"""Tool calling: OpenAI-style function tools, the messages of an agent loop, and calls decoded
under a JSON schema so that they always parse.

A tool is ``{"type": "function", "function": {"name", "description", "parameters"}}``. A call is
decoded constrained to the schema of ONE call, ``{"name": <one of the tool names>, "arguments":
<that tool's parameters schema>}``, and comes back as ``{"id", "name", "arguments"}``.

``tool_choice``:

- ``"required"`` (or ``"any"``): a call to one of the tools;
- a tool name (or ``{"type": "function", "function": {"name": ...}}``): a call to that tool;
- ``"none"``: a text answer (the tools are still shown to the model);
- ``"auto"`` (the default): a call, unless the last message is a tool result, then a text answer.
  A small model (the embedded 135M one) cannot judge on its own whether a tool is needed, and
  left to choose it never starts a call; this rule makes the usual agent loop (question -> call ->
  result -> answer) work with any model and always end.

Rendering: where the chat template has a tools section (it mentions ``tools``), the tools,
assistant tool calls and tool results go through it (``apply_chat_template(..., tools=...)``).
Otherwise (the embedded SmolLM2's template ignores tools) they are written as text, see
:func:`render_without_tool_section`: the tools as JSON lines in the system message, each earlier
call as its JSON in the assistant message, and tool results as a user message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHOICES = ("auto", "required", "any", "none")
TOOLS_PREAMBLE = (
    "You can call the tools below. To call one, reply with only a JSON object "
    '{"name": <tool name>, "arguments": {<arguments>}}. Tools:'
)
ANSWER_FROM_RESULTS = "Answer the question in words using this result: "


def check_tools(tools: Any) -> list[dict]:
    """OpenAI-style function tools, validated; each ``parameters`` defaults to an empty object."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(
            f"tools: expected a list of {{'type': 'function', 'function': {{...}}}} dicts, got {type(tools).__name__}"
        )
    checked = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise ValueError(
                f"tools[{i}]: expected {{'type': 'function', 'function': {{'name', 'description', "
                f"'parameters'}}}}, got {tool!r}"
            )
        name, parameters = function.get("name"), function.get("parameters")
        if parameters is None or parameters == {}:  # none given: an object (false, 0 or "" are refused)
            parameters = {"type": "object", "properties": {}}
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name: expected a non-empty str, got {name!r}")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ValueError(f"tools[{i}].function.description: expected a str, got {function['description']!r}")
        if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
            raise ValueError(f"tools[{i}].function.parameters: expected a JSON schema of an object, got {parameters!r}")
        checked.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": function.get("description") or "",
                    "parameters": dict(parameters),
                },
            }
        )
    return checked


def check_tool_choice(tool_choice: Any, tools: list[dict]) -> str:
    """``"auto"``, ``"required"``, ``"none"`` or the name of one of ``tools``."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, Mapping):
        tool_choice = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
    names = [t["function"]["name"] for t in tools]
    if tool_choice in CHOICES:
        return "required" if tool_choice == "any" else tool_choice
    if tool_choice in names:
        return tool_choice
    raise ValueError(
        f"tool_choice: expected one of {CHOICES}, a tool name ({', '.join(names) or 'no tools given'}) "
        f"or {{'type': 'function', 'function': {{'name': ...}}}}; got {tool_choice!r}"
    )


def call_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call to one of ``tools``: its name, and its arguments."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t["function"]["name"]]}, "arguments": t["function"]["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


@dataclass(frozen=True)
class ToolPlan:
    """What one request does with its tools: ``call`` is the tools a call is constrained to
    (empty: a text answer)."""

    tools: list[dict]
    choice: str
    call: tuple[str, ...]

    @classmethod
    def of(cls, tools: Any, tool_choice: Any, last_role: str) -> ToolPlan | None:
        """The plan for ``tools`` and ``tool_choice`` when the conversation's last message has
        ``last_role``; ``None`` without tools."""
        if tools is None:
            if tool_choice is not None:
                raise ValueError("tool_choice: given without tools")
            return None
        tools = check_tools(tools)
        choice = check_tool_choice(tool_choice, tools)
        if choice == "none" or not tools or (choice == "auto" and last_role == "tool"):
            return cls(tools, choice, ())
        names = tuple(t["function"]["name"] for t in tools)
        return cls(tools, choice, names if choice in ("auto", "required") else (choice,))

    @property
    def shown(self) -> list[dict]:
        """The tools the prompt lists: none when the model is to answer from a tool result (shown
        them, the embedded model writes the call's JSON again instead of an answer)."""
        return self.tools if self.call or self.choice == "none" else []

    @property
    def response_format(self) -> dict | None:
        """The engine's ``response_format`` for this request (``None``: a text answer)."""
        if not self.call:
            return None
        return call_schema([t for t in self.tools if t["function"]["name"] in self.call])

    def calls(self, text: str) -> list[dict]:
        """The call decoded in ``text``, as ``[{"id", "name", "arguments"}]``; ``[]`` when no call
        was asked for or the text is not a whole call (cut by ``max_new_tokens``)."""
        if not self.call:
            return []
        try:
            call = json.loads(text)
        except ValueError:
            return []
        if (
            not isinstance(call, dict)
            or call.get("name") not in self.call
            or not isinstance(call.get("arguments"), dict)
        ):
            return []
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "name": call["name"], "arguments": call["arguments"]}]


def normalise_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` (OpenAI's ``{"id", "function": {"name", "arguments"}}``
    with arguments as JSON text or a dict, or ``{"id", "name", "arguments"}``) as
    ``[{"id", "name", "arguments": dict}]``."""
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise ValueError(f"{where}.tool_calls: expected a list of calls, got {type(calls).__name__}")
    out = []
    for i, call in enumerate(calls):
        body = call.get("function", call) if isinstance(call, Mapping) else None
        name = body.get("name") if isinstance(body, Mapping) else None
        arguments = body.get("arguments", {}) if isinstance(body, Mapping) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise ValueError(
                f"{where}.tool_calls[{i}]: expected {{'id', 'name', 'arguments'}} with arguments as a "
                f"dict or JSON object text, got {call!r}"
            )
        out.append({"id": str(call.get("id") or f"call_{i}"), "name": name, "arguments": arguments})
    return out


def has_tool_section(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (else they go in as text)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def for_template(messages: list[dict]) -> list[dict]:
    """Messages in the shape Hugging Face chat templates with a tools section expect."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": m["content"], "tool_calls": calls})
        else:
            out.append(dict(m))
    return out


def render_without_tool_section(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Plain role/content messages for a template without a tools section: the tools as JSON
    lines after :data:`TOOLS_PREAMBLE` at the end of the system message (one is added first if
    there is none), each earlier call as its JSON on its own line of the assistant message, and
    each run of tool results as one user message ``Tool result (name, id): content``; when the
    results are last, that message ends by asking again for an answer to the last question
    (:data:`ANSWER_FROM_RESULTS`), which a small model otherwise answers with another call's JSON."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            line = f"Tool result ({m.get('name') or 'tool'}, {m.get('tool_call_id') or '-'}): {m['content']}"
            if out and out[-1].get("from_tool"):
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "from_tool": True})
        elif m.get("tool_calls"):
            lines = [json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([m["content"], *lines] if m["content"] else lines)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if messages[-1]["role"] == "tool":
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        out[-1]["content"] += f"\n{ANSWER_FROM_RESULTS}{question}"
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        listing = "\n".join([TOOLS_PREAMBLE, *(json.dumps(t["function"]) for t in tools)])
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out
