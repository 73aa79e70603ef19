"""A compressed document cache store: compress a document set once, answer many questions over it.

    docs = llm.index_documents(documents, method=KeyNormConfig(ratio=0.5))   # one prefill + selection
    docs.generate("Who wrote it?")            # == llm.generate("Who wrote it?", docs): the tail only
    docs.save("docs.safetensors"); llm.load_documents("docs.safetensors")

What is stored: the prompt's tokens before its question (chat template head, documents,
instruction: the prefix the document prefix cache also cuts at, :func:`snapkv_rag.kv.prefix_cache.boundary`)
compressed by a *query-agnostic* method (:func:`snapkv_rag.documents.stored.storable`): per attention layer the kept keys,
values and their original positions. A question over the handle prefills only the tail (``"Question:
..."`` and the chat template's end) on top of the kept K/V, at the positions it has in the whole
prompt (the cache's positions go on from the uncompressed length, as every compressed row's do), and
the tail is kept whole; then it decodes like any compressed request. SnapKV and the other
query-aware methods are refused: what they keep is chosen by the question's attention, so a cache
kept for one question is the wrong one for the next.

The tail's K/V are computed over the kept document tokens only, so answers match a whole-prompt
run exactly when nothing was dropped (a budget that keeps the whole prefix), and otherwise are the
answers of that reused cache (the cost the follow-up evaluation measures).

The store is an LRU bounded by bytes (``doc_store_bytes``, default 1 GiB), keyed by the model's
identity (name, config, dtype), the tokenizer's, the library version, the method with its settings,
and the prefix's token ids (which the documents, the instruction and the chat template give). An
entry leaves only by LRU eviction (counted in :meth:`DocStore.stats`); a handle whose entry left is
indexed again on its next use (counted as a miss). Files: :mod:`snapkv_rag.documents.files`; the
store kept in a folder too (``doc_store_dir``, read back after a restart): :mod:`snapkv_rag.documents.folder`.
Full and sliding-window attention layers (a sliding layer's tail sees what lies inside each query's
window), multi-head latent attention (the kept latents, one selection for every head), and recurrent
and hybrid layers: their conv / SSM states after the prefix are stored beside the K/V (whole: a
state is not per token), and a tail over them runs one token per step (:mod:`snapkv_rag.kv.tails`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..kv import prefix_cache
from ..kv.lru import ByteLRU
from ..models.layer_kinds import FULL, LATENT, NONE, RECURRENT, SLIDING
from ..request.prompts import DocumentLike
from .files import load, save
from .folder import DocFolder
from .stored import Stored, check_method, entry_key, identity

DEFAULT_BYTES = 1 << 30
PLACEHOLDER = "?"  # the question the prefix is cut from (the prefix ends before it)


class DocStoreStats(prefix_cache.PrefixStats):
    """Counters of a :class:`DocStore` (a snapshot): a hit is a question answered from a stored
    cache, ``tokens_saved`` the prefix tokens those questions did not prefill, a miss a document
    set compressed because the store did not hold it (first indexing, or after its eviction)."""


class DocStore:
    """A byte-bounded LRU of :class:`Stored` entries by key; ``max_bytes`` 0 keeps nothing (a handle
    then holds its own entry, outside any bound)."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES, folder: DocFolder | None = None):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"doc_store_bytes: must be a number of bytes >= 0 (0: nothing kept), got {max_bytes!r}")
        self.max_bytes, self.folder = max_bytes, folder
        self._lru = ByteLRU(max_bytes, lambda entry: entry.nbytes)
        self._lock = threading.Lock()
        self._counts = DocStoreStats()

    def get(self, key: str) -> Stored | None:
        """The entry of ``key`` (then the most recently used), or ``None``; counts nothing."""
        with self._lock:
            return self._lru.get(key)

    def used(self, entry: Stored):
        """Count a question answered from ``entry``; returns the method it runs (the entry's)."""
        if not isinstance(
            entry, Stored
        ):  # a stitched prompt (:mod:`snapkv_rag.documents.stitch`): its own store counts
            return entry.config
        with self._lock:
            self._counts.hits += 1
            self._counts.tokens_saved += entry.length
        return entry.config

    def missed(self) -> None:
        with self._lock:
            self._counts.misses += 1

    def put(self, entry: Stored) -> bool:
        """Keep ``entry``, evicting least recently used entries until it fits (each counted); an
        entry larger than the whole store is not kept. A key already held keeps its entry (equal keys:
        equal contents)."""
        with self._lock:
            return self._lru.get(entry.key) is not None or self._lru.put(entry.key, entry)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._lru.entries)

    def stats(self) -> DocStoreStats:
        with self._lock:
            return self._counts.snapshot(self._lru)


def unsupported(llm) -> str | None:
    """Why ``llm``'s model cannot answer from a stored cache (``None``: it can)."""
    for i, spec in enumerate(llm.runner.specs):
        if spec.kind not in (FULL, SLIDING, LATENT, NONE, RECURRENT):
            return (
                f"layer {i} of {type(llm.model).__name__} is {spec.kind}: a stored document cache holds "
                "full, sliding-window and latent attention layers and recurrent states only"
            )
    return None


class DocumentHandle:
    """What can stand for ``documents`` in a request (``llm`` and ``documents``): it binds the request
    built over its documents to the cache it runs on (:meth:`bind_request`)."""

    llm: Any
    documents: list

    def bind_request(self, request):
        raise NotImplementedError

    def generate(self, question: str, **options):
        return self.llm.generate(question, self, **options)

    def stream(self, question: str, **options) -> Iterator[str]:
        return self.llm.stream(question, self, **options)

    def chat(self, messages, **options):
        return self.llm.chat(messages, self, **options)


class DocumentSet(DocumentHandle):
    """A handle on a stored compressed document set: what :meth:`SnapKVLLM.index_documents` returns.
    ``documents``, ``method``, ``prompt_tokens`` (the prefix's length), ``kept_bytes`` / ``full_bytes``
    (keys + values kept, and what the full cache would hold); ``generate``/``stream``/``chat`` ask
    over it (the same as ``llm.generate(question, handle)``); ``save(path)`` writes it to a file."""

    def __init__(self, llm, entry: Stored):
        self.llm, self.key = llm, entry.key
        self.documents, self.method, self.instruction = list(entry.documents), entry.method, entry.instruction
        self.prompt_tokens = entry.length
        self.full_bytes, self.kept_bytes = entry.kv_bytes()
        self._own = entry if llm.doc_store.max_bytes == 0 else None  # no store: the handle holds it

    def __repr__(self) -> str:
        name = getattr(self.method, "method", "full")
        return (
            f"DocumentSet({len(self.documents)} documents, {self.prompt_tokens} tokens, {name}, "
            f"{self.kept_bytes} of {self.full_bytes} bytes)"
        )

    def entry(self) -> Stored:
        """The stored entry (indexed again, and counted as a miss, if the store evicted it)."""
        if self._own is not None:
            return self._own
        found = self.llm.doc_store.get(self.key)
        if found is None:
            found = _read_or_build(self.llm, self.key, self.documents, self.method)
            self.llm.doc_store.put(found)
        return found

    def bind_request(self, request):
        """Its tokens before the question must be the stored ones."""
        entry = self.entry()
        if tuple(request.input_ids[: entry.length]) != entry.ids or len(request.input_ids) <= entry.length:
            raise ValueError(
                "documents: this prompt does not start with the stored documents' tokens (a conversation "
                "with earlier turns or a system message, or cite='json', changes what comes before the "
                "question); ask a single question over the handle, or index the documents for that prompt"
            )
        request.stored = entry
        return request

    def save(self, path, overwrite: bool = False) -> None:

        save(self.llm, self.entry(), path, overwrite)


def build(llm, documents: Sequence[DocumentLike], method) -> Stored:
    """Prefill the prefix of ``documents``' RAG prompt (the engine's instruction) once and
    compress it with ``method``."""
    why = unsupported(llm)
    if why is not None:
        raise ValueError(f"index_documents: {why}")
    request = llm.request(PLACEHOLDER, documents)
    if not request.documents:
        raise ValueError("documents: give at least one document to index")
    at = prefix_cache.boundary(request.input_ids, request.spans)
    if at is None:
        raise ValueError(
            "documents: the prompt's question could not be located (a tokenizer without "
            "offsets, or a chat template that rewrites the user turn)"
        )
    ids = request.input_ids[:at]
    if at + 16 > llm.context_window:
        raise ValueError(
            f"documents: the indexed prompt is {at} tokens, which leaves no room for a question and "
            f"an answer in the model's context window of {llm.context_window} tokens"
        )
    pre = llm.runner.prefill([ids], {"": method and method.for_prompt(len(ids))})
    layers = pre.compressed[""][0].layers
    return Stored.of(entry_key(identity(llm), method, ids), ids, layers, method, request.documents, llm.instruction)


def index(llm, documents: Sequence[DocumentLike], method) -> DocumentSet:
    """:meth:`SnapKVLLM.index_documents`: the stored entry of these documents under ``method``
    (built now unless the store holds it) and its handle."""
    method = check_method(method)
    probe = llm.request(PLACEHOLDER, documents)
    at = prefix_cache.boundary(probe.input_ids, probe.spans)
    key = at is not None and entry_key(identity(llm), method, probe.input_ids[:at])
    entry = (key and llm.doc_store.get(key)) or _read_or_build(llm, key, documents, method)
    llm.doc_store.put(entry)
    return DocumentSet(llm, entry)


def _read_or_build(llm, key: str | None, documents, method) -> Stored:
    """The entry of ``key`` from the store's folder (when it has one and the file is good), else
    built now (a miss) and written to the folder."""
    folder = llm.doc_store.folder
    found = folder.load(llm, key) if folder is not None and key else None
    if found is not None:
        return found
    llm.doc_store.missed()
    entry = build(llm, documents, method)
    if folder is not None:
        folder.save(llm, entry)
    return entry


def bind(request, handle):
    """``request`` (built over ``handle``'s documents) set to run on the handle's cache; without a
    handle, ``request`` as it is."""
    return handle.bind_request(request) if isinstance(handle, DocumentHandle) else request


def documents_of(llm, documents):
    """The documents of a handle of ``llm``'s (a handle of another engine: a clear error), or
    ``documents`` as they are."""
    if not isinstance(documents, DocumentHandle):
        return documents
    if documents.llm is not llm and identity(documents.llm) != identity(llm):
        raise ValueError(
            "documents: this document handle was made by another model or tokenizer "
            f"({identity(documents.llm)['model']}); index the documents with this engine"
        )
    return documents.documents


def check_options(options: dict, requests) -> None:
    """A request over a document handle runs the handle's method: a ``snapkv`` option is refused."""
    if "snapkv" in options and any(r.stored is not None for r in requests):
        raise ValueError(
            "snapkv: a question over a document handle runs the handle's cache (the method the documents "
            "were indexed with, or a stitched cache whole); leave snapkv out, or index the documents with "
            "the method you want"
        )


def load_set(llm, path) -> DocumentSet:
    """:meth:`SnapKVLLM.load_documents`: the set saved at ``path`` (checked against ``llm``), put in
    the store, and its handle."""
    entry = load(llm, path)
    llm.doc_store.put(entry)
    return DocumentSet(llm, entry)
