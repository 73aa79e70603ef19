"""The family matrix: every supported transformers family at toy size, through the whole engine.

For each family: the full cache reproduces ``model.generate``; a budget above the prompt is the full
cache; a budget below it keeps, layer by layer, the K/V transformers itself would cache at exactly
the positions an independent SnapKV (written here from queries and keys captured by this test's own
attention function, with the layer's own scale, soft-cap and sinks) selects; ``kept_tokens`` is what
the cache physically holds; a padded batch equals single calls; ``compare`` equals ``generate``.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import transformers
from families import COMMON, FAMILIES, tiny_model
from independent_snapkv import assert_kept_kv_are_an_independent_selection
from snapkv_testing import capture_caches, filler_documents, tiny_llama

from snapkv_rag import (
    AdaSnapKVConfig,
    DocSnapKVConfig,
    H2OConfig,
    KeyNormConfig,
    KVzipConfig,
    LookaheadSnapKVConfig,
    PyramidKVConfig,
    RandomConfig,
    SnapKVConfig,
    SnapKVLLM,
    StreamingLLMConfig,
)
from snapkv_rag.runtime import draft as lookahead

BUDGET = SnapKVConfig(max_capacity_prompt=64, window_size=8)
NEW = 20
QUESTION = "Which harbour lies north?"
NAMES = list(FAMILIES)
_models: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def model_of(name: str, vocab: int, dtype=torch.float32):
    key = (name, dtype)
    if key not in _models:
        _models[key] = tiny_model(name, vocab, dtype)
    return _models[key]


@pytest.fixture(params=NAMES)
def family(request, tokenizer):
    return request.param, SnapKVLLM(
        model=model_of(request.param, len(tokenizer)), tokenizer=tokenizer, max_new_tokens=NEW
    )


def reference_text(llm, tokenizer, ids, dtype=torch.float32) -> tuple[str, list[str]]:
    """transformers' own greedy answer, and in bf16 the starts of the answers that turn away from it
    at a near tie: at a step whose two best logits lie within one bf16 step of each other, the
    runner-up. The engine attends over its fixed slot buffer, whose sums may round one bf16 step
    differently from transformers' exact-length cache, so at such a step either token is greedy."""
    out = llm.model.generate(
        torch.tensor([ids]),
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=2,
        eos_token_id=2,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    end = tokens.index(2) if 2 in tokens else len(tokens)
    turns = []
    for step, scores in enumerate(out.scores[:end] if dtype != torch.float32 else []):
        (best, second), picks = scores[0].float().topk(2)
        if best - second <= torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(best.item()))):
            other = picks[1] if picks[0] == tokens[step] else picks[0]
            turns.append(tokenizer.decode(tokens[:step] + [int(other)], skip_special_tokens=True))
    return tokenizer.decode(tokens[:end], skip_special_tokens=True), turns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_full_cache_equals_model_generate(name, dtype, tokenizer):
    llm = SnapKVLLM(model=model_of(name, len(tokenizer), dtype), tokenizer=tokenizer, max_new_tokens=NEW)
    docs = filler_documents(4)
    result = llm.generate(QUESTION, docs, snapkv=False)
    assert result.usage.completion_tokens > 0
    expected, turns = reference_text(llm, tokenizer, llm.request(QUESTION, docs).input_ids, dtype)
    assert result.text == expected or any(result.text.startswith(turn) for turn in turns), (result.text, expected)


def test_budget_above_the_prompt_is_the_full_cache(family):
    _, llm = family
    docs = filler_documents(4)
    full = llm.generate(QUESTION, docs, snapkv=False)
    for config in (SnapKVConfig(max_capacity_prompt=4096), LookaheadSnapKVConfig(max_capacity_prompt=4096)):
        big = llm.generate(QUESTION, docs, snapkv=config)  # lookahead: the draft's positions and states dropped
        assert big.text == full.text and big.compression.kept_tokens == full.compression.kept_tokens
        assert big.compression.ratio == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_kept_kv_are_the_full_kv_at_an_independent_snapkv_selection(name, tokenizer):
    llm = SnapKVLLM(model=model_of(name, len(tokenizer)), tokenizer=tokenizer)
    assert_kept_kv_are_an_independent_selection(llm, llm.request(QUESTION, filler_documents(5)).input_ids, BUDGET)


@pytest.mark.parametrize("name", NAMES)
def test_reported_kept_tokens_are_what_the_cache_holds(name, tokenizer):
    # (no prefix cache: a hybrid model storing a prefix runs it in a pass of its own, and the
    # second forward call below must be the first decode step)
    llm = SnapKVLLM(model=model_of(name, len(tokenizer)), tokenizer=tokenizer, prefix_cache_bytes=0)
    kinds = [spec.kind for spec in llm.runner.specs]
    seen, handle = capture_caches(llm.model) if "recurrent" not in kinds else (None, None)
    try:
        result = llm.generate(QUESTION, filler_documents(5), snapkv=BUDGET, max_new_tokens=3)
    finally:
        if handle is not None:
            handle.remove()
    length = result.usage.prompt_tokens
    windows = [spec.window for spec in llm.runner.specs]
    expected = [
        length if kind == "recurrent" else 0 if kind == "none" else min(length, 64, (window or 10**9) - 1)
        for kind, window in zip(kinds, windows)
    ]
    assert result.compression.kept_tokens == expected
    if seen is not None:
        assert seen[1] == expected  # held by each layer when the first decode step runs
    assert result.compression.ratio < 1.0


# the document-aware method at 64 works inside sliding windows (96: its tokens outside the documents
# fit there) and falls back to SnapKV on full layers (89 of them); at 128 it works on full layers
@pytest.mark.parametrize(
    "method",
    [SnapKVConfig, partial(SnapKVConfig, pooling="avg"), DocSnapKVConfig, partial(AdaSnapKVConfig, floor=0.0)],
    ids=["snapkv-max", "snapkv-avg", "docsnapkv", "adasnapkv"],
)
def test_concurrent_batch_equals_single_calls(family, method):
    _, llm = family
    batch_equals_single(llm, method)


# lookahead prefills each request alone like any method, then drafts and votes: compressing, one family per
# layer kind (kept whole, every family: test_budget_above_the_prompt_is_the_full_cache; in compare with
# other methods: tests/test_lookahead.py)
@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt-oss", "deepseek-v3", "qwen3-next", "falcon-h1", "lfm2"])
def test_lookahead_drafts_the_models_greedy_answer_and_batch_equals_single_calls(name, tokenizer, monkeypatch):
    llm = SnapKVLLM(model=model_of(name, len(tokenizer)), tokenizer=tokenizer, max_new_tokens=NEW)
    ids, eos = llm.request(QUESTION, filler_documents(4)).input_ids, sorted(llm.runner.eos_ids)
    greedy = llm.model.generate(
        torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
    )[0, len(ids) :].tolist()  # transformers' own cache and states
    greedy = greedy[: next((i + 1 for i, t in enumerate(greedy) if t in eos), 4)]
    seen, real = [], lookahead.draft_and_vote
    monkeypatch.setattr(lookahead, "draft_and_vote", lambda *args: seen.append(real(*args)) or seen[-1])
    llm.generate(
        QUESTION,
        filler_documents(4),
        snapkv=LookaheadSnapKVConfig(max_capacity_prompt=64, window_size=8, lookahead=4),
        max_new_tokens=1,
    )
    assert [tokens for tokens, _ in seen] == [greedy]  # drafted one decode step at a time over the full prompt
    monkeypatch.undo()
    batch_equals_single(llm, partial(LookaheadSnapKVConfig, lookahead=4))  # the default: an even split
    batch_equals_single(llm, partial(LookaheadSnapKVConfig, lookahead=4, floor=0.2))  # ragged heads


def batch_equals_single(llm, method) -> None:
    config = method(max_capacity_prompt=64, window_size=8)
    questions = ["Which harbour lies north?", "Name the orchard.", "What lies north?", "Which castle?"]
    docs = [filler_documents(6), filler_documents(1), filler_documents(4), filler_documents(2)]
    # (ignore_eos: every row runs NEW steps, so all four decode together, hybrid families included)
    batch = llm.generate_batch(questions, docs, snapkv=config, max_new_tokens=NEW, ignore_eos=True)
    single = [llm.generate(q, d, snapkv=config, max_new_tokens=NEW, ignore_eos=True) for q, d in zip(questions, docs)]
    assert len({r.usage.prompt_tokens for r in single}) == 4
    assert [r.timings.batch_size for r in batch] == [4, 4, 4, 4]
    assert [r.raw_text for r in batch] == [r.raw_text for r in single]
    assert [r.text for r in batch] == [r.text for r in single]
    assert [r.compression.kept_tokens for r in batch] == [r.compression.kept_tokens for r in single]


def test_compare_equals_generate_for_every_method(family):
    _, llm = family
    methods = {
        "full": None,
        "snapkv": BUDGET,
        "pyramid": PyramidKVConfig(max_capacity_prompt=64, window_size=8),
        "streaming": StreamingLLMConfig(max_capacity_prompt=64),
        "h2o": H2OConfig(max_capacity_prompt=64, recent_size=8),
        "random": RandomConfig(max_capacity_prompt=64, recent_size=8),
        "docsnapkv": DocSnapKVConfig(max_capacity_prompt=128, window_size=8),
        "keynorm": KeyNormConfig(max_capacity_prompt=64, window_size=8),
        "adasnapkv": AdaSnapKVConfig(max_capacity_prompt=64, window_size=8, floor=0.0),
    }
    methods["kvzip"] = KVzipConfig(max_capacity_prompt=64, window_size=8)
    methods["kvzip-model"] = KVzipConfig(max_capacity_prompt=64, window_size=8, share="model", sink_tokens=2)
    docs = filler_documents(4)
    both = llm.compare(QUESTION, docs, methods=methods, max_new_tokens=10)
    for name, config in methods.items():
        alone = llm.generate(QUESTION, docs, snapkv=config, max_new_tokens=10)
        assert both.results[name].text == alone.text, name
        assert both.results[name].compression.kept_tokens == alone.compression.kept_tokens, name
    assert set(both.hit_rate) == set(methods) - {"full"}


def test_a_model_without_sdpa_falls_back_to_eager_with_one_log_line(tokenizer, caplog):
    model = model_of("gpt-oss", len(tokenizer))  # transformers: no sdpa for its attention sinks
    with caplog.at_level("INFO", logger="snapkv_rag"):
        llm = SnapKVLLM(model=model, tokenizer=tokenizer)
    assert llm.attn_implementation == "eager"
    lines = [r.getMessage() for r in caplog.records if r.name == "snapkv_rag"]
    assert len(lines) == 1 and "eager" in lines[0] and "GptOssForCausalLM" in lines[0]
    with pytest.raises(ValueError, match="GptOssForCausalLM cannot run 'sdpa'.*'eager'"):
        SnapKVLLM(model=model, tokenizer=tokenizer, attn_implementation="sdpa")
    assert llm.generate(QUESTION, filler_documents(2), snapkv=BUDGET, max_new_tokens=4).usage.completion_tokens > 0


def test_mlp_slicing_runs_moe_mlps_that_return_router_logits_whole(tokenizer):
    """GPT-OSS's MLP returns (output, router logits): sliced prefill must not break on it."""
    model = model_of("gpt-oss", len(tokenizer))
    sliced = SnapKVLLM(model=model, tokenizer=tokenizer, prefill_chunk=16)
    whole = SnapKVLLM(model=model, tokenizer=tokenizer, prefill_chunk=None)
    docs = filler_documents(3)
    a, b = (llm.generate(QUESTION, docs, snapkv=BUDGET, max_new_tokens=8) for llm in (sliced, whole))
    assert a.usage.prompt_tokens > 16 and a.text == b.text
    assert a.compression.kept_tokens == b.compression.kept_tokens


def test_closing_the_engine_gives_the_model_its_attention_back(tokenizer):
    model = model_of("llama", len(tokenizer))
    before = model.config._attn_implementation.removeprefix("snapkv_")
    llm = SnapKVLLM(model=model, tokenizer=tokenizer)
    assert model.config._attn_implementation == "snapkv_sdpa"
    llm.close()
    assert model.config._attn_implementation == before == "sdpa"
    assert llm.generate(QUESTION, max_new_tokens=2).usage.completion_tokens > 0  # it re-attaches when used


def tiny_minimax(vocab: int):
    """MiniMax (lightning attention + full attention), whose forward accepts only its own cache class."""
    config = transformers.MiniMaxConfig(
        **{**COMMON, "vocab_size": vocab},
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        block_size=16,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def tiny_gemma3n(vocab: int):
    """Gemma 3n: its last layers attend over K/V that earlier layers stored (``kv_sharing_modes`` "reuse")."""
    config = transformers.Gemma3nTextConfig(
        **{**COMMON, "vocab_size": vocab},
        num_hidden_layers=4,
        num_kv_shared_layers=2,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"] * 2,
        vocab_size_per_layer_input=vocab,
        hidden_size_per_layer_input=8,
        laurel_rank=8,
        activation_sparsity_pattern=[0.0] * 4,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    "model_of_case, match",
    [
        (
            lambda vocab: tiny_llama(vocab, layer_types=["chunked_attention", "full_attention"]),
            "model type 'llama' has chunked_attention layers.*supports",
        ),
        (tiny_minimax, "model type 'minimax' accepts only its own cache class \\(MiniMaxCache\\).*not supported"),
        (tiny_gemma3n, "model type 'gemma3n_text' has layers that attend over another layer's K/V"),
    ],
    ids=["chunked-attention", "minimax-own-cache", "gemma3n-shared-kv"],
)
def test_an_unsupported_model_is_refused_before_any_work_naming_the_model_type(model_of_case, match, tokenizer):
    from snapkv_rag.kv.prompt_cache import UnsupportedModelError

    model = model_of_case(len(tokenizer))
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(UnsupportedModelError, match=match):
            SnapKVLLM(model=model, tokenizer=tokenizer)
    finally:
        handle.remove()
    assert calls == []
