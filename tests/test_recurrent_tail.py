"""A question's tail over a stored document set on models with recurrent layers: in one pass (the
transformers versions that continue a stored conv / SSM state through a multi-token pass, from
``tails.ONE_PASS_FROM``) and one token per step (before them) both give the whole prompt's next-token
logits, and the answers of either path are the same. Run by the standing GPU check on the GPU
image's transformers too (no server or framework package needed here)."""

from __future__ import annotations

import pytest
import torch
from families import tiny_model as family_model
from snapkv_testing import filler_documents

from snapkv_rag import KeyNormConfig, SnapKVLLM
from snapkv_rag.kv import tails
from snapkv_rag.kv.prompt_cache import PromptCache

FAMILIES = ["lfm2", "qwen3-next", "falcon-h1", "zamba2", "nemotron-h"]
QUESTIONS = ["What lies north?", "Which castle is number 40?"]


def _tail_logits(llm, entry, ids, one_pass: bool) -> torch.Tensor:
    runner = llm.runner
    prefix = entry.prefix()
    cache = tails.with_states(PromptCache(llm.model.config, runner.specs, prefix), entry.states)
    with torch.inference_mode():
        if not one_pass:
            return tails.stepwise_tail(runner.forward, cache, prefix, ids, runner.device)[1]
        cache.compress = tails.tail_hook(cache, prefix.layers, entry.length, len(ids))
        return runner.forward(
            torch.tensor([ids[entry.length :]], device=runner.device),
            None,
            torch.arange(entry.length, len(ids), device=runner.device)[None],
            cache,
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tail_over_stored_states_gives_the_whole_prompts_logits(family, tokenizer):
    llm = SnapKVLLM(model=family_model(family, len(tokenizer)), tokenizer=tokenizer)
    docs = filler_documents(6)
    entry = llm.index_documents(docs, method=KeyNormConfig(ratio=1.0)).entry()
    assert entry.states and any(state is not None for state in entry.states)
    ids = llm.request(QUESTIONS[0], docs, "text").input_ids
    with torch.inference_mode():
        whole = llm.runner.prefill([ids], {"": None}).logits
    stepwise = _tail_logits(llm, entry, ids, one_pass=False)
    torch.testing.assert_close(stepwise, whole, rtol=0, atol=2e-5)
    if tails.ONE_PASS:
        torch.testing.assert_close(_tail_logits(llm, entry, ids, one_pass=True), whole, rtol=0, atol=2e-5)


@pytest.mark.parametrize("family", ["lfm2", "zamba2"])
def test_both_tail_paths_answer_the_same(family, tokenizer):
    llm = SnapKVLLM(model=family_model(family, len(tokenizer)), tokenizer=tokenizer, max_new_tokens=8)
    handle = llm.index_documents(filler_documents(4), method=KeyNormConfig(ratio=0.5, window_size=8))
    answers = {}
    for one_pass in [True, False] if tails.ONE_PASS else [False]:
        llm.runner.one_pass_tail = one_pass
        answers[one_pass] = [handle.generate(q, ignore_eos=True).raw_text for q in QUESTIONS]
    assert len(set(map(tuple, answers.values()))) == 1 and all(len(a) for a in answers[False])
