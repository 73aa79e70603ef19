"""Our KV cache: one layer object per model layer, each of a known kind.

- ``full``: full attention. Holds the kept prompt positions (all of them, or what a compression
  method selected) in a preallocated buffer with room for the tokens to decode, written in place.
- ``sliding``: a sliding-window layer (window ``W``: a query at position ``p`` sees ``p - W < k <= p``).
  After the prompt it can only ever see the last ``W - 1`` prompt positions, so that is its share;
  a method compresses inside that share when it exceeds the budget. A window longer than the
  prompt makes it a full layer for the prompt; positions leaving the window while decoding are
  masked out.
- ``recurrent``: linear-attention / Mamba / conv state (Qwen3-Next, Nemotron-H, LFM2): transformers'
  own layer object, passed through untouched; ``none`` (MLP-only layers): likewise.
- an attention kind whose spec has ``state`` (Falcon-H1, Zamba): a :class:`HybridLayer`, our
  attention buffers plus transformers' own state handling for the Mamba part beside it.
- ``latent``: multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent per token for
  all heads; it is compressed like a full layer, with one selection shared by all heads.

Every attention layer stores, next to its keys and values, the original position of each slot in
its row's own coordinates (``-1``: an empty slot, e.g. a short row of a padded batch), per KV head.
Its decode mask comes from those positions, so each layer masks what it alone holds, and the
reported ``kept_tokens`` are counted from the same buffers.

The cache subclasses transformers' ``DynamicCache`` only so that the model's own code (mask sizes,
recurrent-state accessors) finds the methods it calls; storing and compressing is done here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from . import compression
from .config import RandomConfig
from .layer_kinds import (FULL, LATENT, NONE, RECURRENT, SLIDING, LayerSpec, UnsupportedModelError,  # noqa: F401
                          layer_specs)  # (re-exported: where callers found them before)


class AttentionLayer(DynamicLayer):
    """One attention layer's cache: keys, values and positions ``[B, H_kv, slots(, D)]``.

    During the prompt, ``update`` only hands the full K/V to the attention and keeps them as
    ``pending``; :meth:`store` then writes what is kept. While decoding, ``update`` writes each new
    token at the next slot. In static mode (compiled decoding) it writes at the slot held in a
    tensor and always returns the whole buffer, so that every step has the same shapes.
    """

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.is_sliding = spec.kind == SLIDING
        self.sliding_window = spec.window
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.keys = self.values = self.positions = None
        self.length = 0  # slots in use
        self.prompt_slots = 0
        self.valid: torch.Tensor | None = None  # [B, H_kv, length]: the slots this step may attend to
        self.dense = False
        self.slot: torch.Tensor | None = None  # static mode: where the next token is written

    # ------------------------------------------------------------ what transformers calls
    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is None:  # the prompt: attention sees it all; store() decides what stays
            self.is_initialized, self.device = True, key_states.device
            self.pending = (key_states, value_states)
            return key_states, value_states
        if self.slot is not None:
            self.keys.index_copy_(2, self.slot, key_states)
            self.values.index_copy_(2, self.slot, value_states)
            return self.keys, self.values
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            self._grow(end)
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        if self.keys is None:
            return 0 if self.pending is None else self.pending[0].shape[-2]
        return self.keys.shape[-2] if self.slot is not None else self.length

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        if self.slot is not None:
            return self.keys.shape[-2], 0
        return self.get_seq_length() + (query_length if isinstance(query_length, int) else query_length.shape[-1]), 0

    def get_max_length(self) -> int:
        return -1

    # ------------------------------------------------------------ ours
    def store(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, room: int) -> None:
        """Keep ``keys``/``values`` ``[B, H_kv, S, D]`` whose original positions are ``positions``
        (``-1``: empty), with ``room`` more slots for decoding."""
        b, h, s, _ = keys.shape
        self.keys = keys.new_zeros((b, h, s + room, keys.shape[-1]))
        self.values = values.new_zeros((b, h, s + room, values.shape[-1]))
        self.keys[:, :, :s], self.values[:, :, :s] = keys, values
        self.positions = torch.full((b, h, s + room), -1, dtype=torch.long, device=keys.device)
        self.positions[:, :, :s] = positions
        self.length = self.prompt_slots = s
        self.pending = None
        # a full layer whose every slot holds a token never needs a decode mask
        self.dense = self.spec.kind in (FULL, LATENT) and bool((positions >= 0).all())

    def kept_counts(self) -> list[int]:
        """Per row, how many prompt positions this layer physically holds."""
        return (self.positions[:, 0, : self.prompt_slots] >= 0).sum(-1).tolist()

    def begin_step(self, positions: torch.Tensor, steps: int = 1) -> None:
        """Before decoding tokens at ``positions`` ``[B]``: record them and work out which slots the
        step may attend to (``valid``; ``None``: all of them)."""
        start, end = self.length, self.length + steps
        if end > self.positions.shape[-1]:
            if self.slot is not None:
                raise RuntimeError("the fixed-size decode cache is full")
            self._grow(end)
        self.positions[:, :, start:end] = (positions[:, None] + torch.arange(steps, device=positions.device)
                                           )[:, None, :]
        if self.dense and self.slot is None:  # nothing to mask, now or later
            self.valid = None
            return
        if self.slot is not None:  # update() writes at the slot tensor; the buffer is seen whole
            self.length = end
        held = self.positions[:, :, : (self.positions.shape[-1] if self.slot is not None else end)]
        valid = held >= 0
        if self.spec.kind == SLIDING:
            valid &= held > (positions - self.spec.window)[:, None, None]
        self.valid = None if self.slot is None and bool(valid.all()) else valid

    def _grow(self, slots: int) -> None:
        extra = max(slots - self.keys.shape[-2], 16)
        pad = lambda t, fill=0: torch.cat([t, t.new_full((*t.shape[:2], extra, *t.shape[3:]), fill)], dim=2)  # noqa
        self.keys, self.values, self.positions = pad(self.keys), pad(self.values), pad(self.positions, -1)


class HybridLayer(AttentionLayer, LinearAttentionLayer):
    """A layer with attention and a Mamba state side by side (Falcon-H1's parallel mixers, Zamba's
    shared transformer block before its Mamba layer): the attention part is an :class:`AttentionLayer`,
    compressed like any other; the conv / SSM states are kept by transformers' own code, untouched."""

    def __init__(self, spec: LayerSpec, number_of_states: int = 1):
        AttentionLayer.__init__(self, spec)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # only the state side initialises lazily: the attention side is set up by update() / store()
        LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def take_state_from(self, other: HybridLayer) -> None:
        """A copy of ``other``'s conv / SSM states (a sibling cache filled by the same prompt)."""
        for name in ("conv_states", "recurrent_states"):
            setattr(self, name, {i: None if t is None else t.clone() for i, t in getattr(other, name).items()})
        for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                     "conv_kernel_size"):
            setattr(self, name, dict(getattr(other, name)))
        self.dtype = other.dtype


class KVCache(DynamicCache):
    """The cache of one request batch under one compression method (``None``: the full cache)."""

    def __init__(self, model_config, specs: list[LayerSpec], method=None):
        super().__init__(config=model_config)
        layers = list(self.layers) + [None] * (len(specs) - len(self.layers))
        self.layers = [layer if not spec.attends else HybridLayer(spec, layer.number_of_states) if spec.state
                       else AttentionLayer(spec) for spec, layer in zip(specs, layers)]
        self.attending = 0  # the layer whose K/V were handed over last: the one whose attention runs next
        self.layer_class_to_replicate = None
        self.specs, self.method = specs, method
        self.selection_s = 0.0
        self.record_s = 0.0  # time the recorder took in the last step (kept out of decode timings)
        self.recorder = None  # called as recorder(layer_idx, query, keys, scoring) by decode steps
        self._prefill: tuple[list[KVCache], list[int], int] | None = None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """transformers' entry point for a layer's new K/V; it also tells the attention function which
        layer it serves (Zamba's shared attention blocks carry no layer index of their own)."""
        self.attending = layer_idx
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def open_prefill(self, siblings: list[KVCache], real_lengths: list[int], room: int) -> None:
        """The next forward pass is a prompt of rows with ``real_lengths`` real tokens (left padded):
        fill this cache and ``siblings`` (other methods over the same prompt), each with ``room``
        slots for decoding."""
        self._prefill = (siblings, real_lengths, room)

    def prefill_attention(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scoring: Scoring) -> None:
        """Called right after layer ``layer_idx`` attended over the prompt with ``query`` and ``key``."""
        siblings, real_lengths, room = self._prefill
        compress_layer([self, *siblings], layer_idx, query, key, scoring, real_lengths, room)

    def close_prefill(self) -> None:
        """After the prompt's forward pass: every attention layer must have been stored, and the
        siblings get their copies of the recurrent layers."""
        siblings, _, _ = self._prefill
        self._prefill = None
        missed = [i for i, layer in self.attention_layers if layer.keys is None]
        if missed:
            raise UnsupportedModelError(
                f"layers {missed} never called the registered attention function with our cache: this model's code "
                "does not pass attention keyword arguments through, so snapkv-rag cannot compress it")
        for sibling in siblings:
            sibling.copy_recurrent_from(self)

    @property
    def attention_layers(self) -> list[tuple[int, AttentionLayer]]:
        return [(i, layer) for i, layer in enumerate(self.layers) if isinstance(layer, AttentionLayer)]

    def kept_tokens(self, row: int, prompt_tokens: int) -> list[int]:
        """Prompt positions held per layer for ``row``, read from the buffers (a recurrent layer
        holds a fixed-size state that summarises the whole prompt: reported as the prompt length; an
        MLP-only layer holds nothing: 0)."""
        return [layer.kept_counts()[row] if isinstance(layer, AttentionLayer) else 0 if spec.kind == NONE
                else prompt_tokens for spec, layer in zip(self.specs, self.layers)]

    def kv_bytes(self, row: int, prompt_tokens: int) -> tuple[int, int]:
        """(bytes the full cache holds for the prompt, bytes this cache holds), over attention layers."""
        full = kept = 0
        for _, layer in self.attention_layers:
            per_token = layer.keys.shape[1] * (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
            share = prompt_tokens if layer.spec.window is None else min(prompt_tokens, layer.spec.window - 1)
            full += per_token * share
            kept += per_token * layer.kept_counts()[row]
        return full, kept

    def begin_step(self, positions: torch.Tensor, steps: int = 1) -> None:
        """Before a decode step at ``positions`` ``[B]`` (see :meth:`AttentionLayer.begin_step`)."""
        for _, layer in self.attention_layers:
            if layer.slot is not None:
                layer.slot.fill_(layer.length)
            layer.begin_step(positions, steps)

    def make_static(self) -> torch.Tensor | None:
        """Switch to fixed-size decoding (see :class:`AttentionLayer`); returns the shared slot
        tensor, or ``None`` (nothing changed) when some layer holds a recurrent state or no K/V."""
        if any(spec.state or not spec.attends for spec in self.specs):
            return None
        first = self.attention_layers[0][1]
        slot = torch.full((1,), first.length, dtype=torch.long, device=first.keys.device)
        for _, layer in self.attention_layers:
            if layer.length != first.length:
                return None
        for _, layer in self.attention_layers:
            layer.slot = slot
            if layer.keys.is_cuda:  # written in place by every step: CUDA graphs need them at fixed addresses
                for buffer in (layer.keys, layer.values):  # (no guard: a new request's buffers re-capture)
                    torch._dynamo.mark_static_address(buffer, guard=False)
        return slot

    def copy_recurrent_from(self, other: KVCache) -> None:
        """Take a copy of ``other``'s recurrent layers (a sibling cache filled by the same prompt)."""
        import copy

        for i, layer in enumerate(other.layers):
            if isinstance(layer, HybridLayer):
                self.layers[i].take_state_from(layer)
            elif not isinstance(layer, AttentionLayer):
                self.layers[i] = copy.deepcopy(layer)


@dataclass
class Scoring:
    """How a layer's attention turns logits into weights: what the votes must use too."""

    scale: float | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def as_kwargs(self) -> dict:
        return {"scale": self.scale, "softcap": self.softcap, "sinks": self.sinks}


def compress_layer(caches: list[KVCache], layer_idx: int, query: torch.Tensor, vote_keys: torch.Tensor,
                   scoring: Scoring, real_lengths: list[int], room: int) -> None:
    """Write layer ``layer_idx`` of every cache from the prompt K/V pending in the first one.

    Each row is selected in its own coordinates (a padded row alone, without its pads), so that a
    request keeps the same positions in a batch as alone. ``query`` is ``[B, H, L, D]`` and
    ``vote_keys`` the keys the attention used: the cached keys themselves, except for multi-head
    latent attention, which caches one latent for all heads and expands it into per-head keys; there
    one selection is shared by all heads, from their votes averaged.
    """
    keys, values = caches[0].layers[layer_idx].pending
    latent = vote_keys.shape != keys.shape
    batch, length = keys.shape[0], keys.shape[-2]
    spec = caches[0].specs[layer_idx]
    num_layers = len(caches[0].specs)
    starts = []  # per row: where its share of the prompt begins, in padded coordinates
    for real in real_lengths:
        share = real if spec.window is None else min(real, spec.window - 1)
        starts.append(length - share)
    for cache in caches:
        begin = _clock(keys)
        # rows of equal length select together; otherwise (and for the seeded random baseline, whose
        # draws depend on the batch shape) each row alone
        uniform = len(set(real_lengths)) == 1 and not isinstance(cache.method, RandomConfig)
        rows = [slice(None)] if uniform else [slice(b, b + 1) for b in range(batch)]
        picked = []
        for rows_slice, start in zip(rows, starts if not uniform else starts[:1]):
            k, v, q = keys[rows_slice, :, start:], values[rows_slice, :, start:], query[rows_slice, :, start:]
            if cache.method is None or k.shape[-2] == 0:
                kept = torch.arange(k.shape[-2], device=k.device).expand(k.shape[0], k.shape[1], -1)
            elif latent:
                voters = vote_keys[rows_slice, :, start:]
                kept = compression.select(cache.method, q, voters, voters, None, layer_idx, num_layers, shared=True,
                                          **scoring.as_kwargs())[2][:, :1].expand(k.shape[0], k.shape[1], -1)
                k, v = compression.gather_positions(k, kept), compression.gather_positions(v, kept)
            else:
                k, v, kept = compression.select(cache.method, q, k, v, None, layer_idx, num_layers,
                                                **scoring.as_kwargs())
            picked.append((k, v, kept, start))
        cache.layers[layer_idx].store(*_right_aligned(picked, length, real_lengths, uniform), room=room)
        cache.selection_s += _clock(keys) - begin
    caches[0].layers[layer_idx].pending = None


def _clock(tensor: torch.Tensor) -> float:
    """``perf_counter`` once the device has finished the work queued so far: on CUDA, kernels run
    after their launch returns, so an unsynchronised clock would time the launches only."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


def _right_aligned(picked, length, real_lengths, uniform):
    """Rows' kept K/V (each ``[1 or B, H_kv, n_b, D]``) placed at the end of a common slot count,
    with positions in each row's own coordinates (``-1`` before a shorter row's tokens)."""
    if uniform:
        k, v, kept, start = picked[0]
        offset = length - real_lengths[0]  # all rows have the same length when uniform
        return k, v, kept + (start - offset)
    slots = max(p[0].shape[-2] for p in picked)
    b, h = len(picked), picked[0][0].shape[1]
    keys = picked[0][0].new_zeros((b, h, slots, picked[0][0].shape[-1]))
    values = picked[0][1].new_zeros((b, h, slots, picked[0][1].shape[-1]))
    positions = torch.full((b, h, slots), -1, dtype=torch.long, device=keys.device)
    for row, (k, v, kept, start) in enumerate(picked):
        n = k.shape[-2]
        keys[row, :, slots - n:], values[row, :, slots - n:] = k[0], v[0]
        positions[row, :, slots - n:] = kept[0] + (start - (length - real_lengths[row]))
    return keys, values, positions
