"""The attention functions registered with transformers, and how a model is switched to them.

``snapkv_sdpa`` / ``snapkv_eager`` / ``snapkv_flash_attention_2`` run the model's own attention
(the base implementation) and add two things when the forward pass carries our cache
(``snapkv_cache=`` among the model's keyword arguments, which transformers hands to every
attention call):

- during the prompt, right after a layer's attention, that layer's K/V are compressed into the
  cache (:func:`snapkv_rag.cache.compress_layer`): at most one layer's full K/V is alive at a time;
- while decoding, the layer attends with its own mask (:meth:`AttentionLayer.begin_step`), built
  from the positions that layer holds: padding, slots not written yet, positions that left a
  sliding window.

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

from .cache import AttentionLayer, KVCache, Scoring, compress_layer

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
    """A layer's ``[B, H_kv, S]`` valid slots as the 4-D mask its base attention takes."""
    mask = valid.repeat_interleave(query.shape[1] // valid.shape[1], dim=1)[:, :, None, :]
    if base == "eager":  # eager attention adds its mask to the scores
        return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return mask


def grouped_sdpa(module, query, key, value, mask, scaling):
    """One decode token through torch's SDPA with grouped heads: transformers' sdpa path copies
    every KV head ``H / H_kv`` times when a mask is given, which costs more than the attention."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling if scaling is not None else module.scaling,
        enable_gqa=_grouped(module, query, key))
    return out.transpose(1, 2).contiguous(), None


def _grouped(module, query, key) -> bool:
    """Whether query heads share KV heads, as a plain bool: from the layer's own setting where it has
    one (under torch.compile with dynamic shapes a comparison of shapes is symbolic, which SDPA's
    ``enable_gqa`` does not take: it broke the compiled step into one graph per layer)."""
    groups = getattr(module, "num_key_value_groups", None)
    return groups != 1 if isinstance(groups, int) else bool(query.shape[1] != key.shape[1])


def _make_wrapper(base: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        cache: KVCache | None = kwargs.pop(CACHE_KWARG, None)
        index = cache.attending if cache is not None else None  # (module.layer_idx: None in Zamba's shared blocks)
        layer = cache.layers[index] if cache is not None else None
        if not isinstance(layer, AttentionLayer):
            return _base_function(base, module)(module, query, key, value, attention_mask, *args, **kwargs)
        if layer.pending is not None:  # the prompt: attend as the model does, then compress
            output = _base_function(base, module)(module, query, key, value, attention_mask, *args, **kwargs)
            cache.prefill_attention(index, query, key, scoring_of(module, kwargs))
            return output
        if layer.valid is None:  # every slot open: the base implementation as it is
            output = _base_function(base, module)(module, query, key, value, None, *args, **kwargs)
        else:
            mask = _decode_mask(layer.valid, query, "eager" if base == "eager" else "sdpa")
            plain = (not kwargs.get("softcap") and kwargs.get("s_aux") is None and not kwargs.get("dropout")
                     and query.shape[1] % key.shape[1] == 0 and key.shape[-1] == value.shape[-1])
            if base != "eager" and plain:
                output = grouped_sdpa(module, query, key, value, mask, kwargs.get("scaling"))
            else:  # flash attention takes no 4-D mask: a masked step goes through sdpa
                function = _base_function("sdpa" if base == "flash_attention_2" else base, module)
                output = function(module, query, key, value, mask, *args, **kwargs)
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
            raise ValueError("attn_implementation: 'flash_attention_2' needs the flash-attn package (CUDA only): "
                             "pip install 'snapkv-rag[flash-attn]', or leave attn_implementation unset")
        if not getattr(model, "_supports_flash_attn", True):
            raise ValueError(f"attn_implementation: {kind} does not support 'flash_attention_2'; use 'eager' "
                             "or leave attn_implementation unset")
        return requested
    if requested == "sdpa" and not getattr(model, "_supports_sdpa", True):
        raise ValueError(f"attn_implementation: {kind} cannot run 'sdpa' (transformers does not support it for this "
                         "model); use 'eager', or leave attn_implementation unset to fall back to it")
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
            part = forward(hidden_states[..., start:start + chunk, :], *args, **kwargs)
            if not isinstance(part, torch.Tensor):  # (output, router logits): not sliceable here
                state["whole"] = True
                return forward(hidden_states, *args, **kwargs)
            if out is None:
                out = part.new_empty((*hidden_states.shape[:-1], part.shape[-1]))
            out[..., start:start + chunk, :] = part
        return out

    return sliced
