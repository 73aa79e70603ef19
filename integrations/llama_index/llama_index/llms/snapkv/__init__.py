"""LlamaIndex integration for snapkv-rag: ``from llama_index.llms.snapkv import SnapKVLLM``."""

from llama_index.llms.snapkv.base import SnapKVLLM

__all__ = ["SnapKVLLM"]
