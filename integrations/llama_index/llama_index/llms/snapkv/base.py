"""``SnapKVLLM`` for LlamaIndex: a local LLM answering from a SnapKV-compressed KV cache."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import closing
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from pydantic import Field, model_validator
from snapkv_rag import GenerationResult
from snapkv_rag.adapter_fields import EngineSpec
from snapkv_rag.adapters import CALL_OPTIONS, call_options, iterate_in_thread, result_metadata

from . import instrumentation
from .citations import split_sources

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}


class SnapKVLLM(EngineSpec, CustomLLM):
    """LlamaIndex LLM over a SnapKV-compressed KV cache (one :class:`snapkv_rag.SnapKVLLM` engine).

    >>> from llama_index.core import Settings, VectorStoreIndex
    >>> from llama_index.core.query_engine import CitationQueryEngine
    >>> from llama_index.llms.snapkv import SnapKVLLM
    >>> Settings.llm = SnapKVLLM(max_new_tokens=64)        # or SnapKVLLM(engine=an_engine)
    >>> engine = CitationQueryEngine.from_args(index, similarity_top_k=3)
    >>> response = engine.query("Who wrote Hamlet?")   # [n] in the answer = response.source_nodes[n-1]

    Prompts from ``CitationQueryEngine`` (``Source 1:`` .. ``Source N:``) are passed to the engine
    as documents in the same order, with the question last, so the reported citations are the
    Source numbers (``parse_sources=False`` sends the prompt text unchanged). Other prompts go
    to the model as they are. Every response carries ``additional_kwargs`` with ``citations``,
    ``compression`` (kept tokens per layer, KV bytes, ratio), ``timings`` and ``usage``, and
    ``raw`` = ``GenerationResult.to_dict()``; a query engine's ``Response`` gets the same figures in
    ``response.metadata["snapkv"]`` (see :mod:`llama_index.llms.snapkv.instrumentation`).
    """

    max_new_tokens: int | None = Field(default=None, description="None: the engine's default.")
    parse_sources: bool = Field(default=True, description="Pass CitationQueryEngine's sources as documents.")

    @model_validator(mode="after")
    def _register_response_metadata(self) -> SnapKVLLM:
        instrumentation.register()  # query engines' responses get response.metadata["snapkv"]
        return self

    @classmethod
    def class_name(cls) -> str:
        return "SnapKVLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.engine.context_window,
                           num_output=self.max_new_tokens or self.engine.max_new_tokens,
                           is_chat_model=True, model_name=self.engine.model_name)

    # ------------------------------------------------------------------ requests
    def _request(self, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in CALL_OPTIONS}
        options = call_options(fields, {k: v for k, v in kwargs.items() if k not in ("documents", "formatted")},
                               ("documents",))
        documents = kwargs.get("documents")
        if documents is None and self.parse_sources and messages and messages[-1]["role"] == "user":
            parsed = split_sources(messages[-1]["content"])
            if parsed is not None:
                documents, question = parsed
                messages = [*messages[:-1], {"role": "user", "content": question}]
        return {"messages": messages, "documents": documents, **options}

    def _completion_messages(self, prompt: str, formatted: bool) -> list[dict[str, str]]:
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def _details(self, result: GenerationResult) -> dict[str, Any]:
        return result_metadata(result, self.engine.model_name)

    def _completion(self, result: GenerationResult) -> CompletionResponse:
        return CompletionResponse(text=result.text, raw=result.to_dict(), additional_kwargs=self._details(result))

    def _chat_response(self, result: GenerationResult) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text),
                            raw=result.to_dict(), additional_kwargs=self._details(result))

    def _pieces(self, request: dict[str, Any]) -> Iterator[str | GenerationResult]:
        request = dict(request)
        return self.engine.stream_result(request.pop("messages"), **request)

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        request = self._request(self._completion_messages(prompt, formatted), kwargs)
        return self._completion(self.engine.chat(**request))

    def _completion_chunk(self, text: str, item: str | GenerationResult) -> tuple[str, CompletionResponse]:
        """The running text and the response for one streamed piece (or the final result)."""
        if isinstance(item, str):
            text += item
            return text, CompletionResponse(text=text, delta=item)
        return text, CompletionResponse(text=text, delta="", raw=item.to_dict(), additional_kwargs=self._details(item))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        request = self._request(self._completion_messages(prompt, formatted), kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            with closing(self._pieces(request)) as items:
                for item in items:
                    text, response = self._completion_chunk(text, item)
                    yield response
        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        request = self._request(self._completion_messages(prompt, formatted), kwargs)
        return self._completion(await asyncio.to_thread(lambda: self.engine.chat(**request)))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        request = self._request(self._completion_messages(prompt, formatted), kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for item in iterate_in_thread(lambda: self._pieces(request)):
                text, response = self._completion_chunk(text, item)
                yield response
        return gen()

    # ------------------------------------------------------------------ chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request = self._request(to_engine_messages(messages), kwargs)
        return self._chat_response(self.engine.chat(**request))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        request = self._request(to_engine_messages(messages), kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            with closing(self._pieces(request)) as items:
                for item in items:
                    yield self._chat_chunk(text := text + item if isinstance(item, str) else text, item)
        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request = self._request(to_engine_messages(messages), kwargs)
        return self._chat_response(await asyncio.to_thread(lambda: self.engine.chat(**request)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        request = self._request(to_engine_messages(messages), kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for item in iterate_in_thread(lambda: self._pieces(request)):
                yield self._chat_chunk(text := text + item if isinstance(item, str) else text, item)
        return gen()

    def _chat_chunk(self, text: str, item: str | GenerationResult) -> ChatResponse:
        message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
        if isinstance(item, str):
            return ChatResponse(message=message, delta=item)
        return ChatResponse(message=message, delta="", raw=item.to_dict(), additional_kwargs=self._details(item))


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Role/content dicts for the engine; only system, user and assistant text messages."""
    converted = []
    for index, message in enumerate(messages):
        if message.role not in _ROLES:
            raise ValueError(f"messages[{index}]: role {message.role.value!r} is not supported; "
                             "SnapKVLLM takes system, user and assistant messages (no tool calling)")
        blocks = [b for b in message.blocks if getattr(b, "block_type", None) != "text"]
        if blocks:
            raise ValueError(f"messages[{index}]: {type(blocks[0]).__name__} content is not supported (text only)")
        converted.append({"role": _ROLES[message.role], "content": message.content or ""})
    return converted
