"""Head-adaptive SnapKV (Ada-SnapKV) on a tiny random-weight Llama: the layer's budget shared between
its heads by vote, ragged heads stored padded to the layer's largest and their empty slots never
attended."""

from __future__ import annotations

import pytest
import torch
from snapkv_testing import filler_documents, poisoning_empty_slots

from snapkv_rag import AdaSnapKVConfig, SnapKVConfig
from snapkv_rag.methods import adaptive
from snapkv_rag.methods.adaptive import EMPTY, ada_snapkv_select, head_counts, trim_padding

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTION = "Which harbour lies north?"
DOCS = filler_documents(6)


def test_head_counts_share_the_budget_by_vote_above_the_floor():
    spread = torch.tensor([[[5.0, 4, 3, 2, 1, 0], [9, 8, 7, 6, 5.5, 5.2]]])  # each head's scores, best first
    assert head_counts(spread, 3, 1).tolist() == [[1, 5]]  # the second head's votes are all higher
    assert head_counts(spread, 3, 2).tolist() == [[2, 4]]  # ... but each keeps its floor
    assert head_counts(spread, 3, 3).tolist() == [[3, 3]]  # a full floor is SnapKV's even split


def test_head_counts_within_a_memory_bound_stop_where_the_first_head_is_full():
    spread = torch.tensor([[[5.0, 4, 3, 2, 1, 0], [9, 8, 7, 6, 5.5, 5.2]]])
    assert head_counts(spread, 3, 0, most=3).tolist() == [[0, 3]]
    assert head_counts(spread, 3, 1, most=3).tolist() == [[1, 3]]  # the floors, then the ranking to a full head
    assert head_counts(spread, 3, 3, most=3).tolist() == [[3, 3]]
    alternating = torch.tensor([[[9.0, 7, 5, 3], [8, 6, 4, 2]]])  # 9, 8, 7: the first head is full there
    assert head_counts(alternating, 2, 0, most=2).tolist() == [[2, 1]]


def test_selection_is_ragged_padded_and_keeps_the_window():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    q[:, :2] *= 4  # sharper attention in the first KV head's queries
    keys, values, kept = ada_snapkv_select(
        q[..., -8:, :], k, v, AdaSnapKVConfig(max_capacity_prompt=20, window_size=8, floor=0.0)
    )
    held = (kept >= 0).sum(-1)
    assert held.max() == 20 and kept.shape[-1] <= 20  # the widest head holds the budget: a memory bound
    assert held.sum() <= 2 * 20 and held[0, 0] != held[0, 1]  # within the layer's budget, shared unevenly
    for head in range(2):
        real = kept[0, head][kept[0, head] >= 0]
        assert real[-8:].tolist() == list(range(32, 40))  # the window, whole
        assert torch.equal(keys[0, head][kept[0, head] >= 0], k[0, head, real])
        assert (
            keys[0, head][kept[0, head] == EMPTY].abs().sum() == 0
            and values[0, head][kept[0, head] == EMPTY].abs().sum() == 0
        )
    trimmed = trim_padding(keys, values, kept)[2]
    assert trimmed.shape[-1] == int(held.max()) and (trimmed[0] >= 0).sum() == held.sum()


def test_a_full_floor_is_snapkv(tiny_engine):
    even = AdaSnapKVConfig(max_capacity_prompt=64, window_size=8, floor=1.0)
    plain = SnapKVConfig(max_capacity_prompt=64, window_size=8)
    ada, snap = (tiny_engine.generate(QUESTION, DOCS, snapkv=c, max_new_tokens=8) for c in (even, plain))
    assert ada.raw_text == snap.raw_text and ada.compression.kept_tokens == snap.compression.kept_tokens
    assert ada.compression.method == "adasnapkv"


def test_empty_slots_are_never_attended(tiny_engine, monkeypatch):
    """Filling the empty slots with huge keys and values changes nothing: they are masked."""
    config = AdaSnapKVConfig(max_capacity_prompt=64, window_size=8, floor=0.0)
    clean = tiny_engine.generate(QUESTION, DOCS, snapkv=config, max_new_tokens=12, ignore_eos=True)
    seen = []
    monkeypatch.setattr(adaptive, "ada_snapkv_select", poisoning_empty_slots(adaptive.ada_snapkv_select, seen))
    dirty = tiny_engine.generate(QUESTION, DOCS, snapkv=config, max_new_tokens=12, ignore_eos=True)
    assert sum(seen) > 0  # some heads did hold fewer slots than others
    assert dirty.raw_text == clean.raw_text


def test_batch_equals_single_and_the_hit_rate_counts_each_heads_own_slots(tiny_engine):
    config = AdaSnapKVConfig(max_capacity_prompt=64, window_size=8, floor=0.0)
    questions, docs = (
        [QUESTION, "Name the orchard.", "What lies north?"],
        [DOCS, filler_documents(2), filler_documents(4)],
    )
    batch = tiny_engine.generate_batch(questions, docs, snapkv=config, max_new_tokens=8, ignore_eos=True)
    single = [
        tiny_engine.generate(q, d, snapkv=config, max_new_tokens=8, ignore_eos=True) for q, d in zip(questions, docs)
    ]
    assert [r.raw_text for r in batch] == [r.raw_text for r in single]
    both = tiny_engine.compare(QUESTION, DOCS, methods={"full": None, "ada": config}, max_new_tokens=6)
    assert 0.0 <= both.hit_rate["ada"] <= 1.0


def test_bad_floor_is_refused():
    with pytest.raises(ValueError, match="floor: must be a share between 0 and 1"):
        AdaSnapKVConfig(floor=1.5)


def test_chosen_by_name_in_the_server_the_cli_and_the_evals(tiny_engine):
    import httpx
    from server_testing import running_server

    from evals.methods import parse_spec
    from snapkv_rag.cli import _config, build_parser

    assert _config(
        build_parser().parse_args(["ask", "q?", "--docs", "a.txt", "--method", "adasnapkv"])
    ) == AdaSnapKVConfig(ratio=0.5, min_capacity_prompt=512)  # the default budget, its floor
    assert parse_spec("adasnapkv@25%").config(400) == AdaSnapKVConfig(max_capacity_prompt=400)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": DOCS,
        "max_tokens": 3,
        "snapkv": {"method": "adasnapkv", "budget": 64, "window_size": 8},
    }
    with running_server(tiny_engine) as (url, _):
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["snapkv"]["compression"]["method"] == "adasnapkv"
    from snapkv_rag.server.protocol import ServerSettings
    from snapkv_rag.server.protocol import _compression as snapkv_config

    settings = ServerSettings(model_name="tiny", compression=SnapKVConfig())
    assert snapkv_config({"method": "adasnapkv", "floor": 0.5}, settings) == AdaSnapKVConfig(floor=0.5)
    assert snapkv_config({"method": "kvzip", "share": "layer"}, settings).share == "layer"
    with pytest.raises(Exception, match="not a setting of method snapkv"):
        snapkv_config({"floor": 0.5}, settings)
    with pytest.raises(Exception, match="not a setting of method adasnapkv"):
        snapkv_config({"method": "adasnapkv", "share": "model"}, settings)
