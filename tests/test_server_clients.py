"""Real clients against a server on a loopback port: the official ``openai`` package (sync, async,
streaming), LangChain's ``ChatOpenAI`` (invoke, stream, batch) and LlamaIndex's ``OpenAILike`` in a
query engine. Each answer must be the engine's own greedy answer to the same prompt."""

from __future__ import annotations

import asyncio

import openai
import pytest
from server_testing import running_server
from snapkv_testing import filler_documents

QUESTIONS = ["Which river is number 3?", "Where is the castle?", "Name a market.", "Which railway runs north?"]


@pytest.fixture()
def server(tiny_engine):
    with running_server(tiny_engine) as (url, _):
        yield url


def ask(question):
    return [{"role": "user", "content": question}]


def test_openai_sync_client_with_documents_and_extension_fields(server, tiny_engine):
    from snapkv_rag import SnapKVConfig

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    docs = filler_documents(4)
    completion = client.chat.completions.create(
        model="tiny",
        messages=ask(QUESTIONS[0]),
        max_tokens=6,
        extra_body={"documents": docs, "snapkv": {"max_capacity_prompt": 64}},
    )
    alone = tiny_engine.chat(ask(QUESTIONS[0]), docs, max_new_tokens=6, snapkv=SnapKVConfig(max_capacity_prompt=64))
    assert completion.choices[0].message.content == alone.text
    assert completion.usage.prompt_tokens == alone.usage.prompt_tokens
    assert completion.model_extra["snapkv"]["compression"]["kept_tokens"] == [64, 64]
    text = client.completions.create(model="tiny", prompt=QUESTIONS[1], max_tokens=5)
    assert text.choices[0].text == tiny_engine.generate(QUESTIONS[1], max_new_tokens=5).text
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=ask("hi"))
    with pytest.raises(openai.BadRequestError, match="from 1 to 16"):
        client.chat.completions.create(model="tiny", messages=ask("hi"), n=17)


def test_openai_response_format_json_schema_is_passed_to_the_engine(server):
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="tiny",
        messages=ask("Pick a colour."),
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)  # random weights, valid JSON


def test_openai_streaming_with_usage(server, tiny_engine):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="tiny", messages=ask(QUESTIONS[2]), max_tokens=7, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tiny_engine.chat(ask(QUESTIONS[2]), max_new_tokens=7).text
    assert chunks[-1].usage.completion_tokens == 7


async def test_openai_async_client_concurrent_requests_get_their_own_answers(server, tiny_engine):
    from snapkv_rag import SnapKVConfig

    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused")
    docs = [filler_documents(n) for n in (2, 5, 3, 4)]  # unequal prompts, budgets and the full cache
    budgets = [64, False, 96, 200]
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(
                model="tiny",
                messages=ask(q),
                max_tokens=6,
                extra_body={"documents": d, "snapkv": ({"max_capacity_prompt": b} if b else False)},
            )
            for q, d, b in zip(QUESTIONS, docs, budgets)
        )
    )
    assert [r.choices[0].message.content for r in replies] == [
        tiny_engine.chat(ask(q), d, max_new_tokens=6, snapkv=b and SnapKVConfig(max_capacity_prompt=b)).text
        for q, d, b in zip(QUESTIONS, docs, budgets)
    ]
    assert [r.model_extra["snapkv"]["compression"]["kept_tokens"][0] for r in replies][::2] == [64, 96]
    pieces = [
        c.choices[0].delta.content or ""
        async for c in await client.chat.completions.create(
            model="tiny", messages=ask(QUESTIONS[0]), max_tokens=6, stream=True
        )
    ]
    assert "".join(pieces) == tiny_engine.chat(ask(QUESTIONS[0]), max_new_tokens=6).text


def test_langchain_chat_openai_invoke_stream_batch(server, tiny_engine):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=server + "/v1",
        api_key="unused",
        model="tiny",
        max_tokens=6,
        temperature=0,
        extra_body={"documents": filler_documents(3)},
    )
    expected = [tiny_engine.chat(ask(q), filler_documents(3), max_new_tokens=6).text for q in QUESTIONS]
    assert chat.invoke(QUESTIONS[0]).content == expected[0]
    assert "".join(chunk.content for chunk in chat.stream(QUESTIONS[1])) == expected[1]
    assert [m.content for m in chat.batch(QUESTIONS, config={"max_concurrency": 4})] == expected


def test_llamaindex_openai_like_in_a_query_engine(server, tiny_engine, monkeypatch):
    from llama_index.core import Document, SummaryIndex
    from llama_index.llms.openai_like import OpenAILike

    seen = []
    run = tiny_engine.astream_result  # the server's call into the engine, recorded to compare with
    monkeypatch.setattr(
        tiny_engine, "astream_result", lambda prompt, docs, **o: seen.append(prompt) or run(prompt, docs, **o)
    )
    llm = OpenAILike(
        model="tiny",
        api_base=server + "/v1",
        api_key="unused",
        is_chat_model=True,
        context_window=8192,
        max_tokens=6,
        temperature=0,
    )  # llama-index's default is 0.1
    facts = ["The harbour of Velmor was rebuilt in 1712.", "The orchard at Dunsby grows pears."]
    engine = SummaryIndex.from_documents([Document(text=t) for t in facts]).as_query_engine(llm=llm)
    response = engine.query("When was the harbour of Velmor rebuilt?")
    assert len(seen) == 1 and all(fact in seen[0][-1]["content"] for fact in facts)  # the retrieved context
    assert str(response) == tiny_engine.chat(seen[0], max_new_tokens=6).text


@pytest.mark.model
def test_a_real_answer_from_the_embedded_model_through_the_openai_client(engine):
    docs = [
        {
            "title": "Marie Curie",
            "text": "Marie Curie was a physicist and chemist who won the Nobel Prize in "
            "Physics in 1903 and in Chemistry in 1911.",
        },
        {
            "title": "Eiffel Tower",
            "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France, completed in 1889.",
        },
    ]
    with running_server(engine, model_name="SmolLM2-135M-Instruct") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            max_tokens=32,
            extra_body={"documents": docs},
            messages=ask("In which city is the Eiffel Tower?"),
        )
    assert "Paris" in reply.choices[0].message.content
    assert reply.model_extra["snapkv"]["compression"]["prompt_tokens"] == reply.usage.prompt_tokens
