"""llama-index-llms-snapkv: the LLM interface, query engines, and CitationQueryEngine's numbering."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.query_engine import CitationQueryEngine
from llama_index.core.query_engine.citation_query_engine import CITATION_QA_TEMPLATE, CITATION_REFINE_TEMPLATE

from llama_index.llms.snapkv import SnapKVLLM
from llama_index.llms.snapkv.citations import split_sources
from snapkv_rag import parse_citations

TEXTS = [
    "The Eiffel Tower is in Paris, France.",
    "Mount Fuji is the highest mountain in Japan.",
    "The Colosseum is in Rome, Italy.",
]


@pytest.fixture
def llm(tiny_engine) -> SnapKVLLM:
    return SnapKVLLM(engine=tiny_engine, max_new_tokens=8)


def index() -> VectorStoreIndex:
    return VectorStoreIndex.from_documents([Document(text=t) for t in TEXTS], embed_model=MockEmbedding(embed_dim=8))


def test_metadata_comes_from_the_model(llm, tiny_engine):
    meta = llm.metadata
    assert meta.context_window == tiny_engine.model.config.max_position_embeddings
    assert (meta.num_output, meta.is_chat_model, meta.model_name) == (8, True, tiny_engine.model_name)


def test_complete_chat_and_streams_agree(llm):
    text = llm.complete("Hello").text
    assert [r.delta for r in llm.stream_complete("Hello")][-1] == ""
    assert list(llm.stream_complete("Hello"))[-1].text == text
    assert llm.chat([ChatMessage(role=MessageRole.USER, content="Hello")]).message.content == text
    last = list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content="Hello")]))[-1]
    assert last.message.content == text and last.additional_kwargs["usage"]["completion_tokens"] > 0


async def test_async_forms_do_not_block_the_loop(llm, loop_watch):
    hello = [ChatMessage(role=MessageRole.USER, content="Hello")]
    watches = [loop_watch(llm.engine.model) for _ in range(4)]
    async with watches[0]:
        text = (await llm.acomplete("Hello")).text
    async with watches[1]:
        streamed = [r async for r in await llm.astream_complete("Hello")][-1].text
    async with watches[2]:
        chat = (await llm.achat(hello)).message.content
    async with watches[3]:
        chat_stream = [r async for r in await llm.astream_chat(hello)]
    assert text == streamed == chat == chat_stream[-1].message.content
    assert all(watch.loop_ran_during_forward for watch in watches)


def test_citation_prompt_is_split_into_sources():
    context = "".join(f"Source {n}:\n{t}\n\n" for n, t in enumerate(TEXTS, start=1))
    prompt = CITATION_QA_TEMPLATE.format(context_str=context, query_str="Where is the Colosseum?")
    assert split_sources(prompt) == (TEXTS, "Where is the Colosseum?")
    refine = CITATION_REFINE_TEMPLATE.format(existing_answer="Rome.", context_msg=context, query_str="Where?")
    assert split_sources(refine) is None
    assert split_sources("Source 1:\nno layout around it") is None


def test_citation_query_engine_sources_are_the_engine_documents(llm, tiny_engine, monkeypatch):
    seen = {}
    original = tiny_engine.chat

    def spy(messages, documents=None, **options):
        seen.update(question=messages[-1]["content"], documents=documents)
        return original(messages, documents, **options)

    monkeypatch.setattr(tiny_engine, "chat", spy)
    engine = CitationQueryEngine.from_args(index(), llm=llm, similarity_top_k=3)
    response = engine.query("Where is the Colosseum?")
    sources = [
        n.node.get_content().removeprefix(f"Source {i}:\n").strip()
        for i, n in enumerate(response.source_nodes, start=1)
    ]
    assert seen["question"] == "Where is the Colosseum?"
    assert seen["documents"] == sources and sorted(sources) == sorted(TEXTS)


def test_query_engine_and_settings(llm, monkeypatch):
    monkeypatch.setattr(Settings, "_llm", None)  # restored after the test
    Settings.llm = llm
    assert str(index().as_query_engine(similarity_top_k=2).query("Where is the Eiffel Tower?")).strip()
    assert str(index().as_query_engine(llm=llm).query("Where is the Eiffel Tower?")).strip()


def test_query_engine_response_carries_citations_and_compression(llm, tiny_engine):
    from snapkv_rag import SnapKVConfig

    llm = SnapKVLLM(engine=tiny_engine, max_new_tokens=8, snapkv=SnapKVConfig(max_capacity_prompt=40, window_size=8))
    response = CitationQueryEngine.from_args(index(), llm=llm, similarity_top_k=3).query("Where is the Colosseum?")
    figures = response.metadata["snapkv"]
    compression = figures["compression"]
    assert compression["method"] == "snapkv" and compression["kept_tokens"][0] == 40 < compression["prompt_tokens"]
    assert figures["citations"] == parse_citations(str(response), len(response.source_nodes))
    assert figures["calls"][-1]["compression"] == compression and figures["calls"][-1]["usage"]["prompt_tokens"] > 40
    assert all(n.node.node_id in response.metadata for n in response.source_nodes)  # the nodes' own entries stay
    plain = index().as_query_engine(llm=llm, similarity_top_k=2).query("Where is the Eiffel Tower?")
    assert plain.metadata["snapkv"]["compression"]["prompt_tokens"] > 0  # any query engine, not only citations


async def test_concurrent_async_queries_keep_their_own_figures(tiny_engine):
    from snapkv_rag import SnapKVConfig

    small = SnapKVLLM(engine=tiny_engine, max_new_tokens=4, snapkv=SnapKVConfig(max_capacity_prompt=40, window_size=8))
    full = SnapKVLLM(engine=tiny_engine, max_new_tokens=4, snapkv=False)
    a, b = await asyncio.gather(
        index().as_query_engine(llm=small).aquery("Where is the Colosseum?"),
        index().as_query_engine(llm=full).aquery("Where is the Colosseum?"),
    )
    assert a.metadata["snapkv"]["compression"]["method"] == "snapkv"
    assert b.metadata["snapkv"]["compression"]["method"] == "full"


def test_bad_input_is_named(llm, tiny_engine):
    with pytest.raises(ValueError, match="role 'function'"):
        llm.chat([ChatMessage(role=MessageRole.FUNCTION, content="42")])
    with pytest.raises(TypeError, match="unexpected option"):
        llm.complete("Hello", bogus=[])
    with pytest.raises(TypeError, match="tools: expected a list"):
        llm.complete("Hello", tools="add")
    with pytest.raises(ValueError, match="device"):
        SnapKVLLM(engine=tiny_engine, device="cpu")


@pytest.mark.model
def test_citations_reported_are_source_numbers(real_engine):
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

    responses = []

    class Capture(BaseEventHandler):
        def handle(self, event, **kwargs) -> None:
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                responses.append(event.response)

    get_dispatcher().add_event_handler(Capture())
    llm = SnapKVLLM(engine=real_engine, max_new_tokens=24)
    response = CitationQueryEngine.from_args(index(), llm=llm, similarity_top_k=3).query(
        "What is the highest mountain in Japan?"
    )
    reported = responses[-1].additional_kwargs["citations"]
    assert str(response).strip() and "Fuji" in str(response)
    assert reported == parse_citations(str(response), len(response.source_nodes))
