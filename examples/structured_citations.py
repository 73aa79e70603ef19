"""Cited answers as JSON with LangChain: ``with_structured_output(CitedAnswer)`` over retrieved documents.

    python examples/structured_citations.py

The retriever's documents travel as text-plain blocks of the human message, so the engine numbers
them [1]..[N] (question last, where SnapKV's observation window reads it). The answer is decoded
under ``CitedAnswer``'s JSON schema, so even the 135M embedded model returns a parseable object
whose citations are numbers between 1 and the number of retrieved documents (the answer's length is
bounded too, so that a small model's repetitive answer cannot run past ``max_new_tokens``).
"""

from __future__ import annotations

from typing import Annotated

from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough
from langchain_rag import build_retriever
from pydantic import BaseModel, Field
from rag_data import load_questions

from langchain_snapkv import ChatSnapKV, documents_message
from snapkv_rag import SnapKVConfig, SnapKVLLM

K = 4  # documents retrieved per question


class CitedAnswer(BaseModel):
    """Answer the question from the documents, and cite the ones that support the answer."""

    answer: str = Field(max_length=100, description="A short answer, based only on the documents.")
    citations: list[Annotated[int, Field(ge=1, le=K)]] = Field(
        min_length=1, max_length=K, description="The numbers of the documents that support the answer."
    )


def build_chain(chat: ChatSnapKV, retriever):
    """question -> {documents, answer: CitedAnswer}: the documents are kept to show what was cited."""
    structured = chat.with_structured_output(CitedAnswer)
    ask = RunnableLambda(lambda x: [documents_message(x["question"], x["documents"])]) | structured
    return RunnableParallel(question=RunnablePassthrough(), documents=retriever) | RunnablePassthrough.assign(
        answer=ask
    )


def main(engine: SnapKVLLM | None = None, questions: int = 2) -> None:
    chat = ChatSnapKV(
        engine=engine or SnapKVLLM(), max_new_tokens=96, snapkv=SnapKVConfig(max_capacity_prompt=128, window_size=16)
    )
    chain = build_chain(chat, build_retriever(k=K))
    for item in load_questions()[:questions]:
        out = chain.invoke(item["question"])
        answer: CitedAnswer = out["answer"]
        print(f"Q: {item['question']}  (gold: {item['answers'][0]})")
        print(f"A: {answer.answer.strip()}")
        print(f"   citations: {answer.citations}")
        for number in answer.citations:
            doc = out["documents"][number - 1]
            print(f"   [{number}] {doc.metadata['title']} ({doc.id})")
        print()


if __name__ == "__main__":
    main()
