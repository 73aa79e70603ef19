"""Stored compressed document sets in the server: a request whose method is query-agnostic
(``keynorm``, ``kvzip``, or the server's default when it is one) and whose prompt is one question
over documents runs over the engine's stored cache of those documents under that method
(:mod:`snapkv_rag.documents.store`): the first such request over a document set compresses the
instruction + documents once (a miss), every later one with the same documents, in the same order,
and the same method prefills only its question (a hit). Counted in ``/metrics`` as
``snapkv_rag_doc_store_*``. A conversation with earlier turns or a system message, tools,
``cite``, a query-aware method, a model the store does not support, or ``--doc-store-bytes 0``:
the request runs as before (its own prefill and selection)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from ..documents import store as doc_store
from ..documents import stored
from .protocol import Call


def eligible(llm, call: Call) -> bool:
    method = call.options["snapkv"] if "snapkv" in call.options else llm.default_snapkv
    single = isinstance(call.prompt, str) or (len(call.prompt) == 1 and call.prompt[0].get("role") == "user")
    return (
        bool(call.documents)
        and single
        and call.tools is None
        and stored.storable(method)
        and call.options.get("cite", "text") == "text"
        and llm.doc_store.max_bytes > 0
        and doc_store.unsupported(llm) is None
    )


async def over_stored(llm, call: Call) -> Call:
    """``call`` over the stored cache of its documents (compressed now on a miss, in a worker
    thread), or ``call`` as it is when it is not eligible."""
    if not eligible(llm, call):
        return call
    method = call.options["snapkv"] if "snapkv" in call.options else llm.default_snapkv
    try:
        handle = await asyncio.to_thread(llm.index_documents, call.documents, method)
    except ValueError:  # documents the store cannot take (no question boundary found): as before
        return call
    options = {k: v for k, v in call.options.items() if k != "snapkv"}
    return replace(call, documents=handle, options=options)
