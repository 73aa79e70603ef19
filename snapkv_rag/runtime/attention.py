"""The attention functions registered with transformers, and how a model is switched to them.

``snapkv_sdpa`` / ``snapkv_eager`` / ``snapkv_flash_attention_2`` run the model's own attention
(the base implementation) and add two things when the forward pass carries one of our caches
(``snapkv_cache=`` among the model's keyword arguments, which transformers hands to every
attention call):

- a prompt (:class:`~snapkv_rag.kv.prompt_cache.PromptCache`): right after a layer's attention, inside the
  runner's ``with compressing(...)`` block, that layer's K/V are compressed;
- a decode step (:class:`~snapkv_rag.kv.slot_cache.SlotCache`): the layer attends over its whole fixed
  buffer with its own mask (:meth:`SlotCache.begin_step`); a one-token query ``[B, H, 1, D]`` is
  viewed as ``[B, H_kv, H/H_kv, D]`` so that the ``[B, H_kv, 1, S]`` mask broadcasts and no KV head
  is repeated.

A call serves the layer whose K/V the model handed the cache last (``cache.attending``), not
``module.layer_idx``: Zamba's shared attention block is one module used at several layers.

Without ``snapkv_cache`` a wrapper is exactly its base implementation, so a model switched to it
behaves as before for any other caller. :func:`detach` switches it back.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kv.prompt_cache import PromptLayer, Scoring
from ..kv.slot_cache import SlotLayer

BASE_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
PREFIX = "snapkv_"
CACHE_KWARG = "snapkv_cache"
log = logging.getLogger("snapkv_rag")


def scoring_of(module, kwargs: dict) -> Scoring:
    """The layer's own attention scale, soft-cap and sinks, as its attention call receives them."""
    scale = kwargs.get("scaling")
    if scale is None:
        scale = getattr(module, "scaling", None)
    return Scoring(scale=scale, softcap=kwargs.get("softcap") or None, sinks=kwargs.get("s_aux"))


def _base_function(base: str, module):
    if base == "eager":  # each modeling file has its own eager attention (soft-capping, sinks, ...)
        own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        return own if own is not None else ALL_ATTENTION_FUNCTIONS["sdpa"]
    return ALL_ATTENTION_FUNCTIONS[base]


def _decode_mask(valid: torch.Tensor, query: torch.Tensor, base: str) -> torch.Tensor:
    """A layer's ``[B, H_kv, 1, S]`` valid slots as the per-query-head 4-D mask its base attention takes."""
    mask = valid.repeat_interleave(query.shape[1] // valid.shape[1], dim=1)
    if base == "eager":  # eager attention adds its mask to the scores
        return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min
        )
    return mask


def _over_stored(layer, query: torch.Tensor, base: str) -> torch.Tensor | None:
    """The mask of a prompt's tail over a stored compressed set (a prefix with kept ``positions``,
    :mod:`snapkv_rag.documents.store`): the stored slots that hold a position (a ragged layer's empty ones
    do not), then the tail causally; in a sliding layer, only what lies inside each tail query's
    window. The model's own mask assumes one length for every layer, which a set with per-layer
    budgets does not have. ``None`` otherwise."""
    positions = getattr(layer.prefix, "positions", None)
    if positions is None:
        return None
    b, h_kv, _ = positions.shape
    q = query.shape[-2]
    at = layer.prefix_length + torch.arange(q, device=positions.device)  # the tail queries' positions
    window = layer.spec.window  # a key must lie above `lower` (every position does in a full layer)
    lower = at - window if window is not None else torch.full_like(at, -1)
    held = (positions[:, :, None, :] > lower[:, None]) & (positions >= 0)[:, :, None, :]
    tail = (at[None, :] <= at[:, None]) & (at[None, :] > lower[:, None])
    return _decode_mask(torch.cat([held, tail.expand(b, h_kv, q, q)], dim=-1), query, base)


def grouped_sdpa(module, query, key, value, mask, scaling):
    """One decode token through torch's SDPA with grouped heads and no KV head repeated: the query
    ``[B, H, 1, D]`` viewed as ``[B, H_kv, H/H_kv, D]`` (the heads sharing a KV head side by side),
    the ``[B, H_kv, 1, S]`` mask broadcast over them. Returns ``[B, 1, H, D]`` as transformers expects."""
    b, heads, _, _ = query.shape
    grouped = query.reshape(b, key.shape[1], heads // key.shape[1], query.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask, scale=scaling if scaling is not None else module.scaling
    )
    # [B, H_kv, H/H_kv, D] -> [B, 1, H, D]; a copy only where the kernel's output is not contiguous
    # (CUDA float32 picks such a kernel)
    return out.reshape(b, 1, heads, value.shape[-1]), None


def fused_decode_attention(module, query, key, value, mask, scaling):
    """One decode token over a slot cache, written as plain tensor ops for the compiler to fuse (the
    compiled step only, with ``decode_attention="split"``: eager, it would hold a ``[B, H, S, D]``
    product; on the CPU inductor's reductions are slower than torch's attention kernel): scores as a reduction over
    the head size, the masked softmax, and the weighted sum over the slots as a second reduction.
    Inductor turns each into one kernel and splits a long reduction over many blocks (split-K, as
    flash-decoding does), where an attention kernel runs one block per KV head at batch 1. The query
    heads sharing a KV head read it together (``[B, H_kv, H/H_kv, ...]``), in float32. Returns
    ``[B, 1, H, D]`` as transformers expects."""
    b, heads, _, d = query.shape
    h_kv = key.shape[1]
    grouped = query.reshape(b, h_kv, heads // h_kv, 1, d).float()
    scale = scaling if scaling is not None else module.scaling
    scores = (grouped * key[:, :, None].float()).sum(-1) * scale  # [B, H_kv, G, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., None] * value[:, :, None].float()).sum(-2)  # [B, H_kv, G, D]
    return out.to(query.dtype).reshape(b, 1, heads, value.shape[-1]), None


def grouped_tail_sdpa(module, query, key, value, mask, scaling):
    """A few queries over a cached prefix on the CPU (lookahead's draft passes, a question's tail):
    torch's SDPA with grouped heads (``enable_gqa``) under the model's mask, where transformers would
    copy every KV head once per query head it serves (it keeps grouped heads for unmasked calls).
    Returns ``[B, Q, H, D]`` as transformers expects."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling if scaling is not None else module.scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def _grouped_tail(base: str, layer, query, key, value, mask, kwargs: dict) -> bool:
    """Whether a prompt pass can take :func:`grouped_tail_sdpa`: SDPA on the CPU, over a cached
    prefix, grouped KV heads, the model's mask given, nothing but plain attention asked for."""
    return (
        base == "sdpa"
        and query.device.type == "cpu"
        and layer.prefix is not None
        and mask is not None
        and key.shape[1] != query.shape[1]
        and _grouped_heads(kwargs, query, key, value)
    )


def _grouped_heads(kwargs: dict, query, key, value) -> bool:
    """Plain attention (no soft-cap, sinks or dropout) whose query heads share KV heads evenly."""
    return (
        not kwargs.get("softcap")
        and kwargs.get("s_aux") is None
        and not kwargs.get("dropout")
        and query.shape[1] % key.shape[1] == 0
        and key.shape[-1] == value.shape[-1]
    )


def _plain(kwargs: dict, query, key, value) -> bool:
    """Whether a decode step can take :func:`grouped_sdpa` (plain grouped attention; one query)."""
    return query.shape[-2] == 1 and _grouped_heads(kwargs, query, key, value)


def _make_wrapper(base: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        cache = kwargs.pop(CACHE_KWARG, None)
        index = cache.attending if cache is not None else None  # (module.layer_idx: None in Zamba's shared blocks)
        layer = cache.layers[index] if cache is not None else None
        if isinstance(layer, PromptLayer):  # the prompt: attend as the model does, then compress
            stored = _over_stored(layer, query, base)
            if stored is None and _grouped_tail(base, layer, query, key, value, attention_mask, kwargs):
                output = grouped_tail_sdpa(module, query, key, value, attention_mask, kwargs.get("scaling"))
            elif stored is None:
                output = _base_function(base, module)(module, query, key, value, attention_mask, *args, **kwargs)
            else:
                function = _base_function("sdpa" if base == "flash_attention_2" else base, module)
                output = function(module, query, key, value, stored, *args, **kwargs)
            if cache.compress is not None:
                cache.compress(index, query, key, scoring_of(module, kwargs))
            return output
        if not isinstance(layer, SlotLayer):
            return _base_function(base, module)(module, query, key, value, attention_mask, *args, **kwargs)
        valid = cache.masks[layer.index]
        if base != "eager" and _plain(kwargs, query, key, value):
            split = cache.decode_attention == "split" and torch.compiler.is_compiling()
            plain = fused_decode_attention if split else grouped_sdpa
            output = plain(module, query, key, value, valid, kwargs.get("scaling"))
        else:  # soft-cap, sinks, latent heads: the base attention with the mask per query head
            function = _base_function("sdpa" if base == "flash_attention_2" else base, module)
            output = function(module, query, key, value, _decode_mask(valid, query, base), *args, **kwargs)
        if cache.recorder is not None:
            cache.recorder(index, query, key, scoring_of(module, kwargs))
        return output

    attention.__name__ = f"{PREFIX}{base}"
    return attention


def register() -> None:
    """Register the wrapped attention functions and their mask builders (idempotent)."""
    for base in BASE_IMPLEMENTATIONS:
        name = PREFIX + base
        if name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, _make_wrapper(base))
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])


def current_base(model) -> str:
    """The base implementation ``model`` runs now (ours unwrapped)."""
    name = getattr(model.config, "_attn_implementation", None) or "eager"
    return name.removeprefix(PREFIX)


def resolve_implementation(model, requested: str | None) -> str:
    """The base implementation to run: ``requested`` if the model can run it (else a ValueError that
    says what works); ``None``: the model's own choice, sdpa where supported, else eager, said once."""
    kind = type(model).__name__
    if requested is not None and requested not in BASE_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation: must be one of {BASE_IMPLEMENTATIONS} or None, got {requested!r}")
    if requested == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError(
                "attn_implementation: 'flash_attention_2' needs the flash-attn package (CUDA only): "
                "pip install 'snapkv-rag[flash-attn]', or leave attn_implementation unset"
            )
        if not getattr(model, "_supports_flash_attn", True):
            raise ValueError(
                f"attn_implementation: {kind} does not support 'flash_attention_2'; use 'eager' "
                "or leave attn_implementation unset"
            )
        return requested
    if requested == "sdpa" and not getattr(model, "_supports_sdpa", True):
        raise ValueError(
            f"attn_implementation: {kind} cannot run 'sdpa' (transformers does not support it for this "
            "model); use 'eager', or leave attn_implementation unset to fall back to it"
        )
    if requested is not None:
        return requested
    own = current_base(model)
    if own not in BASE_IMPLEMENTATIONS or (own == "sdpa" and not getattr(model, "_supports_sdpa", True)):
        own = "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"
    if own != "sdpa":
        log.info("snapkv_rag: %s runs %s attention (sdpa is not supported for it)", kind, own)
    return own


def attach(model, base: str) -> None:
    """Switch ``model``'s attention to our wrapper around ``base`` (cheap when already there)."""
    register()
    name = PREFIX + base
    if getattr(model.config, "_attn_implementation", None) == name:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older 5.x
        model.config._attn_implementation = name


def detach(model) -> None:
    """Switch ``model`` back to the base implementation it ran before :func:`attach`."""
    name = getattr(model.config, "_attn_implementation", None) or ""
    if name.startswith(PREFIX):
        model.set_attn_implementation(name.removeprefix(PREFIX))


@contextlib.contextmanager
def sliced_mlps(model, chunk: int | None):
    """While open, every decoder layer's ``mlp`` runs over a long input in slices of ``chunk``
    tokens: the MLP works token by token, and its activations (3-4x the hidden size for every
    prompt token at once) are what bounds the longest prompt once the cache is compressed layer by
    layer. MLPs that return a tuple (MoE router logits) run whole. Restored on exit."""
    if not chunk:
        yield
        return
    patched = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "mlp" and "forward" not in module.__dict__:
            module.forward = _sliced(module.forward, chunk)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _sliced(forward, chunk: int):
    state = {"whole": False}

    def sliced(hidden_states, *args, **kwargs):
        length = hidden_states.shape[-2] if hidden_states.dim() >= 2 else 0
        if state["whole"] or length <= chunk:
            return forward(hidden_states, *args, **kwargs)
        out = None
        for start in range(0, length, chunk):
            part = forward(hidden_states[..., start : start + chunk, :], *args, **kwargs)
            if not isinstance(part, torch.Tensor):  # (output, router logits): not sliceable here
                state["whole"] = True
                return forward(hidden_states, *args, **kwargs)
            if out is None:
                out = part.new_empty((*hidden_states.shape[:-1], part.shape[-1]))
            out[..., start : start + chunk, :] = part
        return out

    return sliced
