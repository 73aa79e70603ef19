"""SnapKV figures into a query engine's ``Response.metadata``, through LlamaIndex instrumentation.

A query engine calls the LLM through its response synthesizer, which keeps only the text: the
citations and compression figures that our LLM puts in each response's ``additional_kwargs`` would
stop there. This event handler (registered on the root dispatcher once, when the first
``SnapKVLLM`` is built) collects them from the LLM-end events of a query and, at the query's end
event, writes them into the ``Response`` the engine returns::

    response = query_engine.query("Who wrote Hamlet?")
    response.metadata["snapkv"]["citations"]       # of the last LLM call (the final answer)
    response.metadata["snapkv"]["compression"]     # kept tokens per layer, KV bytes, ratio
    response.metadata["snapkv"]["calls"]           # every LLM call of the query (refine steps too)

Calls are tracked per context (thread or asyncio task), so concurrent queries do not mix. A
streaming query ends before its answer is generated: its response gets no figures.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent

KEYS = ("citations", "compression", "timings", "usage", "finish_reason", "model_name")
_open_queries: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar("snapkv_queries", default=())
_registered = threading.Lock()
_handler: ResponseMetadataHandler | None = None


class ResponseMetadataHandler(BaseEventHandler):
    """Copies each SnapKV LLM call's figures into the metadata of the query it served."""

    @classmethod
    def class_name(cls) -> str:
        return "SnapKVResponseMetadataHandler"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, QueryStartEvent):
            _open_queries.set((*_open_queries.get(), []))
        elif isinstance(event, (LLMCompletionEndEvent, LLMChatEndEvent)):
            extra = getattr(event.response, "additional_kwargs", None) or {}
            if "compression" in extra and "citations" in extra:  # one of ours
                call = {key: extra[key] for key in KEYS if key in extra}
                for calls in _open_queries.get():  # nested queries (sub-questions) count in their parents too
                    calls.append(call)
        elif isinstance(event, QueryEndEvent):
            stack = _open_queries.get()
            if not stack:
                return
            calls = stack[-1]
            _open_queries.set(stack[:-1])
            metadata = getattr(event.response, "metadata", None)
            if calls and (metadata is None or isinstance(metadata, dict)):
                last = calls[-1]
                figures = {
                    "citations": last.get("citations", []),
                    "compression": last.get("compression"),
                    "calls": calls,
                }
                event.response.metadata = {**(metadata or {}), "snapkv": figures}


def register() -> ResponseMetadataHandler:
    """Add the handler to LlamaIndex's root dispatcher (once per process) and return it."""
    global _handler
    with _registered:
        if _handler is None:
            _handler = ResponseMetadataHandler()
            get_dispatcher().add_event_handler(_handler)
    return _handler
