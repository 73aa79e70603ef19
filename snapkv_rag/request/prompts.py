"""RAG prompts and citation parsing.

The documents come first and the question last, so that SnapKV's observation window (the end of
the prompt) reads the question and votes for the passages that answer it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_INSTRUCTION = (
    "Answer the question using only the documents above. Write a short answer and cite the "
    "documents that support it by their numbers in square brackets, for example [1] or [2][3]."
)

REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly.\n"
"""What KVzip's re-read pass puts between the prompt and its second reading (:class:`~snapkv_rag.methods.KVzipConfig`)."""


@dataclass(frozen=True)
class Document:
    """A retrieved passage. ``id`` and ``metadata`` travel back to the caller untouched."""

    text: str
    title: str | None = None
    id: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Document.text must be a str, got {type(self.text).__name__}")
        if self.title is not None and not isinstance(self.title, str):
            raise TypeError(f"Document.title must be a str or None, got {type(self.title).__name__}")


DocumentLike = str | Mapping[str, Any] | Document


def to_document(item: DocumentLike, index: int = 0) -> Document:
    """Accept a string, a dict with ``text`` (optional ``title``, ``id``) or a :class:`Document`."""
    if isinstance(item, Document):
        return item
    if isinstance(item, str):
        return Document(text=item)
    if isinstance(item, Mapping):
        if not isinstance(item.get("text"), str):
            raise TypeError(f"documents[{index}]: a dict document needs a 'text' string; got keys {sorted(item)}")
        extra = {k: v for k, v in item.items() if k not in ("text", "title", "id")}
        title, doc_id = item.get("title"), item.get("id")
        return Document(
            text=item["text"],
            title=None if title is None else str(title),
            id=None if doc_id is None else str(doc_id),
            metadata=extra,
        )
    raise TypeError(
        f"documents[{index}]: expected a str, a dict with 'text', or snapkv_rag.Document; got {type(item).__name__}"
    )


def to_documents(items: Iterable[DocumentLike] | None) -> list[Document]:
    if items is None:
        return []
    if isinstance(items, (str, Mapping, Document)):
        raise TypeError(
            f"documents: expected a list of documents, got a single {type(items).__name__}; wrap it in a list"
        )
    return [to_document(item, i) for i, item in enumerate(items)]


def document_blocks(documents: Sequence[Document]) -> list[str]:
    """One ``[n] Title: ...`` block per document, numbered from 1 in the order given."""
    blocks = []
    for number, doc in enumerate(documents, start=1):
        head = f"[{number}] Title: {doc.title}\n" if doc.title else f"[{number}] "
        blocks.append(head + doc.text.strip())
    return blocks


def format_documents(documents: Sequence[Document]) -> str:
    """The documents' blocks, a blank line between two."""
    return "\n\n".join(document_blocks(documents))


QUESTION_MARK = "\n\nQuestion: "
"""What precedes the question in the user turn (where the question's votes start)."""


def rag_user_message(question: str, documents: Sequence[Document], instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The user turn of a RAG prompt: documents, then the instruction, then the question, last."""
    if not documents:
        return question
    return f"Documents:\n\n{format_documents(documents)}\n\n{instruction}{QUESTION_MARK}{question}"


_BRACKET = re.compile(r"\[([0-9][0-9,;\s]*(?:(?:and|&)\s*[0-9]+\s*)?)\]")
_NUMBER = re.compile(r"[0-9]+")


def parse_citations(text: str, num_documents: int) -> list[int]:
    """The 1-based document numbers cited in ``text``, in order of first appearance.

    Accepts ``[1]``, ``[1][3]``, ``[1, 3]``, ``[1; 3]`` and ``[1 and 3]``. Numbers outside
    ``1..num_documents`` are ignored: they cannot be mapped to a document.
    """
    seen: list[int] = []
    for match in _BRACKET.finditer(text):
        for raw in _NUMBER.findall(match.group(1)):
            number = int(raw)
            if 1 <= number <= num_documents and number not in seen:
                seen.append(number)
    return seen


_CITATION_MARK = re.compile(r"\s*\[[0-9][0-9,;\s]*(?:(?:and|&)\s*[0-9]+\s*)?\]")


def strip_citations(text: str) -> str:
    """The answer without its ``[n]`` markers (for answer metrics)."""
    return _CITATION_MARK.sub("", text).strip()
