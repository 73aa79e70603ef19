"""One stored compressed document prefix as a value (:class:`Stored`), and what names it: the method
(query-agnostic only, as JSON in files), the model's and tokenizer's identity, the library version and
the key they make. Shared by the store (:mod:`snapkv_rag.documents.store`) and its files
(:mod:`snapkv_rag.documents.files`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from ..kv import prefix_cache, quantized, ragged, tails
from ..kv.prompt_cache import LayerKV
from ..kv.ragged import PackedKV
from ..methods import METHODS, KeyNormConfig
from ..methods.registry import by_class_name
from ..request.prompts import Document


def storable(method: Any) -> bool:
    """Whether a compressed cache of ``method`` may be stored and asked many questions: its selection
    never looks at the question (``method.query_agnostic``), or it keeps everything (``None``)."""
    return method is None or bool(getattr(method, "query_agnostic", False))


def _storable_names() -> str:
    return ", ".join(cls.__name__ for cls in METHODS.values() if cls.query_agnostic)


def check_method(method: Any):
    """The store's method from what a caller gives: a query-agnostic config, a fraction (key-norm
    at that ratio) or ``None`` (the prefix kept whole)."""
    if isinstance(method, float) and not isinstance(method, bool):
        return KeyNormConfig(ratio=method)
    if storable(method):
        return method
    name = getattr(method, "method", type(method).__name__)
    raise ValueError(
        f"method: {name} chooses what to keep from the question's attention, so its cache fits "
        f"one question only; a stored document cache needs a query-agnostic method: {_storable_names()}, "
        "a fraction (key-norm at that ratio) or None"
    )


def method_json(method) -> dict | None:
    """A method config as JSON (its class and fields): part of the key and of a saved file."""
    return None if method is None else {"class": type(method).__name__, **dataclasses.asdict(method)}


def method_from_json(data: dict | None):
    if data is None:
        return None
    fields = dict(data)
    cls = by_class_name(fields.pop("class", None))
    if cls is None or not cls.query_agnostic:
        raise ValueError(f"method: {data.get('class')!r} is not a query-agnostic method of this library")
    return cls(**fields)


def _library_version() -> str:
    """The installed snapkv-rag's version, from the package metadata (saved with every document set)."""
    try:
        return metadata.version("snapkv-rag")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each engine's identity, computed once (it hashes weights and the vocabulary), gone with the engine."""


def identity(llm) -> dict:
    """What a stored cache is valid for: the model (name, config, a fingerprint of its first and last
    weights, dtype), the tokenizer (vocabulary, chat template), the library version and, when the
    engine keeps an 8-bit cache, its ``kv_dtype`` (absent otherwise, so keys made without one stay
    as they were)."""
    cached = _IDENTITIES.get(llm)
    if cached is None:
        config = llm.model.config.to_dict()
        config.pop("_name_or_path", None)
        tok = llm.tokenizer
        vocab = sorted(tok.get_vocab().items()) if hasattr(tok, "get_vocab") else []
        params = (next(llm.model.parameters()), list(llm.model.parameters())[-1])
        weights = hashlib.sha256(b"".join(p.detach().flatten()[:4096].float().cpu().numpy().tobytes() for p in params))
        cached = {
            "model": str(llm.model_name),
            "model_hash": _digest([config, weights.hexdigest()]),
            "dtype": str(next(llm.model.parameters()).dtype).removeprefix("torch."),
            "tokenizer_hash": _digest([vocab, getattr(tok, "chat_template", None)]),
            "library": _library_version(),
        }
        kv_dtype = getattr(getattr(llm, "runner", None), "kv_dtype", None)
        if kv_dtype is not None:  # an 8-bit kept cache (kv.quantized): its own entries and files
            cached["kv_dtype"] = kv_dtype
        _IDENTITIES[llm] = cached
    return cached


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def entry_key(ident: dict, method, ids: Sequence[int]) -> str:
    return _digest([ident, method_json(method), list(ids)])


def documents_hash(documents: Sequence[Document]) -> str:
    return _digest([[d.text, d.title, d.id] for d in documents])


@dataclass(frozen=True)
class Stored:
    """One stored compressed prefix: its token ids, per layer its kept keys, values and original
    positions packed without padding (:class:`~snapkv_rag.kv.ragged.PackedKV`; ``None`` for an MLP-only
    layer), the method that chose them and what built it. Make one with :meth:`of`."""

    key: str
    ids: tuple[int, ...]
    packed: tuple[PackedKV | None, ...]
    method: Any
    documents: tuple[Document, ...]
    instruction: str
    states: tuple = ()  # per layer its conv / SSM state after the prefix (None: none); () without any

    @classmethod
    def of(cls, key: str, ids: Sequence[int], layers: Sequence, method, documents, instruction: str):
        """From a prefill's compressed layers (ragged heads padded, as a prefill leaves them; a
        recurrent layer's state object, a hybrid layer's state beside its K/V)."""
        states = tails.held_states(layers)
        return cls(
            key,
            tuple(ids),
            tuple(ragged.pack(kv) if isinstance(kv, LayerKV) else None for kv in layers),
            method,
            tuple(documents),
            instruction,
            states if any(s is not None for s in states) else (),
        )

    @property
    def layers(self) -> tuple[LayerKV | None, ...]:
        """The layers padded again, as a prefill over them needs them (a copy at each call)."""
        return tuple(None if p is None else ragged.unpack(p) for p in self.packed)

    def prefix(self, layers: Sequence | None = None) -> prefix_cache.Prefix:
        """What a prefill over this entry starts from: its ids and layers (``layers``: those of
        :attr:`layers`, already unpacked), padded and in floats (a copy)."""
        layers = self.layers if layers is None else layers
        return prefix_cache.Prefix(self.ids, tuple(None if kv is None else kv.floats() for kv in layers))

    @property
    def kv_dtype(self) -> str | None:
        """How the kept K/V are stored (``None``: floats; see :mod:`snapkv_rag.kv.quantized`)."""
        layer = next((p if p.padded is None else p.padded for p in self.packed if p is not None), None)
        return None if layer is None or layer.key_scale is None else quantized.kind_of(layer.keys.dtype)

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def config(self):
        """The method with its budget in tokens for this prefix (a ``ratio`` resolved)."""
        return self.method and self.method.for_prompt(self.length)

    def kv_bytes(self) -> tuple[int, int]:
        """(bytes the full cache of the prefix holds, bytes of the kept keys + values), both as
        stored (under a ``kv_dtype``: 8-bit, with their scales)."""
        full = kept = 0
        for p in self.packed:
            if p is not None:
                full += p.slot_bytes * self.length
                kept += p.kept_bytes
        return full, kept

    @property
    def nbytes(self) -> int:
        """Every tensor held (positions included): what the store's bound counts."""
        return sum(p.nbytes for p in self.packed if p is not None) + sum(map(prefix_cache.state_bytes, self.states))
