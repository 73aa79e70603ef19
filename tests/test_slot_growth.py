"""The slot cache when its buffers grow: a growth that runs out of memory part way leaves the cache
usable (the rows in use untouched; with none in use, the memory given back), and a lone request's
prefilled cache is let go layer by layer as it is written into its row."""

from __future__ import annotations

import pytest
import torch
from snapkv_testing import filler_documents

from snapkv_rag import GenerationOutOfMemoryError, SnapKVLLM
from snapkv_rag.kv.prompt_cache import LayerKV
from snapkv_rag.kv.slot_cache import SlotCache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def out_of_memory_on_growth(monkeypatch):
    """Makes the ``n``-th buffer a growing slot cache allocates raise CUDA's out-of-memory error."""
    grow, new_zeros = SlotCache._grow, torch.Tensor.new_zeros
    state = {"armed": False, "calls": 0, "fail_at": None}

    def failing_new_zeros(self, *args, **kwargs):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == state["fail_at"]:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated while the slot cache grows)")
        return new_zeros(self, *args, **kwargs)

    def armed_grow(self, *args, **kwargs):
        state["armed"] = True
        try:
            return grow(self, *args, **kwargs)
        finally:
            state["armed"] = False

    monkeypatch.setattr(torch.Tensor, "new_zeros", failing_new_zeros)
    monkeypatch.setattr(SlotCache, "_grow", armed_grow)

    def arm(n: int) -> None:
        state["calls"], state["fail_at"] = 0, n

    return arm


def test_out_of_memory_while_growing_with_no_row_in_use_gives_the_memory_back(
    tiny_model, tokenizer, out_of_memory_on_growth
):
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=False, max_new_tokens=8)
    docs = filler_documents(4)
    before = llm.generate("Which harbour lies north?", docs, ignore_eos=True)
    out_of_memory_on_growth(3)  # the second layer's keys: the first layer has grown already
    with pytest.raises((torch.OutOfMemoryError, GenerationOutOfMemoryError)):
        llm.generate("Which harbour lies north?", docs, ignore_eos=True)
    slots = llm.scheduler.slots
    assert slots.rows == slots.capacity == 0 and not slots.held
    assert all(layer.keys is None for layer in slots.attention)  # nothing half-grown left holding memory
    out_of_memory_on_growth(None)
    after = llm.generate("Which harbour lies north?", docs, ignore_eos=True)
    assert after.raw_text == before.raw_text
    llm.close()


def _prefilled(llm, docs: int):
    ids = llm.request("Which harbour lies north?", filler_documents(docs)).input_ids
    return llm.runner.prefill([ids], {"": None}).compressed[""][0]


def test_out_of_memory_while_growing_leaves_the_rows_in_use_as_they_were(
    tiny_model, tokenizer, out_of_memory_on_growth
):
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=False)
    slots = llm.runner.new_slots(4)
    slots.join(0, _prefilled(llm, 1), room=4, token=1)
    rows, capacity, held = slots.rows, slots.capacity, dict(slots.held)
    keys = [layer.keys[0].clone() for layer in slots.attention]
    positions = slots.positions.clone()
    longer = _prefilled(llm, 8)  # more slots and one more row: every buffer must grow
    assert max(kv.slots for kv in longer.layers if isinstance(kv, LayerKV)) + 4 > capacity
    out_of_memory_on_growth(4)  # the second layer's values
    with pytest.raises(torch.OutOfMemoryError):
        slots.join(1, longer, room=4, token=1)
    assert (slots.rows, slots.capacity, slots.held) == (rows, capacity, held)
    assert all(layer.keys.shape[0] == rows and layer.keys.shape[2] == capacity for layer in slots.attention)
    assert all(torch.equal(layer.keys[0], k) for layer, k in zip(slots.attention, keys))
    assert torch.equal(slots.positions, positions)
    out_of_memory_on_growth(None)
    slots.join(1, longer, room=4, token=1)  # and it grows once memory allows
    assert slots.rows == 2 and slots.capacity > capacity
    assert all(torch.equal(layer.keys[0, :, :capacity], k) for layer, k in zip(slots.attention, keys))
    llm.close()


def test_a_lone_request_lets_its_prefilled_cache_go_as_it_joins(tiny_model, tokenizer):
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=False)
    kept, consumed = _prefilled(llm, 3), _prefilled(llm, 3)
    first, second = llm.runner.new_slots(2), llm.runner.new_slots(2)
    first.join(0, kept, room=4, token=1)
    second.join(0, consumed, room=4, token=1, consume=True)
    assert all(isinstance(layer, LayerKV) for layer in kept.layers)  # not consumed: the caller's to keep
    assert all(layer is None for layer in consumed.layers)  # every attention layer let go once written
    for a, b in zip(first.attention, second.attention):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(first.positions, second.positions) and torch.equal(first.counters, second.counters)
    llm.close()


def test_a_lone_eager_request_gets_the_capacity_it_needs(tiny_model, tokenizer):
    """No row in use: the buffers are what the request needs, rounded up to 256 slots, not to the
    next bucket (up to 1.5x); rows joining a running batch grow it by buckets."""
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=False)
    slots = llm.runner.new_slots(4)
    lone = _prefilled(llm, 12)
    need = max(kv.slots for kv in lone.layers if isinstance(kv, LayerKV)) + 8
    slots.join(0, lone, room=8, token=1)
    assert need <= slots.capacity < need + 256 and slots.capacity % 256 == 0
    longer = _prefilled(llm, 16)
    slots.join(1, longer, room=8, token=1)  # a row in use: the next bucket, as before
    from snapkv_rag.kv.slot_cache import capacity_bucket

    assert slots.capacity == capacity_bucket(max(kv.slots for kv in longer.layers if isinstance(kv, LayerKV)) + 8)
    llm.close()


def test_a_compiled_engine_holds_rows_for_the_requests_it_runs_not_for_max_batch(tiny_model, tokenizer):
    """The kept allocation of a compiled step (its CUDA graphs belong to it) grows its rows by batch
    buckets as requests join, and keeps them when they leave: one long request on an engine made for
    16 holds one row, not 16 (on a 7B model at 16K tokens: 12 GiB of slots, not 192)."""
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, snapkv=False)
    slots = SlotCache(tiny_model.config, llm.runner.specs, 16, llm.runner.device, keep=True)
    slots.join(0, _prefilled(llm, 6), room=8, token=1)
    assert slots.rows == 1
    slots.join(2, _prefilled(llm, 3), room=8, token=1)
    assert slots.rows == 4 and slots.attention[0].keys.shape[0] == 4
    slots.leave(0)
    slots.leave(2)
    assert slots.rows == 4 and slots.attention[0].keys is not None  # kept for the next requests and graphs
    llm.close()
