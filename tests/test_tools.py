"""Tool calling in the engine: tools and agent-loop messages rendered through the chat template (or
as text where the template has no tools section), tool_choice, and calls decoded under the schema
of a call, so that even a random-weight model's call parses and names a bound tool."""

from __future__ import annotations

import json

import pytest

from snapkv_rag.request.text import encode_request
from snapkv_rag.request.tools import ANSWER_FROM_RESULTS, TOOLS_PREAMBLE, ToolPlan, check_tools

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
LOOP = [
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    },
    {"role": "tool", "content": "5", "tool_call_id": "call_1", "name": "add"},
]


def test_template_without_tools_section_gets_tools_calls_and_results_as_text(tokenizer):
    text = encode_request(tokenizer, LOOP, None, "", check_tools([ADD])).text
    system = text[: text.index("<|im_start|>user")]
    assert TOOLS_PREAMBLE in system and json.dumps(ADD["function"]) in system
    assert '<|im_start|>assistant\n{"name": "add", "arguments": {"a": 2, "b": 3}}<|im_end|>' in text
    assert f"<|im_start|>user\nTool result (add, call_1): 5\n{ANSWER_FROM_RESULTS}What is 2 + 3?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_with_tools_section_renders_through_the_template(tokenizer):
    templated = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    templated.chat_template = (
        "{% if tools %}TOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}CALL "
        "{{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}"
        "{% endif %}{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}assistant:"
    )
    text = encode_request(templated, LOOP, None, "", check_tools([ADD, WEATHER])).text
    assert text.startswith("TOOLS add get_weather")  # (the template's newlines are trimmed after tags)
    assert 'assistant:CALL add {"a": 2, "b": 3}' in text and "tool:5 (call_1)" in text
    assert TOOLS_PREAMBLE not in text


@pytest.mark.parametrize(
    "tools, choice, error",
    [
        ("add", None, "tools: expected a list"),
        ([{"type": "function", "function": {"description": "no name"}}], None, r"tools\[0\].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            r"tools\[0\].function.parameters: expected a JSON schema of an object",
        ),
        ([ADD], "subtract", "tool_choice: expected one of"),
        (None, "required", "tool_choice: given without tools"),
    ],
)
def test_bad_tools_and_tool_choice_are_named(tools, choice, error):
    with pytest.raises((TypeError, ValueError), match=error):
        ToolPlan.of(tools, choice, "user")


def test_tool_choice_plans():
    assert ToolPlan.of([ADD, WEATHER], "any", "user").call == ("add", "get_weather")
    assert ToolPlan.of([ADD, WEATHER], {"type": "function", "function": {"name": "add"}}, "user").call == ("add",)
    assert ToolPlan.of([ADD], "none", "user").response_format is None
    assert ToolPlan.of([ADD], "auto", "user").call == ("add",)
    assert ToolPlan.of([ADD], "auto", "tool").call == ()  # after a tool result: the answer
    assert ToolPlan.of([ADD], "auto", "tool").shown == [] and ToolPlan.of([ADD], "none", "tool").shown
    assert ToolPlan.of([ADD], "required", "tool").call == ("add",)


@pytest.mark.parametrize("choice, names", [("required", {"add", "get_weather"}), ("get_weather", {"get_weather"})])
def test_a_call_always_parses_and_names_a_bound_tool(tiny_engine, choice, names):
    result = tiny_engine.chat(
        [{"role": "user", "content": "Weather in Rome?"}], tools=[ADD, WEATHER], tool_choice=choice, max_new_tokens=40
    )
    assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1
    call = result.tool_calls[0]
    assert call["name"] in names and call["id"].startswith("call_")
    if call["name"] == "get_weather":
        assert call["arguments"]["city"] in ("Paris", "Rome")
    else:
        assert set(call["arguments"]) == {"a", "b"} and all(isinstance(v, int) for v in call["arguments"].values())
    assert json.loads(result.text) == {"name": call["name"], "arguments": call["arguments"]}


def test_after_a_tool_result_auto_answers_in_text(tiny_engine):
    result = tiny_engine.chat(LOOP, tools=[ADD], max_new_tokens=6)
    assert result.tool_calls == [] and result.finish_reason != "tool_calls"
    streamed = list(tiny_engine.stream_result(LOOP, tools=[ADD], max_new_tokens=6))
    assert "".join(p for p in streamed if isinstance(p, str)) == result.text and streamed[-1].tool_calls == []


def test_streamed_call_ends_with_the_result_carrying_it(tiny_engine):
    items = list(
        tiny_engine.stream_result(
            [{"role": "user", "content": "2+3?"}], tools=[ADD], tool_choice="add", max_new_tokens=40
        )
    )
    final = items[-1]
    assert final.tool_calls and "".join(items[:-1]) == final.text
    assert final.tool_calls[0]["arguments"] == json.loads(final.text)["arguments"]


def test_a_call_cut_by_max_new_tokens_is_no_call(tiny_engine):
    result = tiny_engine.chat([{"role": "user", "content": "2+3?"}], tools=[ADD], tool_choice="add", max_new_tokens=3)
    assert result.finish_reason == "length" and result.tool_calls == []


def test_tool_call_and_response_format_together_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="response_format: cannot be combined with a tool call"):
        tiny_engine.chat(
            [{"role": "user", "content": "hi"}], tools=[ADD], tool_choice="add", response_format={"type": "json_object"}
        )
