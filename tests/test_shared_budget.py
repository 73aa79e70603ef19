"""KVzip with one budget for the whole model (``share="layer"`` / ``"model"``): positions of every
layer and head ranked together, the total of the even split kept, ragged heads stored padded and
their empty slots never attended, on a tiny random-weight Llama and through the document store."""

from __future__ import annotations

import pytest
import torch
from snapkv_testing import filler_documents, poisoning_empty_slots

from snapkv_rag import KVzipConfig, SnapKVLLM
from snapkv_rag.methods import shared_budget
from snapkv_rag.methods.adaptive import EMPTY
from snapkv_rag.methods.shared_budget import global_counts, keep_counts

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTIONS = ["What lies north?", "Which castle is number 40?"]
DOCS = filler_documents(6)
MODEL = KVzipConfig(max_capacity_prompt=48, window_size=8, share="model", sink_tokens=2)


def test_counts_come_from_one_ranking_of_every_layer_and_head():
    first = torch.tensor([[9.0, 8, 0.5], [1, 0, 0.2]])  # layer 0: two heads
    second = torch.tensor([[7.0, 6, 5]])  # layer 1: one head
    assert [c.tolist() for c in global_counts([first, second], 4, "model")] == [[2, 0], [2]]
    # "layer": the layer's count from the same ranking, split evenly between its heads
    assert [c.tolist() for c in global_counts([first, second], 5, "layer")] == [[1, 1], [3]]
    never, always = float("-inf"), float("inf")
    scored = torch.tensor([[never, 3.0, always, 1.0]])
    assert global_counts([scored], 9, "model")[0].tolist() == [3]  # a -inf position is never kept
    assert global_counts([scored], 1, "model")[0].tolist() == [1]
    with pytest.raises(ValueError, match="share"):
        global_counts([scored], 1, "head")


def test_within_each_layers_bound_a_layer_follows_the_ranking_until_it_is_full():
    first = torch.tensor([[9.0, 8, 0.5], [1, 0, 0.2]])  # layer 0: two heads
    second = torch.tensor([[7.0, 6, 5]])  # layer 1: one head
    # "model": layer 0 stops where its first head holds 2, whatever the total left
    assert [c.tolist() for c in global_counts([first, second], 6, "model", most=[2, 2])] == [[2, 0], [2]]
    # "layer": no layer past H x most, split evenly
    assert [c.tolist() for c in global_counts([first, second], 6, "layer", most=[1, 2])] == [[1, 1], [2]]
    sinks = torch.tensor([[float("inf"), float("inf"), 3.0], [float("inf"), float("inf"), 9.0]])
    assert global_counts([sinks], 6, "model", most=[2])[0].tolist() == [2, 2]  # every head's sinks kept


def test_fitting_the_slots_keeps_the_padded_storage_within_the_budget():
    torch.manual_seed(0)
    scores = [torch.randn(3, 50) * torch.tensor([[3.0], [1.0], [0.5]]) for _ in range(4)]  # one sharp head
    loose = global_counts(scores, 240, "model")
    fitted = global_counts(scores, 240, "model", fit="slots")
    assert sum(int(c.sum()) for c in loose) == 240 and sum(3 * int(c.max()) for c in loose) > 240
    assert sum(3 * int(c.max()) for c in fitted) <= 240  # padded to each layer's widest head: still fits
    assert sum(int(c.sum()) for c in fitted) < 240
    # the best positions first: one more of the ranking would no longer fit
    more = global_counts(scores, sum(int(c.sum()) for c in fitted) + 1, "model")
    assert sum(3 * int(c.max()) for c in more) > 240


def test_keep_counts_is_ragged_padded_and_keeps_the_window():
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4)
    scores = torch.randn(1, 2, 16)
    keys, values, kept = keep_counts(scores, k, v, torch.tensor([5, 2]), window=4)
    assert kept.shape == (1, 2, 9)
    for head, count in enumerate([5, 2]):
        real = kept[0, head][kept[0, head] >= 0]
        assert len(real) == count + 4 and real[-4:].tolist() == [16, 17, 18, 19]
        assert set(real[:-4].tolist()) == set(scores[0, head].argsort(descending=True)[:count].tolist())
        assert torch.equal(keys[0, head][kept[0, head] >= 0], k[0, head, real])
        assert keys[0, head][kept[0, head] == EMPTY].abs().sum() == 0
        assert values[0, head][kept[0, head] == EMPTY].abs().sum() == 0


@pytest.fixture()
def llm(tiny_model, tokenizer):
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=10)


@pytest.mark.parametrize("share", ["layer", "model"])
def test_the_whole_model_keeps_each_layer_within_its_budget_and_the_sinks(llm, share):
    config = KVzipConfig(max_capacity_prompt=48, window_size=8, share=share, sink_tokens=2)
    ids = llm.request(QUESTIONS[0], DOCS).input_ids
    layers = llm.runner.prefill([list(ids)], {"": config}).compressed[""][0].layers
    heads = layers[0].positions.shape[1]
    held = [(kv.positions >= 0).sum(-1)[0] for kv in layers]
    assert sum(int(h.sum()) for h in held) <= len(layers) * heads * 48  # at most the even split's total
    for kv, h in zip(layers, held):
        assert kv.slots <= 48 and int(h.max()) == 48  # the budget is a memory bound, and it is used
        for head in range(heads):
            real = kv.positions[0, head][kv.positions[0, head] >= 0].tolist()
            assert real[:2] == [0, 1] and real[-8:] == list(range(len(ids) - 8, len(ids)))  # sinks, window
    if share == "layer":  # within the bound every dense layer fills its budget
        assert all(int(h.min()) == 48 for h in held)
    else:  # the ranking's own split: heads that hold less
        assert any(int(h.min()) < 48 for h in held)


def test_empty_slots_are_never_attended_over_a_handle_or_in_a_request(llm, tiny_model, tokenizer, monkeypatch):
    """Filling the empty slots with huge keys and values changes no token, both where a question's
    tail runs over a stored set and where a request is compressed and decoded."""
    handle = llm.index_documents(DOCS, method=MODEL)
    clean = [handle.generate(q, ignore_eos=True).raw_text for q in QUESTIONS]
    direct = llm.generate(QUESTIONS[0], DOCS, snapkv=MODEL, ignore_eos=True).raw_text
    seen = []
    monkeypatch.setattr(shared_budget, "keep_counts", poisoning_empty_slots(shared_budget.keep_counts, seen))
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=10)  # an empty store
    dirty = llm.index_documents(DOCS, method=MODEL)
    assert [dirty.generate(q, ignore_eos=True).raw_text for q in QUESTIONS] == clean
    assert llm.generate(QUESTIONS[0], DOCS, snapkv=MODEL, ignore_eos=True).raw_text == direct
    assert sum(seen) > 0  # some heads did hold fewer slots than the layer's widest


def test_batch_equals_single_and_a_saved_set_answers_the_same(llm, tiny_model, tokenizer, tmp_path):
    questions, docs = (
        [QUESTIONS[0], "Name the orchard.", "What lies north?"],
        [DOCS, filler_documents(3), filler_documents(5)],
    )
    batch = llm.generate_batch(questions, docs, snapkv=MODEL, max_new_tokens=8, ignore_eos=True)
    single = [llm.generate(q, d, snapkv=MODEL, max_new_tokens=8, ignore_eos=True) for q, d in zip(questions, docs)]
    assert [r.raw_text for r in batch] == [r.raw_text for r in single]
    handle = llm.index_documents(DOCS, method=MODEL)
    answers = [handle.generate(q).raw_text for q in QUESTIONS]
    handle.save(tmp_path / "docs.safetensors")
    fresh = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=10)
    loaded = fresh.load_documents(tmp_path / "docs.safetensors")
    assert loaded.method == MODEL and [loaded.generate(q).raw_text for q in QUESTIONS] == answers


@pytest.mark.parametrize("share", ["head", "layer", "model"])
def test_the_stored_bytes_are_the_kept_share(llm, share):
    """Ragged heads are stored packed (no padding): the bytes are those of the positions kept, the
    kept share's at most (the model-wide ranking keeps fewer in the same padded layers)."""
    handle = llm.index_documents(DOCS, method=KVzipConfig(ratio=0.5, window_size=8, share=share))
    assert (0.3 if share == "model" else 0.48) <= handle.kept_bytes / handle.full_bytes <= 0.52
    assert handle.entry().nbytes < 0.56 * handle.full_bytes  # positions and counts beside them
    if share == "model":  # padded, as a prefill over it sees it, the set is larger
        padded = sum(kv.keys.nbytes + kv.values.nbytes for kv in handle.entry().layers if kv is not None)
        assert padded > 1.05 * handle.kept_bytes


def test_fitting_the_slots_stores_fewer_positions(llm):
    slots = llm.index_documents(DOCS, method=KVzipConfig(ratio=0.5, window_size=8, fit="slots"))
    padded = sum(kv.keys.nbytes + kv.values.nbytes for kv in slots.entry().layers if kv is not None)
    assert 0.48 <= padded / slots.full_bytes <= 0.52  # the padded layers fit the kept share's bytes
    assert slots.kept_bytes < 0.48 * slots.full_bytes  # ... by keeping fewer positions


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="share: must be 'head', 'layer' or 'model'"):
        KVzipConfig(share="global")
    with pytest.raises(ValueError, match="sink_tokens"):
        KVzipConfig(sink_tokens=-1)
    with pytest.raises(ValueError, match="fit: must be 'positions' or 'slots'"):
        KVzipConfig(fit="bytes")


def test_a_model_with_sliding_layers_ranks_its_full_layers_only(tokenizer):
    from families import tiny_model as family_model

    llm = SnapKVLLM(model=family_model("gemma3", len(tokenizer)), tokenizer=tokenizer, max_new_tokens=6)
    config = KVzipConfig(max_capacity_prompt=48, window_size=8, share="model")
    result = llm.generate(QUESTIONS[0], DOCS, snapkv=config, ignore_eos=True)
    assert result.usage.completion_tokens == 6
    specs = llm.runner.specs
    assert any(s.window is not None for s in specs) and any(s.window is None for s in specs)


def test_latent_attention_ranks_one_shared_selection(tokenizer):
    from families import tiny_model as family_model

    llm = SnapKVLLM(model=family_model("deepseek-v3", len(tokenizer)), tokenizer=tokenizer, max_new_tokens=6)
    layers = llm.runner.prefill([list(llm.request(QUESTIONS[0], DOCS).input_ids)], {"": MODEL}).compressed[""][0].layers
    for kv in layers:  # one selection, the same in every head
        assert (kv.positions == kv.positions[:, :1]).all()
    assert llm.generate(QUESTIONS[0], DOCS, snapkv=MODEL, ignore_eos=True).usage.completion_tokens == 6
