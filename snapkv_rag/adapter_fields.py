"""The engine fields both framework adapters declare, written once (a pydantic mixin: LangChain and
LlamaIndex models are pydantic models). Imported by the integrations only, which bring pydantic."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .adapters import LOADING_DEFAULTS, engine_from


class EngineSpec(BaseModel):
    """The engine's own parameters, or an existing ``engine`` to share one loaded model, plus the
    sampling options every call inherits (a call's own value wins; ``None``: the engine's default)."""

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
    snapkv: Any = None
    """A compression config (``SnapKVConfig(...)``), ``False`` for the full cache, or ``None`` to
    keep the engine's default (SnapKV)."""
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None

    @model_validator(mode="after")
    def _attach_engine(self):
        self.engine = engine_from(self.engine, self.snapkv, **{name: getattr(self, name) for name in LOADING_DEFAULTS})
        return self
