"""What ``ChatSnapKV`` and ``SnapKVLLM`` share: the engine they hold, per-call options,
retrieved documents, and the metadata a result carries back.

The engine (:class:`snapkv_rag.SnapKVLLM`) does all the work; this module only translates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.documents import Document as LCDocument
from langchain_core.messages.ai import UsageMetadata
from pydantic import Field

from snapkv_rag import Document, GenerationResult
from snapkv_rag.documents.store import DocumentHandle
from snapkv_rag.frameworks.fields import EngineSpec
from snapkv_rag.frameworks.shared import call_options, result_metadata

__all__ = ["EngineFields", "to_engine_documents", "usage_metadata", "result_metadata"]


class EngineFields(EngineSpec):
    """The engine's fields (shared with the LlamaIndex adapter), LangChain's name for the number of
    tokens to generate, and streaming to callbacks."""

    max_tokens: int | None = Field(default=None, alias="max_new_tokens")
    """Tokens to generate (alias ``max_new_tokens``); ``None``: the engine's default."""
    streaming: bool = False
    """Stream tokens to the callbacks even on ``invoke``."""

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def _llm_type(self) -> str:
        return "snapkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "snapkv": repr(self.snapkv),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer."""
        return list(self.engine.tokenizer(text, add_special_tokens=False).input_ids)

    def get_num_tokens(self, text: str) -> int:
        return self.engine.count_tokens(text)

    def _call_options(self, stop: list[str] | None, kwargs: Mapping[str, Any]) -> tuple[dict, list | None]:
        """Engine options and documents for one call: per-call kwargs over the instance's fields."""
        kwargs = dict(kwargs)
        documents = to_engine_documents(kwargs.pop("documents", None))
        if "model" in kwargs:
            raise ValueError(
                f"model: {type(self).__name__} serves the model it loaded "
                f"({self.model_name}); a per-call model override is not supported"
            )
        if "max_tokens" in kwargs:  # LangChain's name for it
            kwargs["max_new_tokens"] = kwargs.pop("max_tokens")
        stored = isinstance(documents, DocumentHandle)  # runs the method it was indexed with, not the field's
        fields = {
            "max_new_tokens": self.max_tokens,
            "stop": self.stop,
            "snapkv": None if stored else self.snapkv,
            **{name: getattr(self, name) for name in ("temperature", "top_p", "seed")},
        }
        options = call_options(fields, {**kwargs, **({"stop": stop} if stop is not None else {})}, ("documents",))
        return options, documents


def to_engine_documents(items: Sequence[Any] | None) -> list | None:
    """LangChain ``Document``s (``metadata["title"]`` becomes the title) and anything the engine
    takes (str, dict with ``text``, ``snapkv_rag.Document``), in the order given; a handle from
    ``index_documents`` (:meth:`ChatSnapKV.bind_documents`) is passed through."""
    if items is None or isinstance(items, DocumentHandle):  # a stored compressed document set goes as it is
        return items
    if isinstance(items, (str, Mapping, LCDocument, Document)) or not isinstance(items, Sequence):
        raise TypeError(
            f"documents: expected a list of documents, got a single {type(items).__name__}; wrap it in a list"
        )
    converted = []
    for index, item in enumerate(items):
        if isinstance(item, LCDocument):
            title = item.metadata.get("title")
            converted.append(
                Document(
                    text=item.page_content,
                    title=None if title is None else str(title),
                    id=item.id,
                    metadata=dict(item.metadata),
                )
            )
        elif isinstance(item, (str, Mapping, Document)):
            converted.append(item)  # the engine validates these
        else:
            raise TypeError(
                f"documents[{index}]: expected a LangChain Document, a str, a dict with 'text' or a "
                f"snapkv_rag.Document; got {type(item).__name__}"
            )
    return converted


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=result.usage.prompt_tokens,
        output_tokens=result.usage.completion_tokens,
        total_tokens=result.usage.total_tokens,
    )
