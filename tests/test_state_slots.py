"""Per-row recurrent / conv state slots: rows of hybrid models decode together, each row's state its own.

Requests of unequal prompt lengths and answer lengths join and leave a running batch of a hybrid model
(Mamba-2: Bamba, Granite 4; Mamba: Jamba; gated delta net linear attention: Qwen3-Next, Kimi-Linear;
short convolutions: LFM2; attention + Mamba in one layer: Falcon-H1, Zamba2); every request's tokens
are those it gets alone, and each row's conv / SSM states after mixed steps are those it has alone.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from families import tiny_model
from snapkv_testing import filler_documents

from snapkv_rag import SnapKVConfig, SnapKVLLM

HYBRID = ["bamba", "granitemoehybrid", "jamba", "kimi-linear", "qwen3-next", "lfm2", "falcon-h1", "zamba2"]
BUDGET = SnapKVConfig(max_capacity_prompt=48, window_size=8)
QUESTIONS = ["Which harbour lies north?", "Name the orchard.", "What lies north?", "Which castle?", "Who rules?"]
DOCS = [6, 1, 4, 2, 3]  # documents per request: five prompt lengths
NEW = [14, 6, 9, 7, 11]  # and five answer lengths: rows leave at different steps, others join
_models: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=HYBRID)
def llm(request, tokenizer):
    if request.param not in _models:
        _models[request.param] = tiny_model(request.param, len(tokenizer))
    engine = SnapKVLLM(model=_models[request.param], tokenizer=tokenizer, max_new_tokens=16)
    yield engine
    engine.close()


def _alone(llm, new=NEW) -> list:
    return [
        llm.generate(q, filler_documents(d), snapkv=BUDGET, max_new_tokens=n, ignore_eos=True)
        for q, d, n in zip(QUESTIONS, DOCS, new)
    ]


def test_rows_joining_and_leaving_keep_each_rows_state(llm):
    alone = _alone(llm)
    assert all(r.timings.batch_size == 1 for r in alone)

    async def all_at_once():  # submitted together (one event loop tick), decoded as they join
        return await asyncio.gather(
            *(
                llm.agenerate(q, filler_documents(d), snapkv=BUDGET, max_new_tokens=n, ignore_eos=True)
                for q, d, n in zip(QUESTIONS, DOCS, NEW)
            )
        )

    together = asyncio.run(all_at_once())
    assert [r.usage.completion_tokens for r in together] == NEW
    assert [r.raw_text for r in together] == [r.raw_text for r in alone]
    assert max(r.timings.batch_size for r in together) == 5  # they did decode as rows of one batch


def test_generate_batch_equals_single_calls(llm):
    alone = _alone(llm, [12] * len(QUESTIONS))
    # batch_size 3: the 4th and 5th requests join rows the first ones leave, mid-run
    batch = llm.generate_batch(
        QUESTIONS, [filler_documents(d) for d in DOCS], snapkv=BUDGET, batch_size=3, max_new_tokens=12, ignore_eos=True
    )
    assert [r.raw_text for r in batch] == [r.raw_text for r in alone]
    assert max(r.timings.batch_size for r in batch) == 3


def _states_after(llm, prompts: list[list[int]], steps: int) -> list[dict]:
    """Per prompt, every state layer's conv / SSM states after its prompt and ``steps`` greedy decode
    steps, the prompts joined as rows 0, 1, ... of one slot cache (three rows: a bucket of four, one idle)."""
    runner = llm.runner
    slots = runner.new_slots(4)
    for row, ids in enumerate(prompts):
        pre = runner.prefill([ids], {"": BUDGET})
        slots.join(row, pre.compressed[""][0], room=steps + 1, token=int(pre.logits[0].argmax()))
    for _ in range(steps):
        runner.decode_step(slots, slots.batch_rows())
    return [
        {
            (i, name, n): t[row].clone()
            for i, fields in slots.states.buffers.items()
            for name, per_index in fields.items()
            for n, t in per_index.items()
            if t is not None
        }
        for row in range(len(prompts))
    ]


def test_each_rows_conv_and_ssm_states_are_those_it_has_alone(llm):
    prompts = [[1, *range(10, 10 + n)] for n in (70, 23, 41)]
    together = _states_after(llm, prompts, steps=6)
    assert together[0]  # the model has state layers, and they are per row
    for row, ids in enumerate(prompts):
        alone = _states_after(llm, [ids], steps=6)[0]
        assert alone.keys() == together[row].keys()
        for key, state in alone.items():
            torch.testing.assert_close(together[row][key], state, rtol=1e-4, atol=1e-5, msg=f"row {row} {key}")


def test_compile_on_a_state_model_decodes_eagerly_with_one_log_line(tokenizer, caplog):
    model = _models.get("lfm2") or tiny_model("lfm2", len(tokenizer))
    eager = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=6)
    expected = [eager.generate(q, filler_documents(2), snapkv=BUDGET).raw_text for q in QUESTIONS[:2]]
    eager.close()
    compiled = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=6, compile=True)
    with caplog.at_level("INFO", logger="snapkv_rag"):
        got = [compiled.generate(q, filler_documents(2), snapkv=BUDGET).raw_text for q in QUESTIONS[:2]]
    compiled.close()
    assert got == expected
    assert sum("run eagerly" in r.getMessage() for r in caplog.records) == 1


def test_compare_together_decodes_hybrid_rows_as_one_batch(llm):
    methods = {"full": None, "snapkv": BUDGET}
    docs = filler_documents(3)
    both = llm.compare(QUESTIONS[0], docs, methods=methods, together=True, max_new_tokens=8, ignore_eos=True)
    for name, config in methods.items():
        alone = llm.generate(QUESTIONS[0], docs, snapkv=config, max_new_tokens=8, ignore_eos=True)
        assert both.results[name].raw_text == alone.raw_text, name
        assert both.results[name].timings.batch_size == 2, name


def test_a_kv_memory_limit_counts_each_rows_conv_and_ssm_states(tokenizer):
    model = _models.get("bamba") or tiny_model("bamba", len(tokenizer))
    probe = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=8)
    alone = _alone(probe, [8] * len(QUESTIONS))
    probe.close()
    kv_row = max(r.compression.kv_bytes_kept / max(r.compression.kept_tokens) * (48 + 8) for r in alone)
    # room for the K/V of several rows, but the Mamba states of one row (tens of KB) exceed what is left
    llm = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=8, max_kv_bytes=int(4 * kv_row))
    try:
        batch = llm.generate_batch(
            QUESTIONS, [filler_documents(d) for d in DOCS], snapkv=BUDGET, max_new_tokens=8, ignore_eos=True
        )
    finally:
        llm.close()
    assert [r.raw_text for r in batch] == [r.raw_text for r in alone]
    assert [r.timings.batch_size for r in batch] == [1] * len(QUESTIONS)
