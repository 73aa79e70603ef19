"""Weights in 8 or 4 bits: ``quantize="int8"`` or ``"int4"`` replaces a loaded model's linear layers
(the attention projections and MLPs of every block, and with int8 the output head: measured faster,
:data:`HEAD_BY_DEFAULT`) by quantized ones; the token embedding stays as it is. Decoding reads every
weight once a step, so fewer weight bytes are fewer bytes a step reads.

The kernels are the fastest this project measured per device (``benchmarks/quantized.py``):

* CPU ``int8``: weight-only, one scale per output channel, through torch's int8 weight-only CPU
  matmul for decode steps, which reads the int8 weights and takes bfloat16 activations (a float32
  model's activations are rounded to bfloat16 for the product only; every other operation keeps its
  dtype), and a dense matmul of the dequantized weights for prefill chunks (:class:`Int8Linear`). Rows are
  computed independently, so batches equal single calls. An earlier kernel quantized the
  activations too (int8 x int8 integer matmul): about as fast, but it changed far more answers
  (``evals/results/quantized``), the activations of a small model carrying the outliers.
* CPU ``int4``: weight-only, 4-bit groups of 32-128 input channels with a scale and a zero each,
  through torch's int4 CPU matmul (float32 or bfloat16 activations) for decode steps, and a dense
  matmul of the unpacked weights for prefill chunks (:class:`Int4Linear`): the smallest weights,
  decoding slower than float32 on a CPU (reported by the benchmark, not hidden).
* CUDA: torchao's weight-only configs (``Int8WeightOnlyConfig``; ``Int4WeightOnlyConfig`` with
  group 128 in the tensor-core tile layout, bfloat16 only).

A model the caller quantized already (transformers' ``quantization_config``: torchao, bitsandbytes,
GPTQ, ...) needs none of this: the engine runs it as it is.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

SCHEMES = ("int8", "int4")
INT4_GROUPS = (128, 64, 32)  # the largest that divides a layer's input channels
_INT4_BLOCK = 64  # output rows the int4 CPU kernel packs together
_HALF = (torch.bfloat16, torch.float16)  # activation dtypes the int8 kernel takes as they are
log = logging.getLogger(__name__)


def check_quantize(value) -> str | None:
    """``None`` or one of :data:`SCHEMES`; anything else a ValueError naming the option."""
    if value is None or value in SCHEMES:
        return value
    raise ValueError(f"quantize: expected None, 'int8' or 'int4' (weight quantization), got {value!r}")


def quantized_by(model: nn.Module) -> str | None:
    """How ``model``'s weights are quantized: ours (``"int8"``/``"int4"``), the method of a
    transformers ``quantization_config`` (``"torchao"``, ``"bitsandbytes"``, ...), or None."""
    ours = getattr(model, "snapkv_quantized", None)
    if ours:
        return ours
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return str(getattr(method, "value", method) or "quantized")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a forward pass reads: parameters and buffers, quantized layers at their
    packed size (what a decode step's bandwidth floor is computed from)."""
    total = 0
    for module in model.modules():
        own = getattr(module, "packed_bytes", None)
        if own is not None:
            total += own
            continue
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            total += _tensor_bytes(tensor)
    return total


def _tensor_bytes(tensor: torch.Tensor) -> int:
    inner = getattr(tensor, "__tensor_flatten__", None)
    if inner is not None:  # a torchao tensor subclass: its stored tensors
        names, _ = inner()
        return sum(_tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


HEAD_BY_DEFAULT = {"int8": True, "int4": False}
"""Whether a scheme quantizes the output head too (as a copy where it shares its weight with the
embedding, which stays as it is). Measured by ``benchmarks/quantized.py`` on the embedded model,
whose head is a fifth of its weights: int8 with the head decoded 1.74x float32's tokens/s at batch
1 and 1.40x at batch 8, against 1.43x and 1.54x without it (``results/quantized.json``, 3 rounds),
and 1.22x and 1.56x against 1.19x and 1.37x in a run of 5 (``results/quantized_rounds5.json``): the
head is kept quantized, faster at batch 1 in both; int4 with the head gained at batch 1 and lost at
batch 8 (``results/quantized_int4.txt``), so it keeps the float head."""


def quantize_model(model: nn.Module, scheme: str, head: bool | None = None) -> nn.Module:
    """Quantize ``model``'s linear layers in place and return it; the output head too where
    ``head`` (``None``: :data:`HEAD_BY_DEFAULT` for the scheme)."""
    scheme = check_quantize(scheme)
    head = HEAD_BY_DEFAULT[scheme] if head is None else head
    already = quantized_by(model)
    if already:
        raise ValueError(
            f"quantize={scheme!r}: this model is quantized already ({already}); run it as it is (quantize=None)"
        )
    device = next(model.parameters()).device
    output = model.get_output_embeddings()
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and (head or module is not output)
    ]
    if not targets:
        raise ValueError(f"quantize={scheme!r}: this model has no nn.Linear layers to quantize")
    if device.type == "cuda":
        _quantize_cuda(model, scheme, {id(module) for _, module in targets})
    elif device.type == "cpu":
        _quantize_cpu(model, scheme, targets)
    else:
        raise ValueError(f"quantize={scheme!r}: runs on 'cpu' or 'cuda', not on {device.type!r}")
    model.snapkv_quantized = scheme
    log.info("quantized %d linear layers to %s (%s)", len(targets), scheme, device.type)
    return model


def _quantize_cpu(model: nn.Module, scheme: str, targets: list[tuple[str, nn.Linear]]) -> None:
    layer = Int8Linear if scheme == "int8" else Int4Linear
    for name, module in targets:
        if scheme == "int4" and module.in_features % INT4_GROUPS[-1]:
            log.info("quantize='int4': %s kept as it is (%d inputs, not a multiple of 32)", name, module.in_features)
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer(module))


def _quantize_cuda(model: nn.Module, scheme: str, targets: set[int]) -> None:
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as error:
        raise ValueError(
            f"quantize={scheme!r} on CUDA needs torchao: pip install 'snapkv-rag[quantize]' ({error})"
        ) from error
    if scheme == "int4":
        if next(model.parameters()).dtype != torch.bfloat16:
            raise ValueError("quantize='int4' on CUDA runs bfloat16 tensor-core kernels: load with dtype='bfloat16'")
        config = Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    else:
        config = Int8WeightOnlyConfig()
    quantize_(model, config, filter_fn=lambda module, _name: id(module) in targets)


class Int8Linear(nn.Module):
    """A weight-only int8 linear layer: int8 weights with a scale per output channel.

    A decode step (one token a row) multiplies them by bfloat16 (or float16) activations in torch's
    int8 weight-only kernel, the result coming back in the input's dtype. That kernel is slower than
    a dense matmul once a call has many rows (a prefill of 1,000 tokens took 1.7x float32's time),
    so a call of several tokens a row (a prefill chunk) multiplies the dequantized weights, in the
    input's dtype, in one dense matmul: the int8 values and scales the kernel reads, without its
    rounding of the activations to bfloat16, the cost of dequantizing shared by the chunk's tokens.
    Decode rows go through the kernel whatever their batch, prefill rows through the dense matmul
    whatever theirs, so batches equal single calls."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype if linear.weight.dtype in _HALF else torch.bfloat16
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("weight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(self.compute_dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.dense_prefill = True  # False: every call through the kernel (what the benchmark compares)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights the kernel multiplies by, ``int8 * scale``, in ``dtype``."""
        return (self.weight.to(torch.float32) * self.scale.to(torch.float32)[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_prefill and x.dim() > 2 and x.shape[-2] > 1:  # a prefill chunk: one dense matmul
            return nn.functional.linear(x, self.dequantized(x.dtype), self.bias)
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scale).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


class Int4Linear(nn.Module):
    """A weight-only 4-bit linear layer: groups of ``group`` input channels share a scale and a zero
    (asymmetric, codes 0..15), packed for torch's int4 CPU matmul.

    That kernel is fast for a decode step (one token a row) but its time grows with every row, so a
    prefill of a thousand tokens took seconds a layer. A call of several tokens a row (a prefill
    chunk) instead unpacks the 4-bit codes into float weights of the input's dtype, the same values
    the kernel multiplies by, and runs one dense matmul: the cost of unpacking is shared by all the
    chunk's tokens. Decode rows go through the kernel whatever their batch, prefill rows through
    the dense matmul whatever theirs, so batches still equal single calls."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group = next(g for g in INT4_GROUPS if self.in_features % g == 0)
        groups = weight.reshape(self.out_features, -1, self.group)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8)
        codes = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(self.out_features, -1)
        zero = low + 8 * scale  # the kernel computes (code - 8) * scale + zero
        dtype = linear.weight.dtype
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        pairs = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", pairs.to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.unpacks = self.out_features % _INT4_BLOCK == 0 and torch.equal(self._codes(), codes)

    def _codes(self) -> torch.Tensor:
        """The 4-bit codes back out of the kernel's layout: output rows in blocks of 64, each byte
        holding row ``j`` of its block in the low nibble and row ``j + 32`` in the high one, for one
        input channel. Checked at construction against the codes packed (else never used)."""
        blocks = self.packed.reshape(-1, self.in_features, _INT4_BLOCK // 2)
        nibbles = torch.stack([blocks & 15, blocks >> 4], dim=1)  # block, half, input, row
        return nibbles.permute(0, 1, 3, 2).reshape(self.out_features, self.in_features).to(torch.int32)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weights the kernel multiplies by: ``(code - 8) * scale + zero`` per group."""
        scale, zero = self.scales_and_zeros.float().permute(2, 1, 0)  # each [out, groups]
        codes = (self._codes() - 8).to(torch.float32).reshape(self.out_features, -1, self.group)
        weight = codes * scale[..., None] + zero[..., None]
        return weight.reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unpacks and x.dim() > 2 and x.shape[-2] > 1:  # a prefill chunk: one dense matmul
            return nn.functional.linear(x, self.dequantized(x.dtype), self.bias)
        flat = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weights, group={self.group}"
