"""ChatSnapKV(...).bind_documents(docs): the documents compressed once, each question over them
prefilling only itself (the engine's document store), on a tiny random-weight model."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage

from langchain_snapkv import ChatSnapKV
from snapkv_rag import KeyNormConfig, SnapKVConfig

DOCS = [
    Document(
        page_content=" ".join(f"Paris is the capital of France, fact {i}." for i in range(30)),
        metadata={"title": "Paris"},
        id="p",
    ),
    Document(
        page_content=" ".join(f"Rome is the capital of Italy, fact {i}." for i in range(30)),
        metadata={"title": "Rome"},
        id="r",
    ),
]
QUESTIONS = ["What is the capital of France?", "What is the capital of Italy?"]


def test_bound_documents_are_indexed_once_and_answer_like_the_engine(tiny_engine):
    chat = ChatSnapKV(engine=tiny_engine, max_new_tokens=6, snapkv=SnapKVConfig())  # the field gives way
    before = tiny_engine.doc_stats()
    bound = chat.bind_documents(DOCS, method=KeyNormConfig(ratio=0.5))
    handle = bound.kwargs["documents"]
    messages = [bound.invoke(q) for q in QUESTIONS]
    assert [m.content for m in messages] == [handle.generate(q, max_new_tokens=6).text for q in QUESTIONS]
    assert [m.content for m in bound.batch(QUESTIONS)] == [m.content for m in messages]
    assert "".join(c.content for c in bound.stream(QUESTIONS[0])) == messages[0].content
    after = tiny_engine.doc_stats()
    assert after.stored - before.stored == 1 and after.hits - before.hits == 7
    meta = messages[0].response_metadata
    assert meta["compression"]["method"] == "keynorm" and meta["usage"]["prompt_tokens"] > handle.prompt_tokens
    assert (
        messages[0].usage_metadata["input_tokens"]
        == chat.invoke(QUESTIONS[0], documents=DOCS).usage_metadata["input_tokens"]
    )


def test_keeping_everything_answers_as_the_unbound_model(tiny_engine):
    chat = ChatSnapKV(engine=tiny_engine, max_new_tokens=6, snapkv=False)
    bound = chat.bind_documents(DOCS, method=KeyNormConfig(ratio=1.0))
    for question in QUESTIONS:
        assert bound.invoke(question).content == chat.invoke(question, documents=DOCS).content


def test_a_system_message_or_a_query_aware_method_is_refused(tiny_engine):
    chat = ChatSnapKV(engine=tiny_engine, max_new_tokens=4)
    with pytest.raises(ValueError, match="query-agnostic"):
        chat.bind_documents(DOCS, method=SnapKVConfig())
    bound = chat.bind_documents(DOCS)
    with pytest.raises(ValueError, match="does not start with the stored documents"):
        bound.invoke([SystemMessage(content="Be brief."), HumanMessage(content=QUESTIONS[0])])
