"""A query engine over ONE node set, compressed once: every question prefills only itself.

    engine = SnapKVDocumentsQueryEngine.from_index(SnapKVLLM(), index)        # or .from_nodes(llm, nodes)
    engine.query("Who wrote Hamlet?").response, .source_nodes (the cited nodes)

The nodes (in the index's docstore order, numbered [1]..[N]) are prefilled once and compressed by a
query-agnostic method (key-norm keeping half, by default; see
:meth:`snapkv_rag.SnapKVLLM.index_documents`), and the compressed cache stays in the engine's
document store. For a question that needs retrieval first, use the LLM in an ordinary query engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import BaseNode, NodeWithScore
from pydantic import Field

from snapkv_rag import Document

from .base import SnapKVLLM


class SnapKVDocumentsQueryEngine(CustomQueryEngine):
    """Answers questions over one fixed node set from its stored compressed cache; the response's
    ``source_nodes`` are the nodes the answer cites, ``metadata`` the engine's figures."""

    llm: SnapKVLLM
    nodes: list[BaseNode]
    handle: Any = Field(exclude=True)

    @classmethod
    def from_nodes(cls, llm: SnapKVLLM, nodes: Sequence[BaseNode], method: Any = 0.5) -> SnapKVDocumentsQueryEngine:
        nodes = list(nodes)
        documents = [
            Document(text=node.get_content(), title=node.metadata.get("title"), id=node.node_id) for node in nodes
        ]
        return cls(llm=llm, nodes=nodes, handle=llm.engine.index_documents(documents, method))

    @classmethod
    def from_index(cls, llm: SnapKVLLM, index: Any, method: Any = 0.5) -> SnapKVDocumentsQueryEngine:
        """Over every node of ``index``'s docstore."""
        return cls.from_nodes(llm, list(index.docstore.docs.values()), method)

    def custom_query(self, query_str: str) -> Response:
        request = self.llm._request([{"role": "user", "content": query_str}], {"documents": self.handle})
        request.pop("snapkv", None)  # the handle's method runs
        result = self.llm.engine.chat(**request)
        cited = [NodeWithScore(node=self.nodes[n - 1]) for n in result.citations]
        return Response(response=result.text, source_nodes=cited, metadata=self.llm._details(result))
