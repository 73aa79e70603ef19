"""Tools through the server, with the real clients: the ``openai`` package (plain, and streamed
through its own chunk assembler), LangChain's ``ChatOpenAI.bind_tools`` in an agent loop and
LlamaIndex's ``OpenAILike`` calling a tool. The server translates; each call must be the one the
engine decodes for the same messages, and parse against its tool's schema."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_testing import running_server

from snapkv_rag import SnapKVLLM

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
            "additionalProperties": False,
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
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, WEATHER)}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def llm(tiny_model, tokenizer):
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=12)


@pytest.fixture(scope="module")
def client(llm):
    with running_server(llm) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused")


def parses(call) -> dict:
    """The call's arguments, checked against its tool's schema."""
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("choice", ["required", "get_weather", {"type": "function", "function": {"name": "add"}}])
def test_a_call_plain_and_streamed_is_the_engines_call(client, llm, choice):
    plain = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[ADD, WEATHER], tool_choice=choice, max_tokens=40
    )
    engine = llm.chat(ASK, tools=[ADD, WEATHER], tool_choice=choice, max_new_tokens=40).tool_calls[0]
    choice0 = plain.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    [call] = choice0.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, parses(call)) == (engine["name"], engine["arguments"])
    with client.chat.completions.stream(
        model="tiny", messages=ASK, tools=[ADD, WEATHER], tool_choice=choice, max_tokens=40
    ) as stream:
        streamed = stream.get_final_completion().choices[0]  # the client's own assembly of delta.tool_calls
    assert streamed.finish_reason == "tool_calls"
    [joined] = streamed.message.tool_calls
    assert (joined.function.name, parses(joined)) == (engine["name"], engine["arguments"])


def test_tool_choice_none_and_a_fed_back_result_answer_in_text(client, llm):
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=[ADD], tool_choice="none", max_tokens=6)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == llm.chat(ASK, tools=[ADD], tool_choice="none", max_new_tokens=6).text
    call = (
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=[ADD], parallel_tool_calls=False, max_tokens=40
        )
        .choices[0]
        .message
    )
    loop = [
        *ASK,
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "5"},
    ]
    answer = client.chat.completions.create(model="tiny", messages=loop, tools=[ADD], max_tokens=6).choices[0]
    # the engine gets the call back with its arguments, and the result named after the call it answers
    engine_loop = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.tool_calls[0].id, "name": "add", "arguments": parses(call.tool_calls[0])}],
        },
        {"role": "tool", "content": "5", "tool_call_id": call.tool_calls[0].id, "name": "add"},
    ]
    assert answer.finish_reason == "length" and answer.message.tool_calls is None
    assert answer.message.content == llm.chat(engine_loop, tools=[ADD], max_new_tokens=6).text


@pytest.mark.parametrize("max_tokens", [4, 12])
def test_a_call_cut_by_max_tokens_reads_the_same_plain_and_streamed(client, max_tokens):
    request = dict(model="tiny", messages=ASK, tools=[ADD], tool_choice="add", max_tokens=max_tokens)
    plain = client.chat.completions.create(**request).choices[0]
    with client.chat.completions.stream(**request) as stream:
        for _ in stream:
            pass  # the client refuses to "parse" a cut answer; its assembled snapshot is what it read
        streamed = stream.current_completion_snapshot.choices[0]
    assert plain.finish_reason == streamed.finish_reason == "length"
    assert plain.message.content == streamed.message.content
    assert [c.function.model_dump() for c in plain.message.tool_calls or []] == [
        c.function.model_dump() for c in streamed.message.tool_calls or []
    ]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tools": "add"}, "tools", "expected a list"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name", "non-empty"),
        ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice", "expected one of"),
        ({"tool_choice": "required"}, "tool_choice", "without tools"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"messages": [*ASK, {"role": "tool", "content": "5"}]}, "messages[1].tool_call_id", "id of the call"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}, *ASK]},
            "messages[0].tool_calls",
            "arguments",
        ),
        ({"tools": [ADD], "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ],
)
def test_bad_tools_get_openai_400s_naming_the_parameter(client, extra, param, words):
    reply = httpx.post(f"{client.base_url}chat/completions", json={"model": "tiny", "messages": ASK, **extra})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and words in reply.json()["error"]["message"]
    completion = httpx.post(f"{client.base_url}completions", json={"model": "tiny", "prompt": "2+3?", "tools": [ADD]})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "tools"


def test_langchain_chat_openai_agent_loop_calls_then_answers(client):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Weather in a city."""
        return f"Sunny in {city}"

    chat = ChatOpenAI(base_url=str(client.base_url), api_key="unused", model="tiny", max_tokens=40, temperature=0)
    agent = chat.bind_tools([get_weather])
    messages, steps = [HumanMessage("What is the weather in Rome?")], 0
    while steps < 4:
        steps += 1
        reply = agent.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    assert steps == 2 and messages[-1].content and not messages[-1].tool_calls  # call -> result -> text
    first = messages[1].tool_calls[0]
    assert first["name"] == "get_weather" and first["args"]["city"] in ("Paris", "Rome")
    streamed = None
    for piece in agent.stream(messages[:1]):
        streamed = piece if streamed is None else streamed + piece
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(first["name"], first["args"])]


class City(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]


def weather(city: str) -> str:
    """Weather in a city."""
    return f"Sunny in {city}"


def test_llamaindex_openai_like_predict_and_call_runs_the_tool(client):
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model="tiny",
        api_base=str(client.base_url),
        api_key="unused",
        is_chat_model=True,
        is_function_calling_model=True,
        context_window=8192,
        max_tokens=40,
        temperature=0,
    )
    response = llm.predict_and_call(
        [FunctionTool.from_defaults(weather, fn_schema=City)], "What is the weather in Rome?"
    )
    assert str(response) in ("Sunny in Paris", "Sunny in Rome")  # the tool ran on the call's arguments


@pytest.mark.model
def test_the_embedded_model_calls_the_right_tool_with_the_asked_argument(engine):
    city = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    with running_server(engine, model_name="SmolLM2-135M-Instruct") as (url, _):
        model = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        reply = model.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            tools=[ADD, city],
            max_tokens=40,
            messages=[{"role": "user", "content": "Is it raining in Oslo today?"}],
        )
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
