"""The weight-rounding probe: its int8 rounding, and that it gives the engine back as it found it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evals import datasets, weight_error


def test_int8_rounding_error_is_within_half_a_step_of_its_own_scale():
    torch.manual_seed(0)
    weight = torch.randn(48, 96) * torch.linspace(0.1, 10, 96)  # columns of very different sizes
    for group in (None, 32):
        rounded = weight_error.round_int8(weight, group)
        size = 96 if group is None else group
        step = weight.reshape(48, -1, size).abs().amax(-1, keepdim=True) / 127
        error = (rounded - weight).reshape(48, -1, size).abs()
        assert (error <= step / 2 + 1e-6).all()
        assert len(torch.unique(rounded.reshape(48, -1, size)[0, 0] / step[0, 0])) > 20  # really int8 levels
    assert (weight_error.round_int8(weight, 32) - weight).abs().mean() < (
        weight_error.round_int8(weight) - weight
    ).abs().mean()
    with pytest.raises(ValueError, match="group 64: does not divide 96"):
        weight_error.round_int8(weight, 64)


def test_measure_orders_the_roundings_and_restores_the_engine(tiny):
    examples = datasets.nq_examples(2, [3], ["middle"], 0)
    ids = torch.as_tensor(tiny.request(examples[0].question, list(examples[0].documents)).input_ids)
    with torch.no_grad():
        before = tiny.model(ids[None]).logits
    layers = [m for m in tiny.model.modules() if isinstance(m, nn.Linear)]
    schemes = ["bfloat16 weights", "int8 per channel (float32 product)", "int8 per channel: head only"]
    records = {r["scheme"]: r for r in weight_error.measure(tiny, examples, 1, 4, schemes, say=lambda _: None)}
    assert 0 < records["bfloat16 weights"]["kl"] < records["int8 per channel (float32 product)"]["kl"]
    assert 0 <= records["int8 per channel (float32 product)"]["identical"] <= 2
    assert "identical" not in records["int8 per channel: head only"]  # KL only
    assert [m for m in tiny.model.modules() if isinstance(m, nn.Linear)] == layers
    with torch.no_grad():
        assert torch.equal(tiny.model(ids[None]).logits, before)
