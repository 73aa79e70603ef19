"""Prompt building and citation parsing, including hostile documents and answers (property-based)."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from snapkv_rag.request.prompts import (
    Document,
    format_documents,
    parse_citations,
    rag_user_message,
    strip_citations,
    to_documents,
)

doc_text = st.text(max_size=300) | st.sampled_from(["[3]", "Question: who?", "[1][2]", "", "Documents:\n\n[9] x"])
documents = st.lists(st.builds(Document, text=doc_text, title=st.none() | st.text(max_size=40)), max_size=40)


@given(documents, st.text(min_size=1, max_size=200))
@settings(max_examples=200, deadline=None)
def test_prompt_numbers_every_document_in_order_and_ends_with_the_question(docs, question):
    message = rag_user_message(question, docs)
    assert message.endswith(f"Question: {question}") if docs else message == question
    position = 0
    for number, doc in enumerate(docs, start=1):
        header = f"[{number}] Title: {doc.title}\n" if doc.title else f"[{number}] "
        found = message.find(header + doc.text.strip(), position)
        assert found >= position, f"document {number} missing or out of order"
        position = found + 1


@given(
    st.lists(st.integers(min_value=1, max_value=60), max_size=12),
    st.integers(min_value=0, max_value=60),
    st.sampled_from(["[{}]", "[{}, {}]", "[{}][{}]", "[{}; {}]", "[{} and {}]", "[{},{},{}]"]),
    st.text(max_size=30),
)
@settings(max_examples=300, deadline=None)
def test_citations_map_to_exactly_the_cited_documents(numbers, num_docs, shape, filler):
    filler = re.sub(r"[\[\]0-9]", "", filler)  # the filler carries no citations of its own
    size = shape.count("{}")
    parts = []
    for i in range(0, len(numbers), size):
        chunk = numbers[i : i + size]
        parts.append(shape.format(*chunk) if len(chunk) == size else "".join(f"[{n}]" for n in chunk))
    text = filler.join(parts) + filler
    expected = []
    for n in numbers:
        if 1 <= n <= num_docs and n not in expected:
            expected.append(n)
    assert parse_citations(text, num_docs) == expected


@given(st.text(alphabet="[]0123456789,; and&\n", max_size=200), st.integers(min_value=0, max_value=1000))
@settings(max_examples=500, deadline=None)
def test_bracket_soup_never_crashes_or_invents_documents(text, num_docs):
    cited = parse_citations(text, num_docs)
    assert all(1 <= n <= num_docs for n in cited) and len(cited) == len(set(cited))
    assert isinstance(strip_citations(text), str)


def test_known_formats_and_markers_are_removed():
    text = "Paris [1][3], also Lyon [2, 4] and [5; 1] but not [0] or [12] or [a] or 2019 [2 and 3]."
    assert parse_citations(text, 10) == [1, 3, 2, 4, 5]
    assert strip_citations("It is Paris [1][3].") == "It is Paris."


@given(st.lists(st.text(max_size=5), min_size=1000, max_size=1000))
@settings(max_examples=3, deadline=None)
def test_a_thousand_documents_are_numbered(texts):
    docs = to_documents(texts)
    block = format_documents(docs)
    assert block.count("[1000] ") == 1 and len(docs) == 1000


def test_huge_document_reaches_the_prompt_whole():
    huge = "word " * 200_000
    assert huge.strip() in rag_user_message("q?", to_documents([huge]))
