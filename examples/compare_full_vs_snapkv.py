"""Full cache and SnapKV side by side on the same retrieved documents.

    python examples/compare_full_vs_snapkv.py

For each question: retrieve 8 passages (an in-memory vector store, local MiniLM), then answer twice with one
``ChatSnapKV`` and the same documents: ``snapkv=False`` (full KV cache) and a 128-token SnapKV
budget. Prints both answers, the KV tokens kept per layer and decode ms/token.
"""

from __future__ import annotations

from langchain_rag import build_retriever
from rag_data import load_questions

from langchain_snapkv import ChatSnapKV
from snapkv_rag import SnapKVConfig, SnapKVLLM

SETTINGS = {"full cache": False, "snapkv-128": SnapKVConfig(max_capacity_prompt=128, window_size=16)}


def main(engine: SnapKVLLM | None = None, questions: int = 2) -> None:
    chat = ChatSnapKV(engine=engine or SnapKVLLM(), max_new_tokens=24)
    retriever = build_retriever(k=8)
    for item in load_questions()[:questions]:
        documents = retriever.invoke(item["question"])
        print(f"Q: {item['question']}  (gold: {item['answers'][0]}; {len(documents)} documents)")
        for label, snapkv in SETTINGS.items():
            answer = chat.invoke(item["question"], documents=documents, snapkv=snapkv)
            meta = answer.response_metadata
            kept, prompt = meta["compression"]["kept_tokens"][0], meta["compression"]["prompt_tokens"]
            print(
                f"  {label:>10}: kept {kept}/{prompt} tokens, {meta['timings']['decode_ms_per_token']:.0f} ms/token, "
                f"citations {meta['citations']}: {answer.content.strip()!r}"
            )
        print()


if __name__ == "__main__":
    main()
