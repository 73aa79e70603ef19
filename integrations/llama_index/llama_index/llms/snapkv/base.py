"""``SnapKVLLM`` for LlamaIndex: a local LLM answering from a SnapKV-compressed KV cache."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import closing
from typing import Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import BasePromptTemplate
from pydantic import BaseModel, Field, model_validator

from snapkv_rag import GenerationResult
from snapkv_rag.frameworks.fields import EngineSpec
from snapkv_rag.frameworks.shared import CALL_OPTIONS, call_options, iterate_in_thread, result_metadata

from . import instrumentation, structured
from .citations import split_sources
from .structured import to_engine_messages

Model = TypeVar("Model", bound=BaseModel)
_ENGINE_ONLY = ("response_format", "tools", "tool_choice")


class SnapKVLLM(EngineSpec, FunctionCallingLLM):
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

    Structured output is decoded under the output class's JSON schema, so it always parses::

        answer = llm.structured_predict(CitedAnswer, PromptTemplate("..."), **prompt_args)
        llm.as_structured_llm(CitedAnswer).chat(messages).raw     # a CitedAnswer

    Function calling (``chat_with_tools``, ``predict_and_call``, ``FunctionAgent``): each call is
    decoded under the JSON schema of the call; ``tool_required=True`` forces one, otherwise the
    model calls a tool unless the last message is a tool result (see :mod:`snapkv_rag.request.tools`).
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
        return LLMMetadata(
            context_window=self.engine.context_window,
            num_output=self.max_new_tokens or self.engine.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.engine.model_name,
        )

    # ------------------------------------------------------------------ requests
    def _request(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in CALL_OPTIONS}
        options = call_options(
            fields,
            {k: v for k, v in kwargs.items() if k not in ("documents", "formatted", *_ENGINE_ONLY)},
            ("documents",),
        )
        options.update({k: kwargs[k] for k in _ENGINE_ONLY if kwargs.get(k) is not None})
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
        return ChatResponse(
            message=structured.assistant_message(result.text, result.tool_calls),
            raw=result.to_dict(),
            additional_kwargs=self._details(result),
        )

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
        return self._completion(await self.engine.achat(**request))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
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
        return self._chat_response(await self.engine.achat(**request))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        request = self._request(to_engine_messages(messages), kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for item in iterate_in_thread(lambda: self._pieces(request)):
                yield self._chat_chunk(text := text + item if isinstance(item, str) else text, item)

        return gen()

    def _chat_chunk(self, text: str, item: str | GenerationResult) -> ChatResponse:
        if isinstance(item, str):
            return ChatResponse(message=structured.assistant_message(text, []), delta=item)
        return ChatResponse(
            message=structured.assistant_message(text, item.tool_calls),
            delta="",
            raw=item.to_dict(),
            additional_kwargs=self._details(item),
        )

    # ------------------------------------------------------------------ structured output
    def _structured_request(
        self,
        output_cls: type[BaseModel],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None,
        prompt_args: dict[str, Any],
    ) -> dict[str, Any]:
        structured.check_output_cls(output_cls)
        messages = to_engine_messages(self._get_messages(prompt, **prompt_args))
        return self._request(messages, {**(llm_kwargs or {}), "response_format": output_cls})

    def structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        """``output_cls`` from the prompt, decoded under its JSON schema (always valid JSON of it)."""
        result = self.engine.chat(**self._structured_request(output_cls, prompt, llm_kwargs, prompt_args))
        return output_cls.model_validate_json(result.text)

    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        request = self._structured_request(output_cls, prompt, llm_kwargs, prompt_args)
        result = await self.engine.achat(**request)
        return output_cls.model_validate_json(result.text)

    def stream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Iterator[Any]:
        """Partial objects as the JSON is decoded (flexible copies of ``output_cls``), then the
        validated ``output_cls``."""
        request = self._structured_request(output_cls, prompt, llm_kwargs, prompt_args)

        def pieces() -> Iterator[str]:
            with closing(self._pieces(request)) as items:
                yield from (item for item in items if isinstance(item, str))

        return structured.partial_objects(output_cls, pieces())

    async def astream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncIterator[Any]:
        request = self._structured_request(output_cls, prompt, llm_kwargs, prompt_args)

        def objects() -> Iterator[Any]:
            with closing(self._pieces(request)) as items:
                yield from structured.partial_objects(output_cls, (i for i in items if isinstance(i, str)))

        async def gen() -> AsyncIterator[Any]:
            async for item in iterate_in_thread(objects):
                yield item

        return gen()

    # ------------------------------------------------------------------ function calling
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``chat`` arguments for a tool call: one call per response (``allow_parallel_tool_calls``
        makes no difference), forced with ``tool_required`` or ``tool_choice``."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role="user", content=user_msg) if isinstance(user_msg, str) else user_msg)
        tool_choice = kwargs.pop("tool_choice", "required" if tool_required else None)
        return {"messages": messages, "tools": structured.engine_tools(tools), "tool_choice": tool_choice, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        return structured.tool_selections(response.message, error_on_no_tool_call)
