"""What each decoder layer of a model keeps per request, read from the cache transformers builds for
its config: the one place that decides which models the engine runs and refuses the others.

Kinds:

- ``full`` / ``sliding`` / ``latent``: attention with a per-token K/V cache (``latent``: multi-head
  latent attention, one latent per token for all heads). These are what SnapKV compresses.
- ``recurrent``: a fixed-size state, no per-token K/V: the SSM and conv states of Mamba layers
  (Bamba, Granite 4, Jamba, Nemotron-H, Zamba), linear attention (Qwen3-Next), LFM2's short
  convolutions. Passed through untouched.
- ``none``: nothing cached (Nemotron-H's MLP and MoE layers). Passed through.

An attention kind with ``state=True`` is a hybrid layer: attention and a Mamba state in one layer
(Falcon-H1's parallel attention + Mamba, Zamba's shared transformer block before its Mamba layer).
Its attention part is compressed exactly as a plain attention layer; its state is passed through.

Refused, with the model type and the reason, when the engine is built (never at the first forward):
layer kinds the cache does not hold (chunked or indexed attention), layers that read another layer's
K/V (Gemma 3n's shared KV), and models that accept only a cache class of their own (MiniMax).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import transformers
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

FULL, SLIDING, RECURRENT, LATENT, NONE = "full", "sliding", "recurrent", "latent", "none"
ATTENTION_KINDS = (FULL, SLIDING, LATENT)

# layer type names (config ``layer_types``) whose cache layers are read below
_KNOWN_TYPES = (
    "full_attention",
    "sliding_attention",
    "linear_attention",
    "conv",
    "hybrid",
    "hybrid_sliding",
    "mlp",
    "moe",
)
_SUPPORTED = (
    "full attention, sliding window attention, multi-head latent attention, recurrent / conv state "
    "layers (Mamba, linear attention, short convolutions), hybrid attention + Mamba layers and "
    "MLP-only layers"
)


ONE_PASS_FROM = Version("5.17")
"""The transformers version from which a multi-token pass over a cache is known to continue the stored
recurrent states (the conv input after the stored one, the SSM scan from the stored state)."""
ONE_PASS = Version(Version(transformers.__version__).base_version) >= ONE_PASS_FROM

STATE_RESTARTS = {
    "jamba": "Jamba's Mamba layers start the SSM scan of a multi-token pass from zeros, not from the cached "
    "state (transformers' modeling_jamba: only a one-token step continues it)",
}
"""Model types whose modeling code, on the installed transformers, does not continue a cached recurrent
state through a multi-token pass, with the reason. Checked against a token-by-token continuation for
every hybrid family the tests build (``tests/test_split_prefill.py``), so that a transformers release
that changes either way fails there."""


@dataclass(frozen=True)
class LayerSpec:
    kind: str
    window: int | None = None  # sliding layers: the attention window W
    state: bool = False  # the layer also holds a recurrent / conv state (always for ``recurrent``)

    @property
    def attends(self) -> bool:
        """Whether the layer caches per-token K/V (the part a compression method selects from)."""
        return self.kind in ATTENTION_KINDS


class UnsupportedModelError(ValueError):
    """The model has a layer kind this cache does not handle; the message names the model type."""


def layer_specs(config, model=None) -> list[LayerSpec]:
    """The kind of every decoder layer of a model, read from the cache transformers itself builds
    for that config (so it follows the installed version's own rules). With ``model``, also refuse
    a model whose own code accepts no cache but its own class."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", type(config).__name__)
    if model is not None:
        _refuse_own_cache(model, model_type)
    types = list(getattr(text, "layer_types", None) or [])
    odd = sorted({t for t in types if t not in _KNOWN_TYPES})
    if odd:
        raise UnsupportedModelError(
            f"model type {model_type!r} has {', '.join(odd)} layers; snapkv-rag supports {_SUPPORTED}"
        )
    if "reuse" in (getattr(text, "kv_sharing_modes", None) or []) or getattr(text, "num_kv_shared_layers", 0):
        raise UnsupportedModelError(
            f"model type {model_type!r} has layers that attend over another layer's K/V "
            f"(shared KV); snapkv-rag supports {_SUPPORTED}"
        )
    layers = list(DynamicCache(config=config).layers)
    return [
        LayerSpec(NONE)
        if i < len(types) and types[i] in ("mlp", "moe")  # (older 5.x: a state layer, left empty)
        else _spec(layers[i] if i < len(layers) else DynamicLayer(), text, model_type, i)
        for i in range(text.num_hidden_layers)
    ]


def state_break(config, specs: list[LayerSpec]) -> str | None:
    """Why a multi-token pass over a cache would not continue this model's recurrent / conv states, so
    that a prompt must not be prefilled in pieces (``None``: it has no such state, or continues it). One
    place for every path that splits a prompt: the prefix cache, a question over a stored document set,
    lookahead's draft."""
    if not any(spec.state for spec in specs):
        return None
    model_type = getattr(config, "model_type", type(config).__name__)
    if model_type in STATE_RESTARTS:
        return STATE_RESTARTS[model_type]
    if not ONE_PASS:
        return (
            f"transformers {transformers.__version__} is not known to continue a recurrent state through a "
            f"multi-token pass (checked from {ONE_PASS_FROM})"
        )
    return None


def _spec(layer, text, model_type: str, index: int) -> LayerSpec:
    """One layer's kind from the class of transformers' own cache layer for it."""
    name = type(layer).__name__
    stateful = "LinearAttention" in name  # transformers' recurrent / conv state layers, alone or with attention
    if name == "DummyLayer":
        return LayerSpec(NONE)
    if isinstance(layer, DynamicSlidingWindowLayer):
        return LayerSpec(SLIDING, int(layer.sliding_window), state=stateful)
    if type(layer) is DynamicLayer or (stateful and isinstance(layer, DynamicLayer)):
        return LayerSpec(LATENT if getattr(text, "kv_lora_rank", None) else FULL, state=stateful)
    if stateful and not isinstance(layer, DynamicLayer):
        return LayerSpec(RECURRENT, state=True)
    raise UnsupportedModelError(
        f"model type {model_type!r}: layer {index} uses a {name} cache; snapkv-rag supports {_SUPPORTED}"
    )


def _refuse_own_cache(model, model_type: str) -> None:
    """A model whose modeling code defines a cache class of its own (MiniMax: ``MiniMaxCache``, which
    keeps the linear-attention state outside the cache layers) refuses any other cache at its first
    forward; say so now instead."""
    module = sys.modules.get(type(model).__module__)
    own = (
        sorted(
            name
            for name, value in vars(module).items()
            if isinstance(value, type) and issubclass(value, Cache) and value.__module__ == module.__name__
        )
        if module is not None
        else []
    )
    if own:
        raise UnsupportedModelError(
            f"model type {model_type!r} accepts only its own cache class ({', '.join(own)}), which keeps the model's "
            "recurrent state outside the per-layer cache; snapkv-rag's cache cannot stand in for it, so this model is "
            "not supported"
        )
