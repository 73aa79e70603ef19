"""On the embedded model: documents reach the prompt and citations map back to them."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document

from langchain_snapkv import ChatSnapKV

pytestmark = pytest.mark.model

DOCS = [
    Document(page_content="The Eiffel Tower is in Paris, France.", metadata={"title": "Eiffel Tower"}),
    Document(page_content="Mount Fuji is the highest mountain in Japan.", metadata={"title": "Mount Fuji"}),
    Document(page_content="The Colosseum is in Rome, Italy.", metadata={"title": "Colosseum"}),
]


def test_cited_documents_are_the_numbered_ones(real_engine):
    chat = ChatSnapKV(engine=real_engine, max_new_tokens=24)
    answer = chat.invoke("What is the highest mountain in Japan?", documents=DOCS)
    meta = answer.response_metadata
    assert answer.content.strip() and meta["finish_reason"] in ("stop", "length")
    assert [d["number"] for d in meta["cited_documents"]] == meta["citations"]
    for doc in meta["cited_documents"]:
        assert doc["title"] == DOCS[doc["number"] - 1].metadata["title"]
    assert "Fuji" in answer.content
