"""llama-index-llms-snapkv: structured prediction decoded under the output class's schema, and
function calling, with real LlamaIndex objects. The tiny model has random weights: it could not
write valid JSON by being asked, so every valid object here comes from the constrained decoding."""

import json
from typing import Literal

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.program.utils import FlexibleModel
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from llama_index.llms.snapkv import SnapKVLLM
from llama_index.llms.snapkv.structured import to_engine_messages

PROMPT = PromptTemplate("Which city is the Eiffel Tower in? {hint}")


class City(BaseModel):
    name: Literal["Paris", "Rome", "Tokyo"]
    country_code: str = Field(max_length=3)
    rank: int = Field(ge=1, le=5)


class AddArgs(BaseModel):
    a: int = Field(ge=0, le=99)  # bounded: a random model could write digits forever
    b: int = Field(ge=0, le=99)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def llm(tiny_engine) -> SnapKVLLM:
    return SnapKVLLM(engine=tiny_engine, max_new_tokens=48)


def test_structured_predict_returns_the_output_class(llm):
    city = llm.structured_predict(City, PROMPT, hint="Answer briefly.")
    assert isinstance(city, City) and 1 <= city.rank <= 5
    assert llm.structured_predict(City, PROMPT, hint="Answer briefly.") == city  # greedy: the same


async def test_async_and_streamed_forms_agree(llm):
    city = llm.structured_predict(City, PROMPT, hint="")
    assert await llm.astructured_predict(City, PROMPT, hint="") == city
    streamed = list(llm.stream_structured_predict(City, PROMPT, hint=""))
    assert streamed[-1] == city and len(streamed) > 1
    assert all(isinstance(item, FlexibleModel) for item in streamed[:-1])
    assert streamed[-2].model_dump() == city.model_dump()  # the last partial object is the whole one
    items = [item async for item in await llm.astream_structured_predict(City, PROMPT, hint="")]
    assert items[-1] == city


def test_as_structured_llm_chat_gives_the_object(llm):
    structured = llm.as_structured_llm(City)
    response = structured.chat([ChatMessage(role=MessageRole.USER, content="Where is the Eiffel Tower?")])
    assert isinstance(response.raw, City)
    assert City.model_validate_json(response.message.content) == response.raw


def test_bad_output_class_is_named(llm):
    with pytest.raises(TypeError, match="output_cls: expected a pydantic model class"):
        llm.structured_predict(dict, PROMPT, hint="")


def test_function_calling_llm_calls_the_tool_and_reads_the_result_back(llm):
    assert isinstance(llm, FunctionCallingLLM) and llm.metadata.is_function_calling_model
    tool = FunctionTool.from_defaults(fn=add, fn_schema=AddArgs)
    response = llm.chat_with_tools([tool], user_msg="What is 2 + 3?", tool_required=True)
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "add" and set(selection.tool_kwargs) == {"a", "b"}
    assert all(isinstance(v, int) for v in selection.tool_kwargs.values())
    assert isinstance(response.message.blocks[0], ToolCallBlock)
    assert (
        json.loads(response.message.additional_kwargs["tool_calls"][0]["function"]["arguments"])
        == selection.tool_kwargs
    )

    result = llm.predict_and_call([tool], user_msg="What is 2 + 3?")  # the tool runs on the call
    assert result.response == str(add(**selection.tool_kwargs))

    history = [
        ChatMessage(role=MessageRole.USER, content="What is 2 + 3?"),
        response.message,
        ChatMessage(
            role=MessageRole.TOOL,
            content=result.response,
            additional_kwargs={"tool_call_id": selection.tool_id, "name": "add"},
        ),
    ]
    rendered = llm.engine.request(to_engine_messages(history), tools=[tool.metadata.to_openai_tool()]).text
    assert f"Tool result (add, {selection.tool_id}): {result.response}" in rendered
    answer = llm.chat_with_tools([tool], chat_history=history)  # after the result: a text answer
    assert llm.get_tool_calls_from_response(answer, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected a tool call"):
        llm.get_tool_calls_from_response(answer)
