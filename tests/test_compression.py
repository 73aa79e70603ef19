"""The pure selection functions against a slow, obviously-correct reference."""

from __future__ import annotations

import math

import pytest
import torch
from snapkv_testing import seeded

from snapkv_rag import H2OConfig, PyramidKVConfig, RandomConfig, SnapKVConfig, StreamingLLMConfig
from snapkv_rag.methods.selection import h2o_select, random_select, snapkv_select, streaming_select


def reference_votes(q, k, cfg):
    """Loop-by-loop SnapKV votes for one batch row: pooled prefix votes per KV head."""
    h, w, d = q.shape
    h_kv, length, _ = k.shape
    group = h // h_kv
    prefix = length - w
    kept = []
    for kv in range(h_kv):
        votes = [0.0] * prefix
        for head in range(kv * group, (kv + 1) * group):
            for i in range(w):
                pos = prefix + i
                logits = [float(q[head, i] @ k[kv, j]) / math.sqrt(d) for j in range(pos + 1)]
                top = max(logits)
                exps = [math.exp(x - top) for x in logits]
                total = sum(exps)
                for j in range(prefix):
                    votes[j] += exps[j] / total / group
        half = cfg.kernel_size // 2
        kept.append([max(votes[max(0, j - half) : j + half + 1]) for j in range(prefix)])
    return kept


def random_qkv(batch=1, heads=4, kv_heads=2, length=40, window=4, dim=8, seed=0):
    g = seeded(seed)
    q = torch.randn(batch, heads, window, dim, generator=g)
    k = torch.randn(batch, kv_heads, length, dim, generator=g)
    v = torch.randn(batch, kv_heads, length, dim, generator=g)
    return q, k, v


@pytest.mark.parametrize("kernel_size", [1, 3, 7])
def test_snapkv_matches_reference_with_gqa(kernel_size):
    cfg = SnapKVConfig(max_capacity_prompt=16, window_size=4, kernel_size=kernel_size)
    q, k, v = random_qkv()
    keys, values, kept = snapkv_select(q, k, v, cfg)
    assert keys.shape == (1, 2, 16, 8) and values.shape == (1, 2, 16, 8)  # KV-head size, not query-head size
    assert kept.shape == (1, 2, 16)
    assert torch.equal(kept, kept.sort(dim=-1).values)
    for head, pooled in enumerate(reference_votes(q[0], k[0], cfg)):
        positions = kept[0, head].tolist()
        assert positions[-4:] == [36, 37, 38, 39]  # the observation window
        chosen, rest = positions[:-4], [j for j in range(36) if j not in positions]
        # a top-12 of the reference's pooled votes (max pooling makes plateaus: ties may go either way)
        assert min(pooled[j] for j in chosen) >= max(pooled[j] for j in rest) - 1e-6
        if kernel_size == 1:
            assert sorted(chosen) == sorted(sorted(range(36), key=lambda j: -pooled[j])[:12])
        assert torch.equal(keys[0, head], k[0, head, kept[0, head]])
        assert torch.equal(values[0, head], v[0, head, kept[0, head]])


def test_window_is_always_kept_and_short_prompts_untouched():
    cfg = SnapKVConfig(max_capacity_prompt=12, window_size=4, kernel_size=5, pooling="avg")
    q, k, v = random_qkv(length=30)
    _, _, kept = snapkv_select(q, k, v, cfg)
    assert set(range(26, 30)) <= set(kept[0, 0].tolist())
    q, k, v = random_qkv(length=12)
    keys, values, kept = snapkv_select(q, k, v, cfg)
    assert torch.equal(keys, k) and torch.equal(values, v)
    assert kept[0, 1].tolist() == list(range(12))


def test_padding_is_never_kept_or_voted_for():
    cfg = SnapKVConfig(max_capacity_prompt=10, window_size=4, kernel_size=1)  # no plateaus: exact comparison
    q, k, v = random_qkv(batch=2, length=40)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :15] = 0  # row 1 is left-padded: 25 real tokens
    k_pad = k.clone()
    k_pad[1, :, :15] = 100.0  # pads that would win every vote if they were seen
    _, _, kept = snapkv_select(q, k_pad, v, cfg, attention_mask=mask)
    assert kept[1].min() >= 15
    # the real part of the padded row selects as it would alone
    _, _, alone = snapkv_select(q[1:], k[1:, :, 15:], v[1:, :, 15:], cfg)
    assert torch.equal(kept[1] - 15, alone[0])
    _, _, pooled = snapkv_select(
        q, k_pad, v, SnapKVConfig(max_capacity_prompt=10, window_size=4, kernel_size=7), attention_mask=mask
    )
    assert pooled[1].min() >= 15  # pooling next to the pads does not let a pad in


def test_row_shorter_than_budget_keeps_all_its_tokens_and_pads_first():
    cfg = SnapKVConfig(max_capacity_prompt=10, window_size=4)
    q, k, v = random_qkv(batch=2, length=20)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :14] = 0  # 6 real tokens < budget 10
    _, _, kept = snapkv_select(q, k, v, cfg, attention_mask=mask)
    real = kept[1][kept[1] >= 14]
    assert real.sort().values.tolist() == [list(range(14, 20))] * 2 or all(
        sorted(kept[1, h][kept[1, h] >= 14].tolist()) == list(range(14, 20)) for h in range(2)
    )
    assert all((kept[1, h][:4] < 14).all() for h in range(2))  # the pads sort first


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("max_capacity_prompt", {"max_capacity_prompt": 32, "window_size": 32}),
        ("window_size", {"window_size": 0}),
        ("kernel_size", {"kernel_size": 4}),
        ("kernel_size", {"kernel_size": -1}),
        ("pooling", {"pooling": "median"}),
    ],
)
def test_config_rejects_impossible_values(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SnapKVConfig(**kwargs)


def test_streaming_keeps_sinks_and_recent():
    cfg = StreamingLLMConfig(max_capacity_prompt=10, sink_tokens=3)
    _, k, v = random_qkv(length=30)
    _, _, kept = streaming_select(k, v, cfg)
    assert kept[0, 0].tolist() == [0, 1, 2] + list(range(23, 30))


def test_h2o_prefers_keys_every_query_attends_to():
    cfg = H2OConfig(max_capacity_prompt=8, recent_size=4)
    q, k, v = random_qkv(length=30, window=30)
    shared = torch.randn(8, generator=seeded(1))
    q = q + 2 * shared  # every query shares one direction...
    k[:, :, 7] = 3 * shared  # ...and one key points along it
    _, _, kept = h2o_select(q, k, v, cfg)
    assert 7 in kept[0, 0].tolist() and 7 in kept[0, 1].tolist()
    assert kept.shape[-1] == 8


def test_random_is_seeded_and_pyramid_budgets_shrink_from_the_budget():
    cfg = RandomConfig(max_capacity_prompt=10, recent_size=2, seed=3)
    _, k, v = random_qkv(length=30)
    assert torch.equal(random_select(k, v, cfg)[2], random_select(k, v, cfg)[2])
    pyramid = PyramidKVConfig(max_capacity_prompt=256, window_size=32)
    budgets = [pyramid.budget_for_layer(i, 30) for i in range(30)]
    assert budgets[0] == 256 > budgets[-1] > 32  # the budget is a memory bound: no layer above it
    assert budgets == sorted(budgets, reverse=True) and budgets[-1] == round(32 + 224 * 0.2)


@pytest.mark.parametrize(
    "config",
    [
        SnapKVConfig(max_capacity_prompt=40, window_size=4),
        PyramidKVConfig(max_capacity_prompt=40, window_size=4),
        StreamingLLMConfig(max_capacity_prompt=40, sink_tokens=4),
        H2OConfig(max_capacity_prompt=40, recent_size=4),
        RandomConfig(max_capacity_prompt=40, recent_size=4),
    ],
    ids=lambda c: type(c).__name__,
)
@pytest.mark.parametrize("length", [3, 20, 39, 40])
def test_every_method_keeps_a_prompt_no_longer_than_its_budget(config, length):
    # a prompt shorter than the recent window itself included (a short question in an eval cell
    # whose budget comes from the cell's mean prompt)

    q, k, v = random_qkv(length=length, window=length)
    keys, values, kept = config.select(q, k, v, None, layer_idx=0, num_layers=2)
    assert torch.equal(keys, k) and torch.equal(values, v)
    assert kept[0, 0].tolist() == list(range(length))
