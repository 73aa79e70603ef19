"""Engine plumbing on a tiny random-weight Llama: cache sizes, positions, batching, streaming."""

from __future__ import annotations

import re

import pytest
import torch
from snapkv_testing import cache_kwarg, capture_caches, filler_documents, seeded
from transformers import DynamicCache

from snapkv_rag import PyramidKVConfig, SnapKVConfig, SnapKVLLM, StreamingLLMConfig
from snapkv_rag.methods.selection import snapkv_select

BUDGET = SnapKVConfig(max_capacity_prompt=64, window_size=8)


def test_compressed_cache_holds_budget_plus_generated(tiny_engine):
    seen, handle = capture_caches(tiny_engine.model)
    try:
        result = tiny_engine.generate("What lies north?", filler_documents(6), snapkv=BUDGET, max_new_tokens=10)
    finally:
        handle.remove()
    assert result.usage.prompt_tokens > 200
    assert result.compression.kept_tokens == [64, 64]
    # before decode step t the cache holds the budget plus the t tokens fed so far
    decode_sizes = seen[1:]
    assert decode_sizes == [[64 + t, 64 + t] for t in range(len(decode_sizes))]
    assert result.compression.kv_bytes_kept * result.usage.prompt_tokens == pytest.approx(
        result.compression.kv_bytes_full * 64
    )


def test_decode_continues_at_original_positions(tiny_engine, tokenizer):
    """Greedy decode from the compressed cache equals a hand-made reference: prefill in full,
    select with the pure function, then feed tokens at positions L, L+1, ..."""
    model = tiny_engine.model
    question, docs = "What lies north?", filler_documents(5)
    result = tiny_engine.generate(question, docs, snapkv=BUDGET, max_new_tokens=8)
    ids = tiny_engine.request(question, docs).input_ids
    length = len(ids)
    cache = DynamicCache(config=model.config)
    queries = {}
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, i=i: queries.__setitem__(i, out))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.inference_mode():
        out = model(torch.tensor([ids]), **{cache_kwarg(model): cache}, use_cache=True)
    for h in hooks:
        h.remove()
    # recompute the rotated window queries of each layer and compress that layer by hand
    cos, sin = model.model.rotary_emb(out.logits, torch.arange(length)[None])
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    for i, layer in enumerate(cache.layers):
        q = queries[i].view(1, length, 4, 16).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v, _ = snapkv_select(q[..., -8:, :], layer.keys, layer.values, BUDGET)
        layer.keys, layer.values = k, v
    tokens, logits = [], out.logits[:, -1]
    with torch.inference_mode():
        for step in range(8):
            token = int(logits.argmax(-1))
            if token in tiny_engine.runner.eos_ids:
                break
            tokens.append(token)
            logits = model(
                torch.tensor([[token]]),
                **{cache_kwarg(model): cache},
                position_ids=torch.tensor([[length + step]]),
                use_cache=True,
            ).logits[:, -1]
    assert result.text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_budget_above_prompt_equals_full_cache_and_model_generate(tiny_engine, tokenizer):
    question, docs = "Which castle?", filler_documents(2)
    big = tiny_engine.generate(question, docs, snapkv=SnapKVConfig(max_capacity_prompt=4096), max_new_tokens=10)
    full = tiny_engine.generate(question, docs, snapkv=False, max_new_tokens=10)
    assert big.text == full.text and big.compression.ratio == 1.0
    ids = torch.tensor([tiny_engine.request(question, docs).input_ids])
    reference = tiny_engine.model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=2)
    assert full.text == tokenizer.decode(reference[0, ids.shape[1] :], skip_special_tokens=True)


def test_batch_of_unequal_prompts_equals_single_calls(tiny_engine):
    questions = ["What lies north?", "Which harbour is it?", "Name the orchard."]
    docs = [filler_documents(6), filler_documents(2), filler_documents(4)]
    # PyramidKV gives each layer its own cache length: each layer masks its own slots
    for config in (
        BUDGET,
        SnapKVConfig(max_capacity_prompt=400, window_size=8),
        False,
        PyramidKVConfig(max_capacity_prompt=64, window_size=8),
    ):
        batch = tiny_engine.generate_batch(questions, docs, snapkv=config, max_new_tokens=8)
        single = [tiny_engine.generate(q, d, snapkv=config, max_new_tokens=8) for q, d in zip(questions, docs)]
        assert [r.text for r in batch] == [r.text for r in single]
        assert [r.usage.prompt_tokens for r in batch] == [r.usage.prompt_tokens for r in single]


def test_stream_concatenates_to_generate_and_stop_strings_cut(tiny_engine):
    question, docs = "What lies north?", filler_documents(3)
    text = tiny_engine.generate(question, docs, max_new_tokens=12).text
    pieces = list(tiny_engine.stream(question, docs, max_new_tokens=12))
    assert len(pieces) > 1 and "".join(pieces) == text
    assert text, "the tiny model produced no text to cut"
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = tiny_engine.generate(question, docs, max_new_tokens=12, stop=[stop])
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    assert "".join(tiny_engine.stream(question, docs, max_new_tokens=12, stop=[stop])) == cut.text


def test_sampling_is_reproducible_with_a_seed(tiny_engine):
    a = tiny_engine.generate("Hello?", temperature=0.9, top_p=0.9, seed=7, max_new_tokens=8)
    b = tiny_engine.generate("Hello?", temperature=0.9, top_p=0.9, seed=7, max_new_tokens=8)
    assert a.text == b.text


def test_compare_shares_one_prefill_and_matches_separate_runs(tiny_engine):
    docs = filler_documents(6)
    methods = {"full": None, "snapkv": BUDGET, "streaming": StreamingLLMConfig(max_capacity_prompt=64)}
    both = tiny_engine.compare("What lies north?", docs, methods=methods, max_new_tokens=8)
    for name, config in methods.items():
        alone = tiny_engine.generate("What lies north?", docs, snapkv=config, max_new_tokens=8)
        assert both.results[name].text == alone.text
        assert both.results[name].compression.kept_tokens == alone.compression.kept_tokens
    assert set(both.hit_rate) == {"snapkv", "streaming"}
    assert all(0.0 <= rate <= 1.0 for rate in both.hit_rate.values())


def test_eager_attention_gives_the_same_selection(tiny_model, tokenizer):
    docs = filler_documents(5)
    sdpa = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, attn_implementation="sdpa")
    first = sdpa.generate("What lies north?", docs, snapkv=BUDGET, max_new_tokens=8)
    eager = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, attn_implementation="eager")
    second = eager.generate("What lies north?", docs, snapkv=BUDGET, max_new_tokens=8)
    SnapKVLLM(model=tiny_model, tokenizer=tokenizer)  # restore sdpa for the other tests
    assert first.text == second.text


def test_chunked_mlp_prefill_computes_the_same_answer(tiny_model, tokenizer):
    """``prefill_chunk`` slices each MLP's input during prefill (bounding its activations on long
    prompts) and changes nothing else: same kept positions, same greedy answer."""
    chunked = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, prefill_chunk=16)
    whole = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, prefill_chunk=None)
    seen: list[int] = []
    handle = tiny_model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[-2])
    )
    try:
        question, docs = "What lies north?", filler_documents(4)
        a = chunked.generate(question, docs, snapkv=BUDGET, max_new_tokens=10)
        prefill_calls, seen[:] = list(seen), []
        b = whole.generate(question, docs, snapkv=BUDGET, max_new_tokens=10)
    finally:
        handle.remove()
    length = a.usage.prompt_tokens
    assert length > 100
    # prefill: ceil(L / 16) slices of at most 16 tokens, then one call per decoded token
    assert prefill_calls[: -(-length // 16)] == [16] * (length // 16) + ([length % 16] if length % 16 else [])
    assert set(prefill_calls[-(-length // 16) :]) <= {1}
    assert seen[0] == length  # unchunked engine: the whole prompt at once
    assert a.text == b.text and a.compression.kept_tokens == b.compression.kept_tokens


def test_prefill_chunk_is_validated(tiny_model, tokenizer):
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            SnapKVLLM(model=tiny_model, tokenizer=tokenizer, prefill_chunk=bad)


def test_compiled_decode_gives_the_same_answers_and_compiles_once_per_shape(tiny_model, tokenizer):
    """``compile=True`` decodes from fixed-size buffers through torch.compile: same greedy text as
    the plain loop (SnapKV, full cache, a padded batch), and a second request with the same cache
    shape reuses the compiled step."""
    from torch._dynamo.utils import counters

    plain = SnapKVLLM(model=tiny_model, tokenizer=tokenizer)
    compiled = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, compile=True)
    question = "What lies north?"
    first = compiled.generate(question, filler_documents(6), snapkv=BUDGET, max_new_tokens=10)
    assert first.text == plain.generate(question, filler_documents(6), snapkv=BUDGET, max_new_tokens=10).text
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    again = compiled.generate(question, filler_documents(7), snapkv=BUDGET, max_new_tokens=10)
    assert counters["stats"]["unique_graphs"] == graphs  # same budget, same shapes: no new compile
    assert again.text == plain.generate(question, filler_documents(7), snapkv=BUDGET, max_new_tokens=10).text
    questions, docs = [question, "Who?"], [filler_documents(3), filler_documents(1)]
    for snapkv in (False, SnapKVConfig(max_capacity_prompt=160, window_size=8)):  # 2nd: one row under budget
        got = compiled.generate_batch(questions, docs, snapkv=snapkv, max_new_tokens=8)
        want = plain.generate_batch(questions, docs, snapkv=snapkv, max_new_tokens=8)
        assert [r.text for r in got] == [r.text for r in want]


def test_compile_option_is_validated(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="compile"):
        SnapKVLLM(model=tiny_model, tokenizer=tokenizer, compile=3)


def test_masked_decode_attention_equals_transformers_sdpa(tiny_model):
    """A decode token over a masked cache (padded batches, the compiled fixed-size cache) goes
    through SDPA with grouped heads instead of transformers' copy of every KV head: same output."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from snapkv_rag.runtime.attention import grouped_sdpa

    module = tiny_model.model.layers[0].self_attn
    g = seeded(0)
    query = torch.randn(2, 4, 1, 16, generator=g)
    key, value = torch.randn(2, 2, 50, 16, generator=g), torch.randn(2, 2, 50, 16, generator=g)
    mask = torch.ones(2, 1, 1, 50, dtype=torch.bool)
    mask[1, ..., :12] = False  # a left-padded row
    mask[:, ..., 45:] = False  # slots not written yet
    want, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=module.scaling)
    got, _ = grouped_sdpa(module, query, key, value, mask, module.scaling)
    torch.testing.assert_close(got, want)


def test_budget_as_a_share_of_the_prompt(tiny_engine):
    docs = filler_documents(6)
    half = tiny_engine.generate(
        "What lies north?", docs, snapkv=SnapKVConfig(ratio=0.5, window_size=8), max_new_tokens=4
    )
    length = half.usage.prompt_tokens
    assert half.compression.kept_tokens == [-(-length // 2)] * 2 and half.compression.ratio == pytest.approx(
        0.5, abs=0.01
    )
    short = tiny_engine.generate(
        "What lies north?",
        filler_documents(1),
        snapkv=SnapKVConfig(ratio=0.1, window_size=8, min_capacity_prompt=64),
        max_new_tokens=4,
    )
    assert short.compression.kept_tokens == [min(64, short.usage.prompt_tokens)] * 2  # never below the minimum
    by_tokens = tiny_engine.generate(
        "What lies north?",
        docs,
        snapkv=SnapKVConfig(max_capacity_prompt=-(-length // 2), window_size=8),
        max_new_tokens=4,
    )
    assert by_tokens.text == half.text  # the share resolves to the same budget in tokens
    both = tiny_engine.compare(
        "What lies north?",
        docs,
        methods={"half": SnapKVConfig(ratio=0.5, window_size=8)},
        max_new_tokens=4,
        hit_rate=False,
    )
    assert both.results["half"].compression.kept_tokens == half.compression.kept_tokens


@pytest.mark.parametrize(
    "bad,words",
    [
        (dict(ratio=0), "ratio: must be a share of the prompt in (0, 1]"),
        (dict(ratio=1.5), "ratio: must be a share of the prompt in (0, 1]"),
        (dict(ratio=0.5, max_capacity_prompt=512), "give max_capacity_prompt (tokens kept) or ratio"),
        (dict(ratio=0.5, min_capacity_prompt=16), "min_capacity_prompt: must be an integer larger than window_size=32"),
    ],
)
def test_a_share_is_validated(bad, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SnapKVConfig(**bad)
