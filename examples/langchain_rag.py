"""LangChain retrieval chain: a vector store over local passages -> ChatSnapKV, answer with cited sources.

    python examples/langchain_rag.py

The retrieved documents travel as text-plain blocks of the human message (``documents_message``),
so the engine numbers them [1]..[N] and puts the question last, where SnapKV's observation window
reads it; ``response_metadata["cited_documents"]`` maps the answer's [n] back to them.
"""

from __future__ import annotations

from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_huggingface import HuggingFaceEmbeddings
from rag_data import embedding_model_path, load_passages, load_questions

from langchain_snapkv import ChatSnapKV, documents_message
from snapkv_rag import SnapKVConfig, SnapKVLLM


def build_retriever(k: int = 4):
    embeddings = HuggingFaceEmbeddings(model_name=embedding_model_path())
    documents = [
        Document(page_content=p["text"], metadata={"title": p["title"], "source": p["source"]}, id=p["id"])
        for p in load_passages()
    ]
    return InMemoryVectorStore.from_documents(documents, embeddings).as_retriever(search_kwargs={"k": k})


def build_chain(chat: ChatSnapKV, retriever):
    """question -> {question, documents} -> one human message (documents, then question) -> answer."""
    to_message = RunnableLambda(lambda x: [documents_message(x["question"], x["documents"])])
    return RunnableParallel(question=RunnablePassthrough(), documents=retriever) | to_message | chat


def main(engine: SnapKVLLM | None = None, questions: int = 2) -> None:
    chat = ChatSnapKV(
        engine=engine or SnapKVLLM(), max_new_tokens=32, snapkv=SnapKVConfig(max_capacity_prompt=128, window_size=16)
    )
    chain = build_chain(chat, build_retriever())
    for item in load_questions()[:questions]:
        answer = chain.invoke(item["question"])
        meta = answer.response_metadata
        print(f"Q: {item['question']}  (gold: {item['answers'][0]})")
        print(f"A: {answer.content.strip()}")
        print(
            f"   citations: {meta['citations']}  kept {meta['compression']['kept_tokens'][0]}"
            f"/{meta['compression']['prompt_tokens']} prompt tokens per layer"
        )
        for doc in meta["cited_documents"]:
            print(f"   [{doc['number']}] {doc['title']} ({doc['id']})")
        print()


if __name__ == "__main__":
    main()
