"""LlamaIndex integration for snapkv-rag: ``from llama_index.llms.snapkv import SnapKVLLM``
(and ``SnapKVDocumentsQueryEngine``: one node set compressed once, many questions over it)."""

from llama_index.llms.snapkv.base import SnapKVLLM
from llama_index.llms.snapkv.documents import SnapKVDocumentsQueryEngine

__all__ = ["SnapKVLLM", "SnapKVDocumentsQueryEngine"]
