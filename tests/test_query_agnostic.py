"""Query-agnostic selection: the documents decide what is kept, not the question (key norms).
Checked against a loop-by-loop reference, for independence from the question, and end to end
through the engine with a batch equal to single calls."""

from __future__ import annotations

import math

import pytest
import torch

from snapkv_rag import KeyNormConfig, SnapKVConfig
from snapkv_rag.compression import key_norm_select, select

from snapkv_testing import filler_documents, seeded


def reference_key_norm(k, cfg):
    """One batch row ``[H_kv, L, D]``: per head, the kept positions by a plain-Python ranking of
    minus the pooled key norms (ties to the earlier position), plus the window."""
    h_kv, length, _ = k.shape
    prefix = length - cfg.window_size
    half = cfg.kernel_size // 2
    kept = []
    for head in range(h_kv):
        scores = [-math.sqrt(sum(float(x) ** 2 for x in k[head, j])) for j in range(prefix)]
        pooled = [max(scores[max(0, j - half): j + half + 1]) for j in range(prefix)]
        best = sorted(range(prefix), key=lambda j: (-pooled[j], j))[: cfg.max_capacity_prompt - cfg.window_size]
        kept.append(sorted(best) + list(range(prefix, length)))
    return kept


@pytest.mark.parametrize("kernel_size", [1, 5])
def test_key_norm_keeps_the_shortest_keys_and_the_window(kernel_size):
    cfg = KeyNormConfig(max_capacity_prompt=16, window_size=4, kernel_size=kernel_size)
    g = seeded(3)
    k = torch.randn(2, 2, 40, 8, generator=g) * torch.rand(2, 2, 40, 1, generator=g) * 3
    v = torch.randn(2, 2, 40, 8, generator=g)
    keys, values, kept = key_norm_select(k, v, cfg)
    assert kept.shape == (2, 2, 16)
    for row in range(2):
        assert kept[row].tolist() == reference_key_norm(k[row], cfg)
        for head in range(2):
            assert torch.equal(keys[row, head], k[row, head, kept[row, head]])
            assert torch.equal(values[row, head], v[row, head, kept[row, head]])


def test_key_norm_does_not_look_at_the_question():
    cfg = KeyNormConfig(max_capacity_prompt=16, window_size=4)
    g = seeded(4)
    k, v = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    picks = {tuple(select(cfg, torch.randn(1, 4, 40, 8, generator=g), k, v, None, 0, 2)[2].flatten().tolist())
             for _ in range(3)}
    assert len(picks) == 1  # three different "questions", one selection
    snap = SnapKVConfig(max_capacity_prompt=16, window_size=4)
    assert len({tuple(select(snap, torch.randn(1, 4, 40, 8, generator=g), k, v, None, 0, 2)[2].flatten().tolist())
                for _ in range(3)}) > 1  # while SnapKV's depends on it


def test_key_norm_through_the_engine_batch_equals_single_calls(tiny_engine):
    cfg = KeyNormConfig(max_capacity_prompt=64, window_size=8)
    questions = ["Which harbour lies north?", "Name the orchard.", "What lies north?"]
    docs = [filler_documents(5), filler_documents(2), filler_documents(3)]
    batch = tiny_engine.generate_batch(questions, docs, snapkv=cfg, max_new_tokens=6)
    single = [tiny_engine.generate(q, d, snapkv=cfg, max_new_tokens=6) for q, d in zip(questions, docs)]
    assert [r.text for r in batch] == [r.text for r in single]
    assert all(r.compression.method == "keynorm" and r.compression.kept_tokens[0] == 64 for r in single)
    assert [r.compression.kept_tokens for r in batch] == [r.compression.kept_tokens for r in single]


def test_key_norm_everywhere_a_method_is_chosen():
    from evals.methods import parse_spec
    from snapkv_rag.cli import _config, build_parser
    from snapkv_rag.server.protocol import ServerSettings, _compression

    args = build_parser().parse_args(["ask", "q?", "--docs", "a.txt", "--method", "keynorm", "--budget", "25%"])
    assert _config(args) == KeyNormConfig(ratio=0.25)
    assert parse_spec("keynorm@25%").config(400) == KeyNormConfig(max_capacity_prompt=400)
    got = _compression({"method": "keynorm", "budget": 256}, ServerSettings(model_name="tiny"))
    assert got == KeyNormConfig(max_capacity_prompt=256)
