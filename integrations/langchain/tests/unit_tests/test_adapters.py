"""ChatSnapKV and SnapKVLLM behaviour beyond the standard suite, on a tiny random-weight model."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import FunctionMessage, HumanMessage

from langchain_snapkv import ChatSnapKV, SnapKVLLM, documents_message

DOCS = [
    Document(page_content="Paris is the capital of France.", metadata={"title": "Paris"}, id="p"),
    Document(page_content="Rome is the capital of Italy.", metadata={"title": "Rome"}, id="r"),
]


@pytest.fixture
def chat(tiny_engine) -> ChatSnapKV:
    return ChatSnapKV(engine=tiny_engine, max_new_tokens=8)


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def test_threaded_batch_equals_sequential(chat):
    questions = ["What is the capital of France?", "Hey", "Name a river."]
    assert [m.content for m in chat.batch(questions)] == [chat.invoke(q).content for q in questions]


def test_stream_and_callbacks_match_invoke(chat):
    expected = chat.invoke("Hello")
    assert "".join(c.content for c in chat.stream("Hello")) == expected.content
    handler = Tokens()
    streamed = ChatSnapKV(engine=chat.engine, max_new_tokens=8, streaming=True).invoke(
        "Hello", config={"callbacks": [handler]}
    )
    assert "".join(handler.tokens) == streamed.content == expected.content
    assert streamed.usage_metadata["output_tokens"] == expected.usage_metadata["output_tokens"]


def test_stop_sequence_cuts_the_text(chat):
    text = chat.invoke("Hello", max_new_tokens=12).content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = chat.invoke("Hello", max_new_tokens=12, stop=[stop]).content
    assert text.startswith(cut) and stop not in cut


def test_documents_three_ways_give_one_prompt(chat):
    by_kwarg = chat.invoke("Capital of Italy?", documents=DOCS)
    by_bind = chat.bind(documents=DOCS).invoke("Capital of Italy?")
    by_blocks = chat.invoke([documents_message("Capital of Italy?", DOCS)])
    plain = chat.invoke("Capital of Italy?")
    prompts = {m.response_metadata["compression"]["prompt_tokens"] for m in (by_kwarg, by_bind, by_blocks)}
    assert len(prompts) == 1 and prompts.pop() > plain.usage_metadata["input_tokens"]
    assert by_kwarg.content == by_bind.content == by_blocks.content


def test_full_cache_and_budget_per_call(chat):
    long_docs = [Document(page_content=f"Fact {i}: the number {i} is written as {i}. " * 6) for i in range(8)]
    full = chat.invoke("Which number?", documents=long_docs, snapkv=False).response_metadata["compression"]
    from snapkv_rag import SnapKVConfig

    small = chat.invoke("Which number?", documents=long_docs, snapkv=SnapKVConfig(max_capacity_prompt=64))
    compressed = small.response_metadata["compression"]
    assert full["method"] == "full" and full["kept_tokens"][0] == full["prompt_tokens"]
    assert compressed["kept_tokens"][0] == 64 < compressed["prompt_tokens"]
    bound = chat.bind(snapkv=SnapKVConfig(max_capacity_prompt=64)).invoke("Which number?", documents=long_docs)
    share = chat.invoke("Which number?", documents=long_docs, snapkv=SnapKVConfig(ratio=0.5))
    assert share.response_metadata["compression"]["kept_tokens"][0] == -(-full["prompt_tokens"] // 2)
    same = {k: v for k, v in compressed.items() if k != "selection_ms"}  # all but a timing
    assert {k: v for k, v in bound.response_metadata["compression"].items() if k != "selection_ms"} == same


def test_token_counting_uses_the_models_tokenizer(chat, tiny_engine):
    text = "SnapKV keeps the tokens the question attends to."
    assert chat.get_num_tokens(text) == tiny_engine.count_tokens(text) == len(chat.get_token_ids(text))


def test_early_stop_of_a_stream_releases_the_engine(chat):
    stream = chat.stream("Hello")
    next(stream)
    stream.close()
    assert chat.invoke("Hello").content


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"documents": "one string"}, "wrap it in a list"),
        ({"documents": [42]}, r"documents\[0\]: expected a LangChain Document"),
        ({"model": "other"}, "per-call model override"),
        ({"tools": "add"}, "tools: expected a list"),
        ({"tool_choice": "any"}, "tool_choice: given without tools"),
        ({"bogus": 1}, "unexpected option"),
    ],
)
def test_bad_options_name_the_problem(chat, bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        chat.invoke("Hello", **bad)


def test_unsupported_messages_are_refused(chat):
    with pytest.raises(ValueError, match="FunctionMessage"):
        chat.invoke([FunctionMessage("42", name="add")])
    image = {"type": "image", "url": "https://example.com/a.png"}
    with pytest.raises(ValueError, match="'image'"):
        chat.invoke([HumanMessage(content=[image, {"type": "text", "text": "What is this?"}])])


def test_engine_and_loading_parameters_clash(tiny_engine):
    with pytest.raises(ValueError, match="device"):
        ChatSnapKV(engine=tiny_engine, device="cpu")
    with pytest.raises(TypeError, match="engine"):
        ChatSnapKV(engine="not an engine")


async def test_async_does_not_block_the_loop(chat, loop_watch):
    async with loop_watch(chat.engine.model) as invoked:
        answer = await chat.ainvoke("Hello")
    async with loop_watch(chat.engine.model) as streamed:
        pieces = [c.content async for c in chat.astream("Hello")]
    assert "".join(pieces) == answer.content == chat.invoke("Hello").content
    assert invoked.loop_ran_during_forward and streamed.loop_ran_during_forward


def test_text_completion_llm(tiny_engine):
    llm = SnapKVLLM(engine=tiny_engine, max_new_tokens=8)
    text = llm.invoke("Capital of Italy?", documents=DOCS)
    assert "".join(llm.stream("Capital of Italy?", documents=DOCS)) == text
    result = llm.generate(["Capital of Italy?"], documents=DOCS)
    info = result.generations[0][0].generation_info
    assert result.generations[0][0].text == text
    assert info["compression"]["prompt_tokens"] == result.llm_output["token_usage"]["prompt_tokens"]
    assert asyncio.run(llm.ainvoke("Capital of Italy?", documents=DOCS)) == text


def test_several_prompts_decode_together_and_equal_single_calls(tiny_engine):
    llm = SnapKVLLM(engine=tiny_engine, max_new_tokens=8)
    prompts = ["Capital of Italy?", "Which river is longest?", "Name a castle."]
    single = [llm.invoke(p, documents=DOCS) for p in prompts]
    for result in (llm.generate(prompts, documents=DOCS), asyncio.run(llm.agenerate(prompts, documents=DOCS))):
        assert [g[0].text for g in result.generations] == single
        assert max(g[0].generation_info["timings"]["batch_size"] for g in result.generations) > 1
