"""An 8-bit kept cache (``kv_dtype``): keys and values stored as int8 or float8, with a scale per
token, head and group of :data:`GROUP` channels.

What is stored: for a tensor ``x`` ``[..., n, D]`` (one layer's keys or values: batch, heads,
slots, head size), ``q`` of the same shape in ``torch.int8`` (or ``torch.float8_e4m3fn``) and
``scale`` ``[..., n, G]`` in ``x``'s own dtype, one per (token, head, group of ``D / G`` channels;
``G = D / 32``, or 1 where 32 does not divide ``D``: :func:`groups`): ``scale = max|x| / 127`` over
the group's numbers (``/ 448`` for float8, its largest finite value), ``q = round(x / scale)``
clamped to ``[-127, 127]`` (float8: the cast rounds to its nearest value). Symmetric, no zero point;
a group of zeros has scale 0 and reads back as zeros.

Why per token: a compressed cache is a set of kept positions, each written once (at the prompt's
selection, or when a step decodes it) and never changed; a scale of its own lets it be quantized at
that moment alone, without seeing the others (a per-channel scale would have to change as tokens
arrive). Outlier tokens (attention sinks, punctuation) then cost only their own precision, and a
head's scale does not depend on the other heads'. Why groups of 32 channels within the head: a few
channels of a key carry most of its magnitude (rotary pairs, outlier dimensions), and one scale per
head rounds every other channel against them. Measured on the embedded model (a 16-token
teacher-forced continuation of 8 prompts of 1,200 tokens over the quantized prompt cache, KL to the
float cache): 0.00021 with one scale per token and head, 0.00010 with groups of 32, for 2 bytes
more per 64 numbers; an asymmetric scale per token (a zero point too) gave 0.00012.

The error: int8 rounds each number to the nearest multiple of its scale, so
``|dequantize(q, scale) - x| <= scale / 2 = max|x| / 254`` per group, plus the rounding of
``x``'s dtype when it is multiplied back (bf16: about ``max|x| / 256`` more). float8 e4m3 keeps 3
mantissa bits: a relative error up to 1/16 of each number's own magnitude (half its step), and
numbers below ``scale * 2**-9`` become 0.

The bytes: ``D`` numbers of one byte and ``G`` scales of the compute dtype per (token, head):
``(D + 2 G) / (2 D)`` of bf16's bytes (``D = 64``: 0.53), ``(D + 4 G) / (4 D)`` of float32's.
The selection itself is computed on the prompt's full-precision attention before any of this
(:meth:`snapkv_rag.kv.prompt_cache.Compressed.as_kv_dtype`); float8 needs CUDA.
"""

from __future__ import annotations

import torch

KV_DTYPES = (None, "int8", "fp8")
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
LARGEST = {"int8": 127.0, "fp8": 448.0}  # float8_e4m3fn's largest finite value is 448
GROUP = 32  # channels of a head that share a scale (where it divides the head size)


def check_kv_dtype(value, device: torch.device | str | None = None) -> str | None:
    """``value`` once it is one of :data:`KV_DTYPES` (and ``"fp8"`` only on a CUDA ``device``);
    else a ``ValueError`` naming ``kv_dtype`` and what is allowed."""
    if value not in KV_DTYPES or isinstance(value, bool):
        raise ValueError(f"kv_dtype: must be one of {KV_DTYPES}, got {value!r}")
    if value == "fp8" and device is not None and torch.device(device).type != "cuda":
        raise ValueError(
            f"kv_dtype: 'fp8' (float8_e4m3fn) needs CUDA, and this model is on {torch.device(device).type}; "
            "use kv_dtype='int8'"
        )
    return value


def kind_of(dtype: torch.dtype) -> str | None:
    """The ``kv_dtype`` a stored tensor of ``dtype`` stands for (``None``: a float one, not quantized)."""
    return next((name for name, stored in STORAGE.items() if stored == dtype), None)


def groups(size: int) -> int:
    """How many scales a head of ``size`` channels has per token: ``size / GROUP``, or 1 where
    :data:`GROUP` does not divide ``size``."""
    return size // GROUP if size % GROUP == 0 else 1


def quantize(x: torch.Tensor, kv_dtype: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``x`` ``[..., D]``: ``q`` in the 8-bit dtype of ``kv_dtype``, ``scale``
    ``[..., G]`` (:func:`groups`) in ``x``'s dtype (see the module). Computed in float32, whatever
    ``x``'s dtype."""
    largest, size = LARGEST[kv_dtype], x.shape[-1]
    grouped = x.float().unflatten(-1, (groups(size), -1))  # [..., G, D / G]
    scale = (grouped.abs().amax(dim=-1) / largest).to(x.dtype)  # stored in the compute dtype ...
    safe = scale.float().masked_fill(scale == 0, 1.0)[..., None]  # ... quantize against it rounded
    scaled = (grouped / safe).flatten(-2)
    if kv_dtype == "int8":
        q = scaled.round().clamp(-largest, largest).to(torch.int8)
    else:
        q = scaled.clamp(-largest, largest).to(STORAGE[kv_dtype])
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (default: the scale's, the compute dtype): ``[..., D]``, each
    scale of ``scale`` ``[..., G]`` multiplying its group of ``D / G`` channels."""
    dtype = scale.dtype if dtype is None else dtype
    grouped = q.to(dtype).unflatten(-1, (scale.shape[-1], -1))
    return (grouped * scale.to(dtype)[..., None]).flatten(-2)
