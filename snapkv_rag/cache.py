"""The prompt's side of the cache: layer kinds, and one request's compressed prompt cache as a value.

- ``full``: full attention: the kept prompt positions (all of them, or what a method selected).
- ``sliding``: a sliding-window layer (window ``W``: a query at position ``p`` sees ``p - W < k <= p``).
  After the prompt it can only ever see the last ``W - 1`` prompt positions, so that is its share;
  a method compresses inside that share when it exceeds the budget. A window longer than the
  prompt makes it a full layer for the prompt; positions leaving the window while decoding are
  masked out (:mod:`snapkv_rag.slots`).
- ``recurrent``: linear-attention / recurrent state (Qwen3-Next): transformers' own layer object,
  passed through untouched.
- ``latent``: multi-head latent attention (DeepSeek-V2/V3): compressed like a full layer, with one
  selection shared by all heads.

A prompt runs through a :class:`PromptCache`; inside ``with compressing(cache, methods, lengths)``
every attention layer, right after its attention over the prompt, is compressed into one
:class:`Compressed` per (method, row) and its full K/V dropped, so at most one layer's full K/V is
alive at a time and several methods share one prefill. A :class:`Compressed` is a plain value (per
layer the kept K/V and their original positions): a request joins a decode batch by having it
written into a free row of the slot cache.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from . import compression
from .config import RandomConfig

FULL, SLIDING, RECURRENT, LATENT = "full", "sliding", "recurrent", "latent"


@dataclass(frozen=True)
class LayerSpec:
    kind: str
    window: int | None = None  # sliding layers: the attention window W


class UnsupportedModelError(ValueError):
    """The model has a layer kind this cache does not handle; the message names the model type."""


def layer_specs(config) -> list[LayerSpec]:
    """The kind of every decoder layer of a model, read from the cache transformers itself builds
    for that config (so it follows the installed version's own rules)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", type(config).__name__)
    types = getattr(text, "layer_types", None) or []
    odd = sorted({t for t in types if t not in ("full_attention", "sliding_attention", "linear_attention")})
    if odd:
        raise UnsupportedModelError(
            f"model type {model_type!r} has {', '.join(odd)} layers; snapkv-rag supports full attention, sliding "
            "window attention and linear-attention (recurrent) layers")
    layers = list(DynamicCache(config=config).layers)
    count = text.num_hidden_layers
    specs = []
    for i in range(count):
        layer = layers[i] if i < len(layers) else DynamicLayer()
        if isinstance(layer, DynamicSlidingWindowLayer):
            specs.append(LayerSpec(SLIDING, int(layer.sliding_window)))
        elif type(layer) is DynamicLayer:
            specs.append(LayerSpec(LATENT if getattr(text, "kv_lora_rank", None) else FULL))
        elif "LinearAttention" in type(layer).__name__ and not isinstance(layer, DynamicLayer):
            specs.append(LayerSpec(RECURRENT))
        else:
            raise UnsupportedModelError(
                f"model type {model_type!r}: layer {i} uses a {type(layer).__name__} cache; snapkv-rag supports full "
                "attention, sliding window attention and linear-attention (recurrent) layers")
    return specs


@dataclass
class LayerKV:
    """One attention layer of one request's compressed prompt: ``keys``/``values`` ``[1, H_kv, n, D]``
    and the original prompt position of each slot, ``positions`` ``[1, H_kv, n]``."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    @property
    def slots(self) -> int:
        return self.keys.shape[-2]


@dataclass
class Compressed:
    """One request's compressed prompt cache under one method (``None``: the full cache): per layer a
    :class:`LayerKV`, or a recurrent layer's transformers state object."""

    method: Any
    specs: list[LayerSpec]
    layers: list[Any]
    prompt_tokens: int
    selection_s: float = 0.0

    def kept_tokens(self) -> list[int]:
        """Prompt positions held per layer (a recurrent layer's fixed-size state summarises the whole
        prompt: reported as the prompt length)."""
        return [layer.slots if isinstance(layer, LayerKV) else self.prompt_tokens for layer in self.layers]

    def kept_positions(self) -> dict[int, torch.Tensor]:
        """Per attention layer, the prompt positions ``[1, H_kv, n]`` it holds."""
        return {i: layer.positions for i, layer in enumerate(self.layers) if isinstance(layer, LayerKV)}

    def kv_bytes(self) -> tuple[int, int]:
        """(bytes the full cache holds for the prompt, bytes this one holds), over attention layers."""
        full = kept = 0
        for spec, layer in zip(self.specs, self.layers):
            if isinstance(layer, LayerKV):
                per_token = layer.keys.shape[1] * (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
                full += per_token * (self.prompt_tokens if spec.window is None else min(self.prompt_tokens, spec.window - 1))
                kept += per_token * layer.slots
        return full, kept


class PromptLayer(DynamicLayer):
    """An attention layer while the prompt runs: the attention sees the prompt's K/V whole; they are
    kept only until :func:`compressing`'s hook has compressed them."""

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.is_sliding = spec.kind == SLIDING
        self.sliding_window = spec.window
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.done = False

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized, self.device = True, key_states.device
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.pending is None else self.pending[0].shape[-2]

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        return (query_length if isinstance(query_length, int) else query_length.shape[-1]), 0

    def get_max_length(self) -> int:
        return -1


class PromptCache(DynamicCache):
    """The cache a prompt's forward pass runs with. Subclasses transformers' ``DynamicCache`` only so
    that the model's own code (mask sizes, recurrent-state accessors) finds what it calls."""

    def __init__(self, model_config, specs: list[LayerSpec]):
        super().__init__(config=model_config)
        layers = list(self.layers) + [None] * (len(specs) - len(self.layers))
        self.layers = [layer if spec.kind == RECURRENT else PromptLayer(spec) for spec, layer in zip(specs, layers)]
        self.layer_class_to_replicate = None
        self.specs = specs
        self.compress: Any = None  # set inside compressing(): called after each layer's attention


@dataclass
class Scoring:
    """How a layer's attention turns logits into weights: what the votes must use too."""

    scale: float | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def as_kwargs(self) -> dict:
        return {"scale": self.scale, "softcap": self.softcap, "sinks": self.sinks}


@dataclass
class _Compressor:
    cache: PromptCache
    methods: dict[str, Any]
    lengths: list[int]
    out: dict[str, list[Compressed]] = field(default_factory=dict)

    def __call__(self, layer_idx: int, query: torch.Tensor, vote_keys: torch.Tensor, scoring: Scoring) -> None:
        layer = self.cache.layers[layer_idx]
        keys, values = layer.pending
        for name, method in self.methods.items():
            begin = _clock(keys)
            rows = compress_layer(method, layer.spec, layer_idx, len(self.cache.specs), query, keys, values, vote_keys,
                                  scoring, self.lengths)
            for compressed, kv in zip(self.out[name], rows):
                compressed.layers[layer_idx] = kv
                compressed.selection_s += _clock(keys) - begin
        layer.pending, layer.done = None, True


@contextlib.contextmanager
def compressing(cache: PromptCache, methods: Mapping[str, Any], lengths: list[int]) -> Iterator[dict[str, list[Compressed]]]:
    """While open, the forward pass of a prompt of rows with ``lengths`` real tokens (left padded) run
    with ``cache`` compresses every attention layer right after its attention, once per method of
    ``methods`` (name -> config, ``None`` for the full cache). Yields name -> one :class:`Compressed`
    per row, complete when the block ends (recurrent layers: each gets its own copy of the state)."""
    if not methods:
        raise ValueError("compression: give at least one method")
    compressor = _Compressor(cache, dict(methods), list(lengths))
    for name, method in compressor.methods.items():
        compressor.out[name] = [Compressed(method, cache.specs, [None] * len(cache.specs), real) for real in lengths]
    cache.compress = compressor
    try:
        yield compressor.out
    finally:
        cache.compress = None
    missed = [i for i, layer in enumerate(cache.layers) if isinstance(layer, PromptLayer) and not layer.done]
    if missed:
        raise UnsupportedModelError(
            f"layers {missed} never called the registered attention function with our cache: this model's code "
            "does not pass attention keyword arguments through, so snapkv-rag cannot compress it")
    recurrent = [i for i, spec in enumerate(cache.specs) if spec.kind == RECURRENT]
    if recurrent and len(lengths) > 1:
        raise ValueError("a prompt batch of a model with recurrent layers: prefill one prompt at a time")
    copies = [c for per_row in compressor.out.values() for c in per_row]
    for n, compressed in enumerate(copies):
        for i in recurrent:  # the last one takes the state itself, the others a copy
            compressed.layers[i] = cache.layers[i] if n == len(copies) - 1 else copy.deepcopy(cache.layers[i])


def compress_layer(method, spec: LayerSpec, layer_idx: int, num_layers: int, query: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, vote_keys: torch.Tensor, scoring: Scoring, lengths: list[int]) -> list[LayerKV]:
    """One layer's kept K/V per row under ``method``, from the prompt's ``keys``/``values`` ``[B, H_kv, L, D]``.

    Each row is selected in its own coordinates (a padded row alone, without its pads), so that a
    request keeps the same positions in a batch as alone. ``query`` is ``[B, H, L, D]`` and
    ``vote_keys`` the keys the attention used: the cached keys themselves, except for multi-head
    latent attention, which expands one latent into per-head keys; there one selection is shared
    by all heads, from their votes averaged.
    """
    latent = vote_keys.shape != keys.shape
    length = keys.shape[-2]
    starts = [length - (real if spec.window is None else min(real, spec.window - 1)) for real in lengths]
    # rows of equal length select together; otherwise (and for the seeded random baseline, whose
    # draws depend on the batch shape) each row alone
    uniform = len(set(lengths)) == 1 and not isinstance(method, RandomConfig)
    groups = [(slice(None), starts[0])] if uniform else [(slice(b, b + 1), starts[b]) for b in range(len(lengths))]
    out = []
    for rows, start in groups:
        k, v, q = keys[rows, :, start:], values[rows, :, start:], query[rows, :, start:]
        if method is None or k.shape[-2] == 0:
            kept = torch.arange(k.shape[-2], device=k.device).expand(k.shape[0], k.shape[1], -1)
        elif latent:
            voters = vote_keys[rows, :, start:]
            kept = compression.select(method, q, voters, voters, None, layer_idx, num_layers, shared=True,
                                      **scoring.as_kwargs())[2][:, :1].expand(k.shape[0], k.shape[1], -1)
            k, v = compression.gather_positions(k, kept), compression.gather_positions(v, kept)
        else:
            k, v, kept = compression.select(method, q, k, v, None, layer_idx, num_layers, **scoring.as_kwargs())
        out += [LayerKV(k[b:b + 1], v[b:b + 1], kept[b:b + 1] + start) for b in range(k.shape[0])]
    return [LayerKV(kv.keys, kv.values, kv.positions - (length - real)) for kv, real in zip(out, lengths)]


def _clock(tensor: torch.Tensor) -> float:
    """``perf_counter`` once the device has finished the work queued so far (selection time is a
    prefill figure, outside any decode step: on CUDA an unsynchronised clock would time launches)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()
