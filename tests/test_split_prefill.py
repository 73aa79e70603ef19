"""A prompt prefilled in pieces answers as one whole-prompt prefill does, on every supported family.

The engine splits a prompt wherever it reuses work: the prefix cache (documents cached, the question
run on top), a question over a stored document set, MLP slices of a long prompt. A model with
recurrent layers must then carry its conv / SSM state across the split; transformers does that for
most families, not for Jamba (its multi-token scan over a cache starts from zeros). The recurrent
families here decay slowly (``families.SLOW_DECAY``), as trained models do, so a lost state shows.

Checked here: the table of families that cannot continue a state (``layer_kinds.STATE_RESTARTS``)
against a token-by-token continuation on the installed transformers; and, for every family, the
default engine (prefix cache on), stored-document questions and sliced prefill against transformers'
own ``generate`` and a whole-prompt prefill."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, HYBRIDS, tiny_model
from snapkv_testing import cache_kwarg, filler_documents
from transformers import DynamicCache

from snapkv_rag import KeyNormConfig, SnapKVConfig, SnapKVLLM
from snapkv_rag.models.layer_kinds import layer_specs, state_break

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 16
QUESTIONS = ["What lies north?", "Which castle is number 40?"]
SNAPKV = SnapKVConfig(max_capacity_prompt=96, window_size=8)
ALL = sorted(FAMILIES) + sorted(HYBRIDS)
_models: dict = {}


def model_of(name: str, vocab: int):
    if name not in _models:
        _models[name] = tiny_model(name, vocab)
    return _models[name]


def stateful(name: str, vocab: int) -> bool:
    model = model_of(name, vocab)
    return any(spec.state for spec in layer_specs(model.config, model))


def _last_logits(model, ids: list[int], cache=None, start: int = 0) -> torch.Tensor:
    kwargs = {cache_kwarg(model): cache, "use_cache": cache is not None}
    positions = torch.arange(start, start + len(ids))[None]
    return model(input_ids=torch.tensor([ids]), position_ids=positions, **kwargs).logits[0, -1]


def continuation_gaps(model, ids: list[int], split: int) -> tuple[float, float]:
    """How far the last logits move from a whole pass when ``ids[split:]`` runs on from the cache of
    ``ids[:split]``: in one multi-token pass, and one token per pass."""
    with torch.inference_mode():
        whole = _last_logits(model, ids)
        gaps = []
        for step in (len(ids) - split, 1):
            cache = DynamicCache(config=model.config)
            _last_logits(model, ids[:split], cache)
            for at in range(split, len(ids), step):
                logits = _last_logits(model, ids[at : at + step], cache, at)
            gaps.append(float((logits - whole).abs().max()))
    return gaps[0], gaps[1]


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("llama",)])
def test_the_table_of_families_that_restart_their_state_matches_transformers(name, tokenizer):
    """A family is listed as unable to continue a state in one pass exactly when, on the installed
    transformers, its multi-token continuation leaves the whole pass while a token-by-token one does
    not. Attention-only families have no state to lose (``state_break`` is ``None``)."""
    model = model_of(name, len(tokenizer))
    specs = layer_specs(model.config, model)
    if not any(spec.state for spec in specs):
        assert state_break(model.config, specs) is None
        return
    ids = tokenizer(" ".join(d["text"] for d in filler_documents(2)))["input_ids"][:96]
    one_pass, stepwise = continuation_gaps(model, ids, split=64)
    assert stepwise < 1e-4, (name, stepwise)
    assert (state_break(model.config, specs) is None) == (one_pass < 1e-4), (name, one_pass)


def reference(model, ids: list[int]) -> list[int]:
    """transformers' own greedy tokens after ``ids`` (``NEW`` of them, end-of-sequence ignored)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=2)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", ALL)
def test_the_prefix_cache_never_changes_an_answer(name, tokenizer):
    """The default engine (prefix cache on), first question and a later one over the same documents:
    the full cache gives transformers' own greedy answer, and SnapKV the answer and kept tokens of an
    engine that never splits a prompt (prefix cache off). Sliding-window layers cross the split
    (their window is shorter than the prompt), latent attention caches its latents, recurrent layers
    carry their states (or are not split: Jamba)."""
    model = model_of(name, len(tokenizer))
    cached = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=NEW)
    whole = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=NEW, prefix_cache_bytes=0)
    docs = filler_documents(6)
    for question in QUESTIONS:
        ids = whole.request(question, docs).input_ids
        full = cached.generate(question, docs, snapkv=False, ignore_eos=True)
        assert full.raw_text == tokenizer.decode(reference(model, ids), skip_special_tokens=True), (name, question)
        got = cached.generate(question, docs, snapkv=SNAPKV, ignore_eos=True)
        want = whole.generate(question, docs, snapkv=SNAPKV, ignore_eos=True)
        assert (got.raw_text, got.compression.kept_tokens) == (want.raw_text, want.compression.kept_tokens), name
    splits = cached.runner.state_break is None and cached.prefix_cache.enabled
    assert (cached.prefix_stats().hits > 0) == splits, name


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in ALL
        if n in HYBRIDS or n in ("qwen3-next", "nemotron-h", "falcon-h1", "zamba", "zamba2", "lfm2", "lfm2-moe")
    ],
)
def test_a_question_over_stored_documents_equals_the_whole_prompt(name, tokenizer):
    """A document set stored whole (``KeyNormConfig(ratio=1.0)`` keeps every position), then a
    question over it: the tail runs on from the stored states (one pass, or one token per step where
    the family cannot continue in one pass) and gives the whole prompt's next-token logits and
    transformers' greedy answer."""
    model = model_of(name, len(tokenizer))
    llm = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=NEW, prefix_cache_bytes=0)
    docs = filler_documents(6)
    handle = llm.index_documents(docs, method=KeyNormConfig(ratio=1.0))
    assert handle.entry().states, name
    for question in QUESTIONS:
        ids = llm.request(question, docs).input_ids
        with torch.inference_mode():
            whole = llm.runner.prefill([ids], {"": None}).logits
            tail = llm.runner.prefill_stored(handle.entry(), ids).logits
        torch.testing.assert_close(tail, whole, rtol=0, atol=1e-4)
        answer = handle.generate(question, ignore_eos=True)
        assert answer.raw_text == tokenizer.decode(reference(model, ids), skip_special_tokens=True), (name, question)


@pytest.mark.parametrize("name", ["jamba", "zamba2", "lfm2-moe", "mixtral", "gemma3", "deepseek-v3"])
def test_a_prompt_prefilled_in_slices_equals_one_pass(name, tokenizer):
    """``prefill_chunk`` runs each layer's MLP (MoE included) over the prompt in slices: the same
    logits and answers as one pass, full cache and SnapKV."""
    model = model_of(name, len(tokenizer))
    docs = filler_documents(6)
    sliced = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=NEW, prefill_chunk=32)
    one = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=NEW, prefill_chunk=None)
    ids = one.request(QUESTIONS[1], docs).input_ids
    with torch.inference_mode():
        torch.testing.assert_close(
            sliced.runner.prefill([ids], {"": None}).logits,
            one.runner.prefill([ids], {"": None}).logits,
            rtol=0,
            atol=1e-4,
        )
    for config in (False, SNAPKV):
        a = sliced.generate(QUESTIONS[1], docs, snapkv=config, ignore_eos=True)
        b = one.generate(QUESTIONS[1], docs, snapkv=config, ignore_eos=True)
        assert a.raw_text == b.raw_text, (name, config)
