"""Attaching compression to a transformers model.

We register attention functions (``snapkv_sdpa``, ``snapkv_eager``, ``snapkv_flash_attention_2``)
that call the model's own attention and then, during a prefill that an engine has opened with
:class:`activate`, replace that layer's cache entry by its compressed K/V. The replacement
happens right after each layer's attention, so at most one layer's full K/V is alive at a time,
and the keys keep the RoPE rotation of their original positions.

:func:`chunk_mlps` makes each decoder layer's MLP run over the prompt in slices of
``PrefillPlan.mlp_chunk`` tokens during a prefill: the MLP works token by token, and its
intermediate activations (3.5x the hidden size in Llama models, for every prompt token at once)
are what limits the longest prompt once the cache is compressed layer by layer.

Outside a plan the wrapper adds nothing but one context-variable lookup.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from dataclasses import dataclass, field
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import compression

BASE_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
PREFIX = "snapkv_"


@dataclass
class PrefillPlan:
    """What to do with each layer's K/V during one prefill.

    ``config`` compresses ``cache`` in place (``None`` keeps the full cache). ``branches`` maps a
    name to ``(config, cache)``: extra caches derived from the same prefill (evals compare methods
    without prefilling again). ``record_decode_attention`` makes decode steps accumulate the
    attention each KV head pays to the prompt positions (for the attention hit rate).
    """

    cache: object
    config: object | None
    attention_mask: torch.Tensor | None
    num_layers: int
    branches: dict[str, tuple[object, object]] = field(default_factory=dict)
    record_decode_attention: bool = False
    phase: str = "prefill"
    kept_positions: dict[int, torch.Tensor] = field(default_factory=dict)
    branch_kept: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    branch_selection_s: dict[str, float] = field(default_factory=dict)
    decode_attention: dict[int, torch.Tensor] = field(default_factory=dict)
    prompt_length: int = 0
    selection_s: float = 0.0
    mlp_chunk: int | None = None
    record_s: float = 0.0  # time spent recording decode attention (kept out of decode timings)

    def after_attention(self, module, query: torch.Tensor, key: torch.Tensor) -> None:
        layer_idx = module.layer_idx
        if self.phase == "prefill":
            self._compress(layer_idx, query, key)
        elif self.record_decode_attention:
            self._record(layer_idx, query, key)

    def _compress(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor) -> None:
        layer = self.cache.layers[layer_idx]
        if key.shape[-2] != query.shape[-2] or not hasattr(layer, "keys") or _is_sliding(layer):
            return  # not a fresh full-attention prefill: sliding layers are bounded already
        keys, values = layer.keys, layer.values
        self.prompt_length = keys.shape[-2]
        for name, (config, cache) in self.branches.items():
            start = _clock(keys)
            k, v, kept = compression.select(config, query, keys, values, self.attention_mask, layer_idx,
                                            self.num_layers)
            cache.update(k.contiguous(), v.contiguous(), layer_idx)
            self.branch_kept.setdefault(name, {})[layer_idx] = kept
            self.branch_selection_s[name] = self.branch_selection_s.get(name, 0.0) + _clock(keys) - start
        start = _clock(keys)
        if self.config is not None:
            k, v, kept = compression.select(self.config, query, keys, values, self.attention_mask, layer_idx,
                                            self.num_layers)
            layer.keys, layer.values = k.contiguous(), v.contiguous()
            self.kept_positions[layer_idx] = kept
        self.selection_s += _clock(keys) - start

    def _record(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor) -> None:
        start = time.perf_counter()
        probs = compression.attention_probs(query[..., -1:, :], key).sum(dim=-2).mean(dim=2)
        probs = probs[..., : self.prompt_length]
        total = self.decode_attention.get(layer_idx)
        self.decode_attention[layer_idx] = probs if total is None else total + probs
        self.record_s += time.perf_counter() - start


def _clock(tensor: torch.Tensor) -> float:
    """``perf_counter`` once the device has finished the work queued so far: on CUDA, kernels run
    after their launch returns, so an unsynchronised clock would time the launches only."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


def _with_room(states: torch.Tensor, extra: int) -> torch.Tensor:
    """``states`` ``[B, H, L, D]`` copied into a zeroed buffer with ``extra`` more positions."""
    b, h, length, d = states.shape
    buffer = states.new_zeros((b, h, length + extra, d))
    buffer[:, :, :length] = states
    return buffer


class _Reserved:
    """A cache layer's K/V moved into buffers with room for ``extra`` more tokens: decoding then
    writes each new token in place instead of concatenating, which copies the whole cache at
    every step (the dominant cost of a long full cache on CPU)."""

    def __init__(self, layer, extra: int):
        self.layer, self.length = layer, layer.keys.shape[-2]
        self.keys, self.values = _with_room(layer.keys, extra), _with_room(layer.values, extra)
        layer.update = self.update
        self._expose()

    def _expose(self) -> None:
        self.layer.keys = self.keys[:, :, : self.length]
        self.layer.values = self.values[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:  # past the reservation: grow as a plain layer would
            self.keys = torch.cat([self.keys[:, :, : self.length], key_states], dim=-2)
            self.values = torch.cat([self.values[:, :, : self.length], value_states], dim=-2)
        else:
            self.keys[:, :, self.length:end] = key_states
            self.values[:, :, self.length:end] = value_states
        self.length = end
        self._expose()
        return self.layer.keys, self.layer.values


def reserve(cache, extra: int) -> None:
    """Give every full-attention layer of ``cache`` room for ``extra`` decoded tokens."""
    with torch.inference_mode():
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4 and not _is_sliding(layer):
                _Reserved(layer, extra)


def _is_sliding(layer) -> bool:
    return "Sliding" in type(layer).__name__ or getattr(layer, "is_sliding", False)


class _Static:
    """A cache layer's K/V moved into fixed-size buffers with room for ``extra`` decoded tokens.

    Each decode step writes its token at the slot held in the shared one-element tensor ``slot``
    and attention sees the whole buffer, with a mask hiding the slots not written yet: every step
    has the same shapes, which is what ``torch.compile`` (and CUDA graphs) need."""

    def __init__(self, layer, extra: int, slot: torch.Tensor):
        self.slot = slot
        # zeroed, not empty: masked slots get zero weight, and 0 x NaN garbage would still be NaN
        self.keys, self.values = _with_room(layer.keys, extra), _with_room(layer.values, extra)
        layer.keys, layer.values = self.keys, self.values
        layer.update = self.update
        if self.keys.is_cuda:  # written in place by every step: CUDA graphs need them at fixed addresses
            for buffer in (self.keys, self.values):  # (no guard: a new request's buffers re-capture, not recompile)
                torch._dynamo.mark_static_address(buffer, guard=False)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values


def make_static(cache, extra: int) -> torch.Tensor | None:
    """Give ``cache`` fixed-size buffers (see :class:`_Static`) and return the slot tensor the
    decode loop sets before each step; ``None`` (cache untouched) when its layers are not all
    full-attention layers of one length (PyramidKV budgets, sliding-window layers)."""
    layers = list(cache.layers)
    keys = [getattr(layer, "keys", None) for layer in layers]
    if (not layers or any(k is None or k.dim() != 4 for k in keys) or len({k.shape[-2] for k in keys}) != 1
            or any(_is_sliding(layer) for layer in layers)):
        return None
    slot = torch.zeros(1, dtype=torch.long, device=layers[0].keys.device)  # a plain tensor: set between steps
    with torch.inference_mode():
        for layer in layers:
            _Static(layer, extra, slot)
    return slot


_active: contextvars.ContextVar[PrefillPlan | None] = contextvars.ContextVar("snapkv_rag_plan", default=None)
# How many plans are active in any thread. The attention and MLP wrappers look the context
# variable up only when it is non-zero: torch.compile cannot trace ContextVar.get, and a compiled
# decode step runs with no plan open (guarded on this value).
_open_plans = 0
_open_plans_lock = threading.Lock()


def _current_plan() -> PrefillPlan | None:
    return _active.get() if _open_plans else None


class activate:
    """``with activate(plan):`` makes ``plan`` act on this thread's (or asyncio task's) attention
    calls. Reusable: the decode loop enters it once per step when it records attention."""

    def __init__(self, plan: PrefillPlan):
        self.plan = plan
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> PrefillPlan:
        global _open_plans
        self._tokens.append(_active.set(self.plan))
        with _open_plans_lock:
            _open_plans += 1
        return self.plan

    def __exit__(self, *exc_info) -> None:
        global _open_plans
        with _open_plans_lock:
            _open_plans -= 1
        _active.reset(self._tokens.pop())


def _base_function(base: str, module):
    if base == "eager":
        # each modeling file defines its own eager attention (softcapping, sinks, ...)
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return ALL_ATTENTION_FUNCTIONS[base]


def _masked_decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One decode token against a masked cache, through torch's SDPA with grouped heads.

    transformers copies every KV head ``H / H_kv`` times (``repeat_kv``) whenever a mask is given,
    which for a long cache costs more than the attention itself; SDPA's ``enable_gqa`` computes the
    same thing from the cache as it is."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling if scaling is not None else module.scaling,
        enable_gqa=_grouped(module, query, key))
    return out.transpose(1, 2).contiguous(), None


def _grouped(module, query, key) -> bool:
    """Whether query heads share KV heads, as a plain bool: from the layer's own setting where it has
    one (under torch.compile with dynamic shapes a comparison of shapes is symbolic, which SDPA's
    ``enable_gqa`` does not take: it broke the compiled step into one graph per layer)."""
    groups = getattr(module, "num_key_value_groups", None)
    return groups != 1 if isinstance(groups, int) else bool(query.shape[1] != key.shape[1])


def _is_masked_decode(base: str, query, key, attention_mask, kwargs) -> bool:
    return (base == "sdpa" and query.shape[2] == 1 and attention_mask is not None and attention_mask.dim() == 4
            and attention_mask.dtype == torch.bool and attention_mask.shape[-1] == key.shape[-2]
            and query.shape[1] % key.shape[1] == 0
            and not kwargs.get("dropout") and kwargs.get("s_aux") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions"))


def _make_wrapper(base: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not args and _is_masked_decode(base, query, key, attention_mask, kwargs):
            output = _masked_decode_sdpa(module, query, key, value, attention_mask, **kwargs)
        else:
            output = _base_function(base, module)(module, query, key, value, attention_mask, *args, **kwargs)
        plan = _current_plan()
        if plan is not None:
            plan.after_attention(module, query, key)
        return output

    attention.__name__ = f"{PREFIX}{base}"
    return attention


def _chunked_forward(original):
    def forward(hidden_states, *args, **kwargs):
        plan = _current_plan()
        chunk = plan.mlp_chunk if plan is not None and plan.phase == "prefill" else None
        length = hidden_states.shape[-2] if hidden_states.dim() >= 2 else 0
        if not chunk or length <= chunk:
            return original(hidden_states, *args, **kwargs)
        out = None
        for start in range(0, length, chunk):
            part = original(hidden_states[..., start:start + chunk, :], *args, **kwargs)
            if out is None:
                out = part.new_empty((*hidden_states.shape[:-1], part.shape[-1]))
            out[..., start:start + chunk, :] = part
        return out

    forward.__wrapped__ = original
    return forward


def chunk_mlps(model) -> None:
    """Route every decoder layer's ``mlp`` through :func:`_chunked_forward` (idempotent). Outside
    a prefill plan with ``mlp_chunk`` set they run unchanged."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "mlp" and not hasattr(module.forward, "__wrapped__"):
            module.forward = _chunked_forward(module.forward)


def register() -> None:
    """Register the wrapped attention functions and their mask builders (idempotent)."""
    for base in BASE_IMPLEMENTATIONS:
        name = PREFIX + base
        if name in ALL_ATTENTION_FUNCTIONS:
            continue
        AttentionInterface.register(name, _make_wrapper(base))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])


def wrapped_name(base: str) -> str:
    if base not in BASE_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation: must be one of {BASE_IMPLEMENTATIONS}, got {base!r}")
    return PREFIX + base


def attach(model, base: str) -> None:
    """Route ``model``'s attention through the SnapKV wrapper around ``base``."""
    register()
    name = wrapped_name(base)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older 5.x
        model.config._attn_implementation = name
