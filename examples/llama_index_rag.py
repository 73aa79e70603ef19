"""LlamaIndex: VectorStoreIndex (local MiniLM embeddings) -> CitationQueryEngine -> SnapKVLLM.

    python examples/llama_index_rag.py

The [n] in an answer is ``response.source_nodes[n - 1]``: the adapter hands the query engine's
"Source n" blocks to the engine as documents, in order.
"""

from __future__ import annotations

from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.query_engine import CitationQueryEngine
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from rag_data import embedding_model_path, load_passages, load_questions

from llama_index.llms.snapkv import SnapKVLLM
from snapkv_rag import SnapKVConfig, parse_citations
from snapkv_rag import SnapKVLLM as SnapKVEngine


def build_index() -> VectorStoreIndex:
    Settings.embed_model = HuggingFaceEmbedding(model_name=embedding_model_path())
    documents = [
        Document(text=p["text"], metadata={"title": p["title"]}, id_=p["id"], excluded_llm_metadata_keys=["title"])
        for p in load_passages()
    ]
    return VectorStoreIndex.from_documents(documents)


def main(engine: SnapKVEngine | None = None, questions: int = 2) -> None:
    Settings.llm = SnapKVLLM(
        engine=engine or SnapKVEngine(), max_new_tokens=32, snapkv=SnapKVConfig(max_capacity_prompt=128, window_size=16)
    )
    query_engine = CitationQueryEngine.from_args(build_index(), similarity_top_k=3, citation_chunk_size=256)
    for item in load_questions()[:questions]:
        response = query_engine.query(item["question"])
        print(f"Q: {item['question']}  (gold: {item['answers'][0]})")
        print(f"A: {str(response).strip()}")
        print(f"   citations: {parse_citations(str(response), len(response.source_nodes))}")
        for number, source in enumerate(response.source_nodes, start=1):
            print(f"   Source {number}: {source.node.metadata['title']}")
        print()


if __name__ == "__main__":
    main()
