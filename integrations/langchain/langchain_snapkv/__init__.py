"""LangChain integration for snapkv-rag: local LLMs answering over retrieved documents from a
SnapKV-compressed KV cache.

>>> from langchain_snapkv import ChatSnapKV
>>> chat = ChatSnapKV(max_new_tokens=48)
>>> msg = chat.invoke("Who wrote Hamlet?", documents=["Hamlet is a play by William Shakespeare."])
>>> msg.content, msg.response_metadata["citations"], msg.response_metadata["compression"]["ratio"]
"""

from langchain_snapkv.chat_models import ChatSnapKV, documents_message
from langchain_snapkv.llms import SnapKVLLM

__version__ = "0.1.0"

__all__ = ["ChatSnapKV", "SnapKVLLM", "documents_message", "__version__"]
