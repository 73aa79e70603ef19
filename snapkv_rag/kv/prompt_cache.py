"""The prompt's side of the cache: one request's compressed prompt cache as a value, per layer kind
(the kinds are read in :mod:`snapkv_rag.models.layer_kinds`, re-exported here).

- ``full``: full attention: the kept prompt positions (all of them, or what a method selected).
- ``sliding``: a sliding-window layer (window ``W``: a query at position ``p`` sees ``p - W < k <= p``).
  After the prompt it can only ever see the last ``W - 1`` prompt positions, so that is its share;
  a method compresses inside that share when it exceeds the budget. A window longer than the
  prompt makes it a full layer for the prompt; positions leaving the window while decoding are
  masked out (:mod:`snapkv_rag.kv.slot_cache`).
- ``recurrent``: linear-attention / Mamba / conv state (Qwen3-Next, Nemotron-H, LFM2): transformers'
  own layer object, passed through untouched; ``none`` (MLP / MoE-only layers): nothing held.
- an attention kind whose spec has ``state`` (Falcon-H1, Zamba): attention and a Mamba state in one
  layer; the attention part is compressed exactly like a plain layer of its kind and the state is
  carried beside it (:attr:`LayerKV.state`), as a recurrent layer's is.
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from ..methods import adaptive, selection, shared_budget
from ..models.layer_kinds import NONE, SLIDING, LayerSpec, UnsupportedModelError
from . import quantized


@dataclass
class LayerKV:
    """One attention layer of one request's compressed prompt: ``keys``/``values`` ``[1, H_kv, n, D]``
    and the original prompt position of each slot, ``positions`` ``[1, H_kv, n]``; for a hybrid layer
    also its conv / SSM ``state`` after the prompt (a transformers ``LinearAttentionLayer``, never
    quantized). Under a ``kv_dtype`` (:mod:`snapkv_rag.kv.quantized`) ``keys``/``values`` are 8-bit
    and ``key_scale``/``value_scale`` ``[1, H_kv, n, G]`` (the compute dtype) their scales, per
    token, head and group of channels; ``None`` for a layer held in floats."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    state: LinearAttentionLayer | None = None
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return self.keys.shape[-2]

    @property
    def kv_dtype(self) -> str | None:
        """``"int8"`` / ``"fp8"`` for a quantized layer, ``None`` for one in floats."""
        return None if self.key_scale is None else quantized.kind_of(self.keys.dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype attention reads it in (the scales' for a quantized layer)."""
        return self.keys.dtype if self.key_scale is None else self.key_scale.dtype

    def floats(self) -> LayerKV:
        """This layer in the compute dtype (itself when it is not quantized): for consumers that
        compute with the K/V (a prefill over a stored set)."""
        if self.key_scale is None:
            return self
        keys = quantized.dequantize(self.keys, self.key_scale)
        return LayerKV(keys, quantized.dequantize(self.values, self.value_scale), self.positions, self.state)

    def as_kv_dtype(self, kv_dtype: str | None, head: LayerKV | None = None) -> LayerKV:
        """This layer stored as ``kv_dtype`` (``None``: floats; itself when it already is).
        ``head``: a layer quantized before whose slots are this one's first (a stored set under a
        question's tail): its 8-bit tensors and scales are kept as they are, not quantized again."""
        if kv_dtype == self.kv_dtype:
            return self
        kv = self.floats()
        if kv_dtype is None:
            return kv
        (keys, key_scale), (values, value_scale) = (
            quantized.quantize(kv.keys, kv_dtype),
            quantized.quantize(kv.values, kv_dtype),
        )
        if head is not None and head.kv_dtype == kv_dtype:
            n = head.slots
            keys[..., :n, :], key_scale[..., :n, :] = head.keys, head.key_scale
            values[..., :n, :], value_scale[..., :n, :] = head.values, head.value_scale
        return LayerKV(keys, values, self.positions, self.state, key_scale, value_scale)

    def slot_bytes(self) -> int:
        """The bytes one slot (one position, every head) takes: keys and values, and their scales."""
        heads = self.keys.shape[1]
        size = heads * (
            self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()
        )
        if self.key_scale is not None:
            for scale in (self.key_scale, self.value_scale):
                size += heads * scale.shape[-1] * scale.element_size()
        return size


@dataclass
class Compressed:
    """One request's compressed prompt cache under one method (``None``: the full cache): per layer a
    :class:`LayerKV`, a recurrent layer's transformers state object, or ``None`` (an MLP-only layer)."""

    method: Any
    specs: list[LayerSpec]
    layers: list[Any]
    prompt_tokens: int
    selection_s: float = 0.0

    def kept_tokens(self) -> list[int]:
        """Prompt positions held per layer, which says which layers were compressed (a recurrent
        layer's fixed-size state summarises the whole prompt: reported as the prompt length; an
        MLP-only layer holds nothing: 0)."""
        return [
            layer.slots if isinstance(layer, LayerKV) else 0 if spec.kind == NONE else self.prompt_tokens
            for spec, layer in zip(self.specs, self.layers)
        ]

    @property
    def kv_dtype(self) -> str | None:
        """How its attention layers are stored (``None``: floats; see :mod:`snapkv_rag.kv.quantized`)."""
        return next((layer.kv_dtype for layer in self.layers if isinstance(layer, LayerKV)), None)

    def as_kv_dtype(self, kv_dtype: str | None, heads: Sequence | None = None) -> Compressed:
        """This cache with every attention layer stored as ``kv_dtype`` (itself when it already is;
        recurrent states stay as they are). ``heads``: per layer a quantized layer whose slots are
        the first ones here (:meth:`LayerKV.as_kv_dtype`)."""
        if all(not isinstance(layer, LayerKV) or layer.kv_dtype == kv_dtype for layer in self.layers):
            return self
        heads = heads or [None] * len(self.layers)
        layers = [
            layer.as_kv_dtype(kv_dtype, head if isinstance(head, LayerKV) else None)
            if isinstance(layer, LayerKV)
            else layer
            for layer, head in zip(self.layers, heads)
        ]
        return replace(self, layers=layers)

    def kept_positions(self) -> dict[int, torch.Tensor]:
        """Per attention layer, the prompt positions ``[1, H_kv, n]`` it holds."""
        return {i: layer.positions for i, layer in enumerate(self.layers) if isinstance(layer, LayerKV)}

    def kv_bytes(self) -> tuple[int, int]:
        """(bytes the full cache holds for the prompt, bytes this one holds), over attention layers, as
        a request's row of the slot cache holds them (:mod:`snapkv_rag.kv.slot_cache`): every layer as
        wide as the row's widest layer (a layer's heads padded to its widest head), so these are the
        bytes the cache occupies while it decodes, not fewer for a layer or head that keeps less.
        Both at this cache's storage: under a ``kv_dtype`` the 8-bit K/V and their scales (the full
        cache counted as the same engine would hold it, quantized too)."""
        per_token, widest, whole = 0, 0, 0
        for spec, layer in zip(self.specs, self.layers):
            if isinstance(layer, LayerKV):
                per_token += layer.slot_bytes()
                widest = max(widest, layer.slots)
                whole = max(
                    whole, self.prompt_tokens if spec.window is None else min(self.prompt_tokens, spec.window - 1)
                )
        return per_token * whole, per_token * widest


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
        self.prefix = None  # a cached prefix's layer (prefix_cache.PrefixLayer): the new tokens go on top
        self.prefix_length = 0  # the prompt positions that prefix stands for

    @property
    def before(self) -> int:
        """Prompt positions already held before this forward pass (a cached prefix's length)."""
        return 0 if self.prefix is None else self.prefix.keys.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized, self.device = True, key_states.device
        if self.prefix is not None:  # new tensors: the cached prefix is never written
            key_states = torch.cat([self.prefix.keys, key_states], dim=-2)
            value_states = torch.cat([self.prefix.values, value_states], dim=-2)
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.before if self.pending is None else self.pending[0].shape[-2]

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        return self.before + (query_length if isinstance(query_length, int) else query_length.shape[-1]), 0

    def get_max_length(self) -> int:
        return -1


class PromptHybridLayer(LinearAttentionLayer, PromptLayer):
    """A hybrid layer while the prompt runs (Falcon-H1's parallel attention + Mamba, Zamba's shared
    attention block before its Mamba layer): the attention part is a :class:`PromptLayer`; the conv /
    SSM states are written by transformers' own ``LinearAttentionLayer`` code (first in the MRO, so
    that its ``lazy_initialization`` is the one the state updates call)."""

    def __init__(self, spec: LayerSpec, number_of_states: int):
        PromptLayer.__init__(self, spec)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)


_STATE = (
    "conv_states",
    "recurrent_states",
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
    "conv_kernel_size",
    "dtype",
    "device",
)


def move_state(source: LinearAttentionLayer, target: LinearAttentionLayer) -> None:
    """Hand ``source``'s conv / SSM states (the tensors themselves, not copies) and their flags to
    ``target``: a hybrid layer's state goes from the prompt cache into a :class:`LayerKV`, and from
    there into the slot cache's layer, as a recurrent layer's state object does."""
    for name in _STATE:
        value = getattr(source, name)
        setattr(target, name, dict(value) if isinstance(value, dict) else value)


class LayerTrackingCache(DynamicCache):
    """transformers' ``DynamicCache`` that remembers the layer whose K/V ``update`` was called for
    last: the layer whose attention runs next. The attention function reads it instead of the
    module's ``layer_idx``, which Zamba's shared attention block does not have (one module, used at
    several layers, each with its own cache entry)."""

    attending = 0

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.attending = layer_idx
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class PromptCache(LayerTrackingCache):
    """The cache a prompt's forward pass runs with. Subclasses transformers' ``DynamicCache`` only so
    that the model's own code (mask sizes, recurrent-state accessors) finds what it calls. Layers
    without per-token K/V (recurrent, MLP-only) are transformers' own objects."""

    def __init__(self, model_config, specs: list[LayerSpec], prefix=None):
        super().__init__(config=model_config)
        layers = list(self.layers) + [None] * (len(specs) - len(self.layers))
        self.layers = [
            layer
            if not spec.attends
            else PromptHybridLayer(spec, layer.number_of_states)
            if spec.state
            else PromptLayer(spec)
            for spec, layer in zip(specs, layers)
        ]
        self.layer_class_to_replicate = None
        self.specs = specs
        self.compress: Any = None  # set inside compressing(): called after each layer's attention
        self.capture: Any = None  # a prefix_cache.Capture: the prompt's first positions are kept
        if prefix is not None:  # a cached prefix (prefix_cache.Prefix): only the rest of the prompt runs
            for layer, cached in zip(self.layers, prefix.layers):
                if isinstance(layer, PromptLayer):
                    layer.prefix, layer.prefix_length = cached, prefix.length


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
    reread: int = 0
    out: dict[str, list[Compressed]] = field(default_factory=dict)
    ranked: dict[str, dict[int, tuple]] = field(default_factory=dict)  # name -> layer -> its scores and K/V

    def finish(self) -> None:
        """The methods whose budget the layers share: rank every layer's scores together, then keep."""
        for name, layers in self.ranked.items():
            method, total, scores, most = self.out[name][0].method, 0, {}, []
            begin = time.perf_counter()
            for i, (prefix, k, v, _, share) in layers.items():
                if prefix is None:  # no longer than its budget: kept whole
                    self.out[name][0].layers[i] = LayerKV(
                        k, v, torch.arange(k.shape[-2], device=k.device).expand(1, k.shape[1], -1)
                    )
                else:
                    scores[i] = prefix[0]
                    total += share
                    most.append(share // prefix.shape[1])  # the layer's budget per head: a memory bound
            if not scores:
                continue
            counts = shared_budget.global_counts(list(scores.values()), total, method.share, method.fit, most)
            for (i, prefix), count in zip(scores.items(), counts):
                _, k, v, window, _ = layers[i]
                heads = k.shape[1]  # latent attention: one shared ranking, the same positions in every head
                self.out[name][0].layers[i] = LayerKV(
                    *shared_budget.keep_counts(prefix.expand(heads, -1)[None], k, v, count.expand(heads), window)
                )
            self.out[name][0].selection_s += _clock(k) - begin

    def __call__(self, layer_idx: int, query: torch.Tensor, vote_keys: torch.Tensor, scoring: Scoring) -> None:
        layer = self.cache.layers[layer_idx]
        keys, values = layer.pending
        if self.cache.capture is not None:
            self.cache.capture(layer_idx, query, keys, values)
        if layer.prefix is not None:  # the cached prefix's last queries, then the new ones (observation window)
            query = torch.cat([layer.prefix.queries, query], dim=-2)
        memo: dict = {}  # this layer's KVzip scores, shared by the methods that differ only in budget
        for name, method in self.methods.items():
            begin = _clock(keys)
            if method is not None and method.rereads and method.ranked_across_layers(layer.spec.window is not None):
                self.ranked.setdefault(name, {})[layer_idx] = reread_layer_scores(
                    method, layer_idx, len(self.cache.specs), query, keys, values, vote_keys, scoring, self.reread, memo
                )
                rows = [None]
            elif method is not None and method.rereads:
                rows = compress_reread_layer(
                    method,
                    layer.spec,
                    layer_idx,
                    len(self.cache.specs),
                    query,
                    keys,
                    values,
                    vote_keys,
                    scoring,
                    self.reread,
                )
            else:  # the prompt's part of a pass with a re-read after it, or the whole pass
                cut = keys.shape[-2] - self.reread
                rows = compress_layer(
                    method,
                    layer.spec,
                    layer_idx,
                    len(self.cache.specs),
                    query[..., :cut, :],
                    keys[..., :cut, :],
                    values[..., :cut, :],
                    vote_keys[..., :cut, :],
                    scoring,
                    self.lengths,
                )
            for compressed, kv in zip(self.out[name], rows):
                compressed.layers[layer_idx] = kv
                compressed.selection_s += _clock(keys) - begin
        layer.pending, layer.done = None, True


@contextlib.contextmanager
def compressing(
    cache: PromptCache,
    methods: Mapping[str, Any],
    lengths: list[int],
    reread: int = 0,
    states: PromptCache | None = None,
) -> Iterator[dict[str, list[Compressed]]]:
    """While open, the forward pass of a prompt of rows with ``lengths`` real tokens (left padded) run
    with ``cache`` compresses every attention layer right after its attention, once per method of
    ``methods`` (name -> config, ``None`` for the full cache). Yields name -> one :class:`Compressed`
    per row, complete when the block ends (recurrent layers and hybrid layers' states: each gets its
    own copy of the state). ``reread``: the pass is one prompt of ``lengths[0]`` tokens followed by
    ``reread`` tokens of KVzip's re-read (:class:`~snapkv_rag.methods.KVzipConfig`), which vote for
    that method and are cut off for every method; the recurrent states are then taken from ``states``
    (a pass over the prompt alone that keeps no K/V, run by ``Runner.prefill``), since this pass runs them on through the
    re-read."""
    if not methods:
        raise ValueError("compression: give at least one method")
    if any(m is not None and m.rereads for m in methods.values()) and not (reread and len(lengths) == 1):
        raise ValueError("kvzip: the pass must hold one prompt and its re-read (Runner.prefill builds it)")
    if reread and states is None and any(spec.state for spec in cache.specs):
        raise ValueError(
            "kvzip: a model with recurrent layers needs their states after the prompt alone "
            "(Runner.prefill runs that pass)"
        )
    compressor = _Compressor(cache, dict(methods), list(lengths), reread)
    for name, method in compressor.methods.items():
        compressor.out[name] = [Compressed(method, cache.specs, [None] * len(cache.specs), real) for real in lengths]
    cache.compress = compressor
    try:
        yield compressor.out
    finally:
        cache.compress = None
    compressor.finish()
    missed = [i for i, layer in enumerate(cache.layers) if isinstance(layer, PromptLayer) and not layer.done]
    if missed:
        raise UnsupportedModelError(
            f"layers {missed} never called the registered attention function with our cache: this model's code "
            "does not pass attention keyword arguments through, so snapkv-rag cannot compress it"
        )
    if any(spec.state for spec in cache.specs) and len(lengths) > 1:
        raise ValueError("a prompt batch of a model with recurrent layers: prefill one prompt at a time")
    copies = [c for per_row in compressor.out.values() for c in per_row]
    for i, spec in enumerate(cache.specs):
        if not spec.state:
            continue
        source = (cache if states is None else states).layers[i]
        state = source
        if spec.attends:  # a hybrid layer: its state alone, beside the kept K/V
            state = LinearAttentionLayer(number_of_states=source.number_of_states)
            move_state(source, state)
        for n, compressed in enumerate(copies):  # the last one takes the state itself, the others a copy
            own = state if n == len(copies) - 1 else copy.deepcopy(state)
            if spec.attends:
                compressed.layers[i].state = own
            else:
                compressed.layers[i] = own


def compress_layer(
    method,
    spec: LayerSpec,
    layer_idx: int,
    num_layers: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    vote_keys: torch.Tensor,
    scoring: Scoring,
    lengths: list[int],
) -> list[LayerKV]:
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
    uniform = len(set(lengths)) == 1 and not (method is not None and method.per_row)
    groups = [(slice(None), starts[0])] if uniform else [(slice(b, b + 1), starts[b]) for b in range(len(lengths))]
    out = []
    for rows, start in groups:
        # the queries end where the keys end (after a cached prefix they may start later)
        q_start = max(start - (length - query.shape[-2]), 0)
        k, v, q = keys[rows, :, start:], values[rows, :, start:], query[rows, :, q_start:]
        if method is None or k.shape[-2] == 0:
            kept = torch.arange(k.shape[-2], device=k.device).expand(k.shape[0], k.shape[1], -1)
        elif latent:
            voters = vote_keys[rows, :, start:]
            kept = method.select(q, voters, voters, None, layer_idx, num_layers, shared=True, **scoring.as_kwargs())[2][
                :, :1
            ].expand(k.shape[0], k.shape[1], -1)
            k, v = selection.gather_positions(k, kept), selection.gather_positions(v, kept)
        else:  # a ragged method's heads: empty slots at position -1
            k, v, kept = method.select(q, k, v, None, layer_idx, num_layers, **scoring.as_kwargs())
        out += [LayerKV(k[b : b + 1], v[b : b + 1], kept[b : b + 1] + start) for b in range(k.shape[0])]
    if method is not None and method.ragged:  # ragged heads: empty slots stay at -1, columns no head uses go
        return [
            LayerKV(
                *adaptive.trim_padding(
                    kv.keys, kv.values, torch.where(kv.positions >= start, kv.positions - (length - real), -1)
                )
            )
            for kv, start, real in zip(out, starts, lengths)
        ]
    return [LayerKV(kv.keys, kv.values, kv.positions - (length - real)) for kv, real in zip(out, lengths)]


def compress_reread_layer(
    method,
    spec: LayerSpec,
    layer_idx: int,
    num_layers: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    vote_keys: torch.Tensor,
    scoring: Scoring,
    reread: int,
) -> list[LayerKV]:
    """One layer of one prompt under KVzip: the pass holds the prompt and then ``reread`` tokens of
    its re-read; their queries vote over the prompt's keys (a sliding layer: over the part of the
    prompt its window keeps, as :func:`compress_layer` does)."""
    length = keys.shape[-2] - reread
    start = length - (length if spec.window is None else min(length, spec.window - 1))
    budget = method.budget_for_layer(layer_idx, num_layers)
    voters, k, v = vote_keys[:, :, start:], keys[:, :, start:length], values[:, :, start:length]
    readers = query[:, :, length:]
    if vote_keys.shape != keys.shape:  # multi-head latent attention: one selection for every head
        kept = selection.kvzip_select(
            readers,
            voters,
            voters[:, :, : length - start],
            method,
            capacity=budget,
            shared=True,
            sinks_from=start,
            **scoring.as_kwargs(),
        )[2][:, :1].expand(k.shape[0], k.shape[1], -1)
        k, v = selection.gather_positions(k, kept), selection.gather_positions(v, kept)
    else:
        k, v, kept = selection.kvzip_select(
            readers, voters, v, method, capacity=budget, sinks_from=start, **scoring.as_kwargs()
        )
    return [LayerKV(k, v, kept + start)]


def reread_layer_scores(
    method,
    layer_idx: int,
    num_layers: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    vote_keys: torch.Tensor,
    scoring: Scoring,
    reread: int,
    memo: dict,
) -> tuple:
    """One full-attention layer under KVzip with a shared budget, before the ranking: ``(prefix scores
    [1, H_kv or 1, n] or None when the prompt fits the layer's budget, keys, values, window, the
    positions an even split would keep outside the window)``; scores already in ``memo`` reused."""
    length = keys.shape[-2] - reread
    budget = method.budget_for_layer(layer_idx, num_layers)
    k, v = keys[:, :, :length], values[:, :, :length]
    if length <= budget:
        return None, k, v, 0, 0
    window = min(method.window_size, length)
    settings = (method.window_size, method.kernel_size, method.pooling, method.chunk, method.sink_tokens)
    if settings not in memo:
        memo[settings] = selection.kvzip_scores(
            query[:, :, length:], vote_keys, length, method, shared=vote_keys.shape != keys.shape, **scoring.as_kwargs()
        )
    prefix = memo[settings]
    return prefix, k, v, window, prefix.shape[1] * (budget - window)


def _clock(tensor: torch.Tensor) -> float:
    """``perf_counter`` once the device has finished the work queued so far (selection time is a
    prefill figure, outside any decode step: on CUDA an unsynchronised clock would time launches)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()
