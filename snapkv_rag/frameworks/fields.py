"""The engine fields both framework adapters declare, written once (a pydantic mixin: LangChain and
LlamaIndex models are pydantic models). Imported by the integrations only, which bring pydantic."""

from __future__ import annotations

import weakref
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from .shared import LOADING_DEFAULTS, Lease, engine_from


class EngineSpec(BaseModel):
    """The engine's own parameters, or an existing ``engine`` to share one loaded model, plus the
    sampling options every call inherits (a call's own value wins; ``None``: the engine's default).

    Adapters that give the same loading parameters share one loaded engine (LangChain and LlamaIndex
    ones alike), so a second instance of a model is instant; each call sends its own instance's
    options. :meth:`close`, or the last holder being garbage-collected, releases it (see
    :class:`snapkv_rag.frameworks.shared.Lease`). An ``engine=`` given is the caller's to close."""

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    engine: Any = Field(default=None, exclude=True)
    """An already loaded :class:`snapkv_rag.SnapKVLLM`; built from the fields below when omitted."""
    model: Any = None
    """A model folder, ``.gguf`` file, hub id or loaded transformers model; ``None``: the embedded
    SmolLM2-135M-Instruct."""
    tokenizer: Any = Field(default=None, exclude=True)
    device: str | None = None
    dtype: Any = None
    attn_implementation: str | None = None
    """``None``: sdpa where the model supports it, else eager."""
    instruction: str | None = None
    """The citing instruction placed before the question (``None``: the engine's default)."""
    trust_remote_code: bool = False
    quantize: str | None = None
    """``"int8"`` or ``"int4"``: the loaded model's linear layers quantized
    (:mod:`snapkv_rag.models.quantize`); ``None``: as loaded (a model quantized by transformers'
    ``quantization_config`` runs as it is)."""
    kv_dtype: str | None = None
    """``"int8"`` (or ``"fp8"`` on CUDA): the compressed cache kept in 8 bits after selection
    (:mod:`snapkv_rag.kv.quantized`); ``None``: the model's dtype."""
    snapkv: Any = None
    """A compression config (``SnapKVConfig(...)``), ``False`` for the full cache, or ``None`` to
    keep the engine's default (lookahead SnapKV drafting 4 tokens, at half of each prompt, never below 512 tokens:
    :data:`snapkv_rag.methods.DEFAULT_COMPRESSION`)."""
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None

    _lease: Lease | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _attach_engine(self):
        self.engine, self._lease = engine_from(self.engine, **{name: getattr(self, name) for name in LOADING_DEFAULTS})
        if self._lease is not None:
            weakref.finalize(self, self._lease.release)
        return self

    def close(self) -> None:
        """Release the shared engine now (closed at once if no other adapter holds it); the instance
        is not to be used afterwards. An ``engine=`` given is left to its owner."""
        if self._lease is not None:
            self._lease.release(now=True)
