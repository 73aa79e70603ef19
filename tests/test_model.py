"""The embedded SmolLM2-135M-Instruct: real answers, real cache sizes."""

from __future__ import annotations

import re

import pytest
import torch
from snapkv_testing import capture_caches, filler_documents

from snapkv_rag import SnapKVConfig
from snapkv_rag.cli import demo_documents, demo_records

pytestmark = pytest.mark.model

QUESTION = "Which number lies north of the castle?"


def prompt_ids(engine, question, docs):
    return engine.request(question, docs).input_ids


def test_budget_larger_than_prompt_equals_plain_generate(engine):
    docs = filler_documents(4)
    ids = prompt_ids(engine, QUESTION, docs)
    assert len(ids) < 1024
    ours = engine.generate(QUESTION, docs, snapkv=SnapKVConfig(max_capacity_prompt=1024), max_new_tokens=24)
    with torch.inference_mode():
        plain = engine.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    generated = plain[0, len(ids) :].tolist()
    if generated and generated[-1] in engine.runner.eos_ids:
        generated = generated[:-1]
    assert ours.compression.kept_tokens == [len(ids)] * 30
    assert engine.tokenizer.encode(
        ours.text, add_special_tokens=False
    ) == generated or ours.text == engine.tokenizer.decode(generated, skip_special_tokens=True)
    assert ours.usage.completion_tokens == len(generated)


def test_budget_256_on_a_2k_prompt_leaves_256_plus_generated(engine):
    docs = filler_documents(22)
    seen, handle = capture_caches(engine.model)
    try:
        result = engine.generate(QUESTION, docs, snapkv=SnapKVConfig(max_capacity_prompt=256), max_new_tokens=6)
    finally:
        handle.remove()
    assert 1800 <= result.usage.prompt_tokens <= 2600
    assert result.compression.kept_tokens == [256] * 30
    fed = len(seen) - 1  # decode steps after the prefill
    assert seen[1:] == [[256 + t] * 30 for t in range(fed)]
    assert result.compression.ratio == pytest.approx(256 / result.usage.prompt_tokens)


def test_stream_equals_generate(engine):
    docs = filler_documents(6)
    config = SnapKVConfig(max_capacity_prompt=128)
    text = engine.generate(QUESTION, docs, snapkv=config).text
    pieces = list(engine.stream(QUESTION, docs, snapkv=config))
    assert len(pieces) > 3 and "".join(pieces) == text


def test_batch_of_three_unequal_prompts_equals_single_calls(engine):
    questions = ["Which river is mentioned first?", QUESTION, "Name a market."]
    docs = [filler_documents(3), filler_documents(9), filler_documents(5)]
    # Padded rows prefill through masked attention kernels, whose float rounding differs slightly
    # from an unpadded prompt's; greedy answers agree until a near-tie, so compare 12 tokens.
    config = SnapKVConfig(max_capacity_prompt=200)
    batch = engine.generate_batch(questions, docs, snapkv=config, max_new_tokens=12)
    single = [engine.generate(q, d, snapkv=config, max_new_tokens=12) for q, d in zip(questions, docs)]
    assert len({r.usage.prompt_tokens for r in batch}) == 3
    assert [r.text for r in batch] == [r.text for r in single]


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9 ]", " ", text.lower())).strip()


def test_nq_question_with_gold_among_distractors_is_answered(engine):
    record = next(r for r in demo_records() if "lexington" in r["question"])
    docs, _ = demo_documents(record, 10)  # the demo's passages: gold [6] among 9 BM25 distractors, 1,146 tokens
    result = engine.generate(record["question"], docs, max_new_tokens=32)  # default SnapKV@1024
    assert result.compression.prompt_tokens > 1024 and result.compression.kept_tokens == [1024] * 30
    assert any(normalise(answer) in normalise(result.text) for answer in record["answers"]), result.text
