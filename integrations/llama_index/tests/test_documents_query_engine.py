"""SnapKVDocumentsQueryEngine: one LlamaIndex node set compressed once, many questions over it."""

from __future__ import annotations

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.query_engine import BaseQueryEngine

from llama_index.llms.snapkv import SnapKVDocumentsQueryEngine, SnapKVLLM
from snapkv_rag import KeyNormConfig

TEXTS = [
    " ".join(f"The Eiffel Tower is in Paris, note {i}." for i in range(30)),
    " ".join(f"Mount Fuji is in Japan, note {i}." for i in range(30)),
]
QUESTIONS = ["Where is the Eiffel Tower?", "Where is Mount Fuji?"]


def test_query_engine_over_an_index_answers_from_the_stored_cache(tiny_engine):
    llm = SnapKVLLM(engine=tiny_engine, max_new_tokens=6)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in TEXTS], embed_model=MockEmbedding(embed_dim=8))
    before = tiny_engine.doc_stats()
    engine = SnapKVDocumentsQueryEngine.from_index(llm, index, method=KeyNormConfig(ratio=0.5))
    assert isinstance(engine, BaseQueryEngine)
    assert [d.text for d in engine.handle.documents] == [n.get_content() for n in index.docstore.docs.values()]
    responses = [engine.query(q) for q in QUESTIONS]
    assert [r.response for r in responses] == [engine.handle.generate(q, max_new_tokens=6).text for q in QUESTIONS]
    after = tiny_engine.doc_stats()
    assert after.stored - before.stored == 1 and after.hits - before.hits == 4
    usage = responses[0].metadata["usage"]
    assert usage["prompt_tokens"] > engine.handle.prompt_tokens
    assert responses[0].metadata["compression"]["method"] == "keynorm"
    cited = [n.node.node_id for n in responses[0].source_nodes]
    assert cited == [engine.nodes[c - 1].node_id for c in responses[0].metadata["citations"]]
