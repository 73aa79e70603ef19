"""Real RAG prompts of a chosen token length, shared by the benchmarks.

A prompt is one NQ question with passages from ``data/nq_passages.jsonl.gz``: its own gold passage
in the middle and other questions' passages around it, added until the rendered prompt (chat
template, instruction, documents, question) reaches the target number of tokens.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "nq_passages.jsonl.gz"


@dataclass
class Prompt:
    question: str
    answers: list[str]
    documents: list[dict[str, str]]
    tokens: int


@lru_cache(maxsize=1)
def records() -> tuple[dict, ...]:
    with gzip.open(DATA, "rt", encoding="utf-8") as handle:
        return tuple(json.loads(line) for line in handle)


def prompt_ids(tokenizer, question: str, documents: list[dict[str, str]], instruction: str | None = None) -> list[int]:
    """The token ids of the prompt the engine builds: the RAG user turn through the chat template
    (what a peer must be fed to answer the very same prompt)."""
    from snapkv_rag.request.prompts import DEFAULT_INSTRUCTION, rag_user_message, to_documents

    content = rag_user_message(question, to_documents(documents), instruction or DEFAULT_INSTRUCTION)
    messages = [{"role": "user", "content": content}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = f"user: {content}\nassistant: "
    return tokenizer(text, add_special_tokens=False).input_ids


def prompt_tokens(tokenizer, question: str, documents: list[dict[str, str]], instruction: str | None = None) -> int:
    return len(prompt_ids(tokenizer, question, documents, instruction))


def build_prompt(tokenizer, target_tokens: int, index: int = 0) -> Prompt:
    """Question ``index`` with as many passages as fit in ``target_tokens`` (at most that many).

    Passages are added one by one while the prompt stays within the target; the gold passage is
    then moved to the middle so that neither end of the prompt is special.
    """
    pool = records()
    gold = pool[index % len(pool)]
    others = [r for i, r in enumerate(pool) if i != index % len(pool)]
    documents = [{"title": gold["title"], "text": gold["text"]}]
    for record in others:
        candidate = documents + [{"title": record["title"], "text": record["text"]}]
        if prompt_tokens(tokenizer, gold["question"], candidate) > target_tokens:
            break
        documents = candidate
    else:
        raise ValueError(f"not enough passages in {DATA.name} for a {target_tokens}-token prompt")
    middle = len(documents) // 2
    documents = documents[1 : middle + 1] + documents[:1] + documents[middle + 1 :]
    return Prompt(
        question=gold["question"],
        answers=list(gold["answers"]),
        documents=documents,
        tokens=prompt_tokens(tokenizer, gold["question"], documents),
    )
