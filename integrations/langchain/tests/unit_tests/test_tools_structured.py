"""ChatSnapKV's bind_tools and with_structured_output on a tiny random-weight model: it could not
write valid JSON by being asked, so every parsed call and object here comes from the engine's
constrained decoding; and tool messages fed back reach the prompt."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from langchain_snapkv import ChatSnapKV
from langchain_snapkv.chat_models import to_engine_messages


class Verdict(BaseModel):
    """A verdict on a claim."""

    label: Literal["true", "false", "unsure"]
    confidence: int = Field(ge=0, le=10)


class VerdictDict(TypedDict):
    """A verdict on a claim."""

    label: Annotated[Literal["true", "false"], ..., "the verdict"]


@tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return f"Sunny in {city}."


@tool
def add(a: Annotated[int, Field(ge=0, le=9)], b: Annotated[int, Field(ge=0, le=9)]) -> int:
    """Add two digits."""
    return a + b


@pytest.fixture
def chat(tiny_engine) -> ChatSnapKV:
    return ChatSnapKV(engine=tiny_engine, max_new_tokens=48)


@pytest.mark.parametrize("method", ["json_schema", "json_mode", "function_calling"])
def test_structured_output_from_pydantic_typeddict_and_json_schema(chat, method):
    verdict = chat.with_structured_output(Verdict, method=method).invoke("Is the sky green?")
    assert isinstance(verdict, Verdict) and 0 <= verdict.confidence <= 10
    as_dict = chat.with_structured_output(VerdictDict, method=method).invoke("Is the sky green?")
    assert set(as_dict) == {"label"} and as_dict["label"] in ("true", "false")
    schema = chat.with_structured_output(Verdict.model_json_schema(), method=method).invoke("Is the sky green?")
    assert Verdict.model_validate(schema) == verdict  # the same schema, greedy: the same object


def test_include_raw_and_streaming(chat):
    out = chat.with_structured_output(Verdict, include_raw=True).invoke("Is the sky green?")
    assert isinstance(out["raw"], AIMessage) and out["parsing_error"] is None
    assert Verdict.model_validate_json(out["raw"].content) == out["parsed"]
    streamed = list(chat.with_structured_output(Verdict).stream("Is the sky green?"))
    assert streamed[-1] == out["parsed"]
    cut = ChatSnapKV(engine=chat.engine, max_new_tokens=3).with_structured_output(Verdict, include_raw=True)
    failed = cut.invoke("Is the sky green?")  # the JSON is cut short: the error is reported, not raised
    assert failed["parsed"] is None and failed["parsing_error"] is not None


def test_json_mode_without_schema_gives_a_json_object(chat):
    out = chat.with_structured_output(None, method="json_mode").invoke("Describe Paris.")
    assert isinstance(out, dict)


@pytest.mark.parametrize("choice", ["any", "required", "get_weather", True])
def test_bind_tools_gives_tool_calls(chat, choice):
    tools = [get_weather] if choice is True else [get_weather, add]
    message = chat.bind_tools(tools, tool_choice=choice).invoke("What is the weather in Rome?")
    [call] = message.tool_calls
    assert call["type"] == "tool_call" and call["id"]
    if call["name"] == "get_weather":
        assert call["args"]["city"] in ("Paris", "Rome")
    else:
        assert choice in ("any", "required") and call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert [b for b in message.content_blocks if b["type"] == "tool_call"][0]["name"] == call["name"]


def test_streamed_tool_call_chunks_add_up_to_the_call(chat):
    calling = chat.bind_tools([add], tool_choice="add")
    expected = calling.invoke("2 + 3?").tool_calls[0]
    chunks = list(calling.stream("2 + 3?"))
    assert [c for c in chunks if c.tool_call_chunks][0].tool_call_chunks[0]["name"] == "add"
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert full.tool_calls[0]["args"] == expected["args"] and full.tool_calls[0]["name"] == "add"


def test_tool_results_are_fed_back_and_auto_then_answers(chat):
    calling = chat.bind_tools([add])  # tool_choice "auto"
    question = HumanMessage("What is 2 + 3?")
    call_message = calling.invoke([question])
    assert call_message.tool_calls  # no tool result yet: auto calls
    result = add.invoke(call_message.tool_calls[0])
    assert isinstance(result, ToolMessage)
    prompt = chat.engine.request(to_engine_messages([question, call_message, result])[0]).text
    assert f"Tool result (add, {result.tool_call_id}): {result.content}" in prompt
    answer = calling.invoke([question, call_message, result])
    assert answer.tool_calls == [] and isinstance(answer.content, str)


def test_a_call_cut_short_is_an_invalid_tool_call(tiny_engine):
    message = ChatSnapKV(engine=tiny_engine, max_new_tokens=3).bind_tools([add], tool_choice="add").invoke("2+3?")
    assert message.tool_calls == [] and message.invalid_tool_calls
    assert "did not complete" in message.invalid_tool_calls[0]["error"]


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda c: c.bind_tools([add], tool_choice="subtract"), "tool_choice: expected one of"),
        (lambda c: c.bind_tools([add, get_weather], tool_choice=True), "tool_choice: True needs exactly one tool"),
        (lambda c: c.with_structured_output(Verdict, method="xml"), "method: expected one of"),
        (lambda c: c.with_structured_output(None), "schema: required with method='json_schema'"),
        (lambda c: c.with_structured_output(Verdict, bogus=1), "unexpected argument"),
    ],
)
def test_bad_arguments_are_named(chat, call, error):
    with pytest.raises((TypeError, ValueError), match=error):
        call(chat)
