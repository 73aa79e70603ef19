"""A budget is a memory bound, for every method: no attention layer of a request's cache holds more
slots than the method's budget for it (ragged heads padded to the widest included), whatever the
per-head or per-layer split, and the reported ``kv_bytes_kept`` / ``ratio`` are what the request's
row of the slot cache physically holds while it decodes. Every registered method (a method added to
the registry is checked too) and the ragged variants, on one family of each layer kind: attention,
sliding, multi-head latent, hybrid (attention + state) and recurrent + attention."""

from __future__ import annotations

import dataclasses

import pytest
from families import tiny_model
from snapkv_testing import filler_documents

from snapkv_rag import AdaSnapKVConfig, KVzipConfig, LookaheadSnapKVConfig, SnapKVLLM
from snapkv_rag.kv import slot_cache
from snapkv_rag.kv.prompt_cache import LayerKV
from snapkv_rag.methods import METHODS

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGET = 64
QUESTION = "Which harbour lies north?"
KINDS = {
    "llama": "attention",
    "gemma3": "sliding and full",
    "deepseek-v3": "latent",
    "falcon-h1": "hybrid",
    "qwen3-next": "recurrent and attention",
}


def bounded(cls, **settings):
    """``cls`` at the test budget, its windows small enough for the budget to bite."""
    names = {f.name for f in dataclasses.fields(cls)}
    small = {name: 8 for name in ("window_size", "recent_size") if name in names}
    return cls(max_capacity_prompt=BUDGET, **small, **settings)


def methods() -> dict:
    out = {name: bounded(cls) for name, cls in METHODS.items()}
    out["adasnapkv-floor0"] = bounded(AdaSnapKVConfig, floor=0.0)
    out["lookahead-ragged"] = bounded(LookaheadSnapKVConfig, floor=0.0)
    for share in ("head", "layer", "model"):
        out[f"kvzip-{share}"] = bounded(KVzipConfig, share=share, sink_tokens=2)
    out["kvzip-slots"] = bounded(KVzipConfig, fit="slots")
    return out


def unbound(method):
    """A method config without the prompt's document spans the engine binds to it."""
    return dataclasses.replace(method, spans=None) if hasattr(method, "spans") else method


def row_bytes(compressed) -> tuple[int, int]:
    """Bytes per slot over the attention layers, and the slots a row of the slot cache gives them."""
    layers = [kv for kv in compressed.layers if isinstance(kv, LayerKV)]
    per_slot = sum(kv.keys[0, :, :1].nbytes + kv.values[0, :, :1].nbytes for kv in layers)
    return per_slot, max(kv.slots for kv in layers)


@pytest.mark.parametrize("family", list(KINDS), ids=lambda name: f"{name}-{KINDS[name]}")
def test_no_layer_holds_more_than_the_budget_and_the_ratio_is_the_physical_one(family, tokenizer, monkeypatch):
    llm = SnapKVLLM(model=tiny_model(family, len(tokenizer)), tokenizer=tokenizer, max_new_tokens=2)
    configs = methods()
    docs = filler_documents(6)
    prompt = llm.prompt_tokens(QUESTION, docs)
    assert prompt > 4 * BUDGET
    held = {}  # method config (spans left out) -> bytes of the row it was written into
    join = slot_cache.SlotCache.join

    def spy(self, row, compressed, *args, **kwargs):
        per_slot, slots = row_bytes(compressed)
        held[unbound(compressed.method)] = per_slot * slots
        return join(self, row, compressed, *args, **kwargs)

    monkeypatch.setattr(slot_cache.SlotCache, "join", spy)
    both = llm.compare(QUESTION, docs, methods={"full": None, **configs}, max_new_tokens=2)
    attends = [i for i, spec in enumerate(llm.runner.specs) if spec.attends]
    full = both.results["full"].compression
    for name in configs:
        stats = both.results[name].compression
        kept = [stats.kept_tokens[i] for i in attends]
        assert max(kept) <= BUDGET, (name, kept)  # a layer's slots, padding included
        assert stats.kv_bytes_kept <= full.kv_bytes_full * BUDGET / prompt + 1e-9, name
        assert stats.ratio == pytest.approx(stats.kv_bytes_kept / stats.kv_bytes_full), name
    assert full.ratio == 1.0
    # the reported bytes are those the slot cache's row holds (every layer as wide as the widest)
    for name, config in {"full": None, **configs}.items():
        assert both.results[name].compression.kv_bytes_kept == held[unbound(config)], name
