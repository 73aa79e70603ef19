"""The compressed document store on a tiny random-weight Llama: documents compressed once by a
query-agnostic method, questions over the handle prefilling only their tail."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from families import tiny_model as family_model
from server_testing import running_server
from snapkv_testing import filler_documents, tiny_llama

from snapkv_rag import (
    DocSnapKVConfig,
    H2OConfig,
    KeyNormConfig,
    KVzipConfig,
    PyramidKVConfig,
    SnapKVConfig,
    SnapKVLLM,
    StreamingLLMConfig,
)
from snapkv_rag.documents.store import DocumentSet
from snapkv_rag.methods.selection import key_norm_select

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTIONS = ["What lies north?", "Which castle is number 40?", "Where is the orchard?"]
DOCS = filler_documents(6)
HALF = KeyNormConfig(ratio=0.5, window_size=8)


@pytest.fixture()
def llm(tiny_model, tokenizer):
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=10)


def test_keeping_everything_answers_as_a_full_prefill(llm):
    """With nothing dropped, the tail over the stored prefix gives the whole prompt's greedy tokens:
    the reuse itself changes nothing."""
    handle = llm.index_documents(DOCS, method=KeyNormConfig(ratio=1.0))
    for question in QUESTIONS:
        over, whole = handle.generate(question), llm.generate(question, DOCS, snapkv=False)
        assert over.raw_text == whole.raw_text and over.text == whole.text
        assert over.usage.cached_tokens == handle.prompt_tokens
        assert over.usage.prompt_tokens == whole.usage.prompt_tokens
        assert over.compression.kept_tokens == [whole.usage.prompt_tokens] * 2


def test_kept_positions_are_the_methods_selection_over_the_documents(llm):
    """What is stored is exactly key-norm's selection over the prefix's own K/V at ratio x prefix
    length; a question keeps those plus its whole tail, at positions after the uncompressed prefix."""
    handle = llm.index_documents(DOCS, method=HALF)
    entry = handle.entry()
    full = llm.runner.prefill([list(entry.ids)], {"full": None}).compressed["full"][0]
    budget = math.ceil(0.5 * entry.length)
    for i, kv in enumerate(full.layers):
        _, _, expected = key_norm_select(kv.keys, kv.values, HALF, capacity=budget)
        assert torch.equal(entry.layers[i].positions, expected), i
    result = handle.generate(QUESTIONS[0])
    tail = result.usage.prompt_tokens - entry.length
    assert result.compression.kept_tokens == [budget + tail] * 2
    assert result.compression.prompt_tokens == result.usage.prompt_tokens  # positions go on from the full length


def test_stored_bytes_are_the_kept_fraction_of_the_full_cache(llm):
    for ratio in (0.25, 0.5):
        handle = llm.index_documents(filler_documents(12), method=KeyNormConfig(ratio=ratio))
        assert abs(handle.kept_bytes - ratio * handle.full_bytes) <= 0.02 * ratio * handle.full_bytes
        kv = [t.numel() * t.element_size() for layer in handle.entry().layers for t in (layer.keys, layer.values)]
        assert sum(kv) == handle.kept_bytes
    assert llm.doc_stats().bytes_used == sum(llm.doc_store.get(k).nbytes for k in llm.doc_store.keys())


def test_questions_hit_the_store_and_later_questions_are_the_same(llm):
    handle = llm.index_documents(DOCS, method=HALF)
    first = [handle.generate(q).text for q in QUESTIONS]
    assert llm.index_documents(DOCS, method=HALF).key == handle.key  # indexed once
    assert [llm.generate(q, handle).text for q in QUESTIONS] == first
    assert "".join(handle.stream(QUESTIONS[0])) == first[0]
    stats = llm.doc_stats()
    assert (stats.hits, stats.misses, stats.stored, stats.entries) == (7, 1, 1, 1)
    assert stats.tokens_saved == 7 * handle.prompt_tokens


def test_batch_equals_single_with_handles(llm):
    handle = llm.index_documents(DOCS, method=StreamingLLMConfig(ratio=0.5))
    other = llm.index_documents(filler_documents(4), method=HALF)
    handles = [handle, other, handle]
    batch = llm.generate_batch(QUESTIONS, handles, batch_size=3)
    assert [r.raw_text for r in batch] == [h.generate(q).raw_text for q, h in zip(QUESTIONS, handles)]


def test_n_choices_over_a_handle_share_one_tail_prefill(llm):
    """n choices over a stored set run over the stored cache (one tail prefill), and choice i is the
    lone request with seed + i; compare over a handle is refused (it compares methods)."""
    handle = llm.index_documents(DOCS, method=HALF)
    before = llm.stats().prefills
    result = handle.generate(QUESTIONS[0], n=3, temperature=0.9, seed=5)
    assert llm.stats().prefills == before + 1 and llm.doc_stats().hits == 1
    assert [c.usage.cached_tokens for c in result.choices] == [handle.prompt_tokens] * 3
    alone = [handle.generate(QUESTIONS[0], temperature=0.9, seed=5 + i).raw_text for i in range(3)]
    assert [c.raw_text for c in result.choices] == alone
    with pytest.raises(ValueError, match="compare runs every method over the documents"):
        llm.compare(QUESTIONS[0], handle, methods={"full": None, "snapkv": SnapKVConfig()})


def test_kvzip_handle(llm):
    handle = llm.index_documents(DOCS, method=KVzipConfig(ratio=0.5, window_size=8))
    assert handle.kept_bytes < 0.6 * handle.full_bytes
    assert handle.generate(QUESTIONS[0]).usage.cached_tokens == handle.prompt_tokens


@pytest.mark.parametrize("method", [SnapKVConfig(), PyramidKVConfig(), DocSnapKVConfig(), H2OConfig()])
def test_query_aware_methods_are_refused(llm, method):
    with pytest.raises(ValueError, match="method: .*query-agnostic"):
        llm.index_documents(DOCS, method=method)


def test_bad_requests_over_a_handle(llm, tiny_model, tokenizer):
    handle = llm.index_documents(DOCS, method=HALF)
    with pytest.raises(ValueError, match="snapkv: a question over a document handle"):
        handle.generate(QUESTIONS[0], snapkv=SnapKVConfig())
    with pytest.raises(ValueError, match="does not start with the stored documents"):
        handle.generate(QUESTIONS[0], cite="json")
    with pytest.raises(ValueError, match="does not start with the stored documents"):
        llm.chat(
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": QUESTIONS[0]},
            ],
            handle,
        )
    stranger = SnapKVLLM(model=tiny_llama(len(tokenizer), seed=1), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="another model"):
        stranger.generate(QUESTIONS[0], handle)


def test_lru_eviction_by_bytes_is_counted_and_a_handle_survives_it(tiny_model, tokenizer):
    probe = SnapKVLLM(model=tiny_model, tokenizer=tokenizer).index_documents(DOCS, method=HALF)
    size = probe.entry().nbytes
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=6, doc_store_bytes=int(size * 1.5))
    a = llm.index_documents(DOCS, method=HALF)
    answer = a.generate(QUESTIONS[0]).text
    b = llm.index_documents(filler_documents(5), method=HALF)
    stats = llm.doc_stats()
    assert (stats.evicted, stats.entries, llm.doc_store.keys()) == (1, 1, [b.key])
    assert stats.bytes_used <= stats.max_bytes
    assert a.generate(QUESTIONS[0]).text == answer  # indexed again, counted as a miss
    assert llm.doc_stats().misses == 3 and llm.doc_stats().evicted == 2


def test_save_load_round_trip_and_overwrite_rule(llm, tiny_model, tokenizer, tmp_path):
    handle = llm.index_documents(DOCS, method=HALF)
    answers = [handle.generate(q).raw_text for q in QUESTIONS]
    path = tmp_path / "docs.safetensors"
    handle.save(path)
    handle.save(path)  # the same set again: rewritten
    fresh = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=10)
    loaded = fresh.load_documents(path)
    assert isinstance(loaded, DocumentSet) and loaded.key == handle.key and loaded.method == HALF
    assert [d.text for d in loaded.documents] == [d["text"] for d in DOCS]
    assert [loaded.generate(q).raw_text for q in QUESTIONS] == answers
    assert fresh.doc_stats().entries == 1
    other = llm.index_documents(filler_documents(3), method=HALF)
    with pytest.raises(FileExistsError, match="another document set"):
        other.save(path)
    assert fresh.load_documents(path).key == handle.key  # not replaced
    other.save(path, overwrite=True)
    assert fresh.load_documents(path).key == other.key


def test_files_from_another_model_or_corrupt_are_refused(tokenizer, tmp_path):
    """A file of this model loads only into an engine of the same weights, configuration and dtype."""
    llm = SnapKVLLM(model=tiny_llama(len(tokenizer)), tokenizer=tokenizer)  # its own (the shared one can be cast)
    path = tmp_path / "docs.safetensors"
    llm.index_documents(DOCS, method=HALF).save(path)
    for model, what in (
        (tiny_llama(len(tokenizer), seed=1), "model configuration"),
        (tiny_llama(len(tokenizer), num_hidden_layers=3), "model configuration"),
        (tiny_llama(len(tokenizer)).to(torch.float64), "dtype"),
    ):
        with pytest.raises(ValueError, match=f"another {what}"):
            SnapKVLLM(model=model, tokenizer=tokenizer).load_documents(path)
    data = path.read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        llm.load_documents(tmp_path / "short.safetensors")
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    (tmp_path / "flipped.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="checksum"):
        llm.load_documents(tmp_path / "flipped.safetensors")
    (tmp_path / "text.safetensors").write_text("hello")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        llm.load_documents(tmp_path / "text.safetensors")
    with pytest.raises(FileNotFoundError):
        llm.load_documents(tmp_path / "missing.safetensors")


def test_documents_over_the_context_window(tokenizer):
    small = SnapKVLLM(model=tiny_llama(len(tokenizer), max_position_embeddings=256), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="documents: the indexed prompt is .* context window of 256"):
        small.index_documents(DOCS, method=HALF)
    assert small.doc_stats().entries == 0


# (Qwen3-Next and Falcon-H1: their tails over stored states are checked in tests/test_recurrent_tail.py)
@pytest.mark.parametrize("family", ["lfm2", "zamba2", "nemotron-h"])
def test_models_with_recurrent_layers_answer_over_a_stored_set(family, tokenizer, tmp_path):
    """Recurrent and hybrid layers: the states after the documents are stored beside the kept K/V,
    and each question's tail runs one token per step from a copy of them. Kept whole, the answers
    equal a whole-prompt prefill's, question after question (the stored states are never stepped
    in place); compressed (key-norm, KVzip), a batch equals single calls and a saved set answers
    the same."""
    llm = SnapKVLLM(model=family_model(family, len(tokenizer)), tokenizer=tokenizer, max_new_tokens=8)
    whole = llm.index_documents(DOCS, method=KeyNormConfig(ratio=1.0))
    stored = [
        t.clone()
        for state in whole.entry().states
        if state is not None
        for t in [*state.conv_states.values(), *state.recurrent_states.values()]
        if t is not None
    ]
    for question in QUESTIONS + QUESTIONS[:1]:
        over, alone = (
            whole.generate(question, ignore_eos=True),
            llm.generate(question, DOCS, snapkv=False, ignore_eos=True),
        )
        assert over.raw_text == alone.raw_text and over.usage.cached_tokens == whole.prompt_tokens
    after = [
        t
        for state in whole.entry().states
        if state is not None
        for t in [*state.conv_states.values(), *state.recurrent_states.values()]
        if t is not None
    ]
    assert stored and all(torch.equal(a, b) for a, b in zip(stored, after, strict=True))  # never stepped in place
    _compressed_sets_answer_alike(llm, tokenizer, tmp_path)


def test_latent_attention_models_answer_over_a_stored_set(tokenizer, tmp_path):
    """Multi-head latent attention (DeepSeek-V3: the cache holds one latent and one rotary key per
    token for every head): kept whole, the tail over the stored set gives the whole prompt's tokens;
    compressed (key-norm, KVzip), a batch equals single calls, and a saved set answers the same."""
    llm = SnapKVLLM(model=family_model("deepseek-v3", len(tokenizer)), tokenizer=tokenizer, max_new_tokens=8)
    whole = llm.index_documents(DOCS, method=KeyNormConfig(ratio=1.0))
    for question in QUESTIONS:
        over, alone = (
            whole.generate(question, ignore_eos=True),
            llm.generate(question, DOCS, snapkv=False, ignore_eos=True),
        )
        assert over.raw_text == alone.raw_text and over.usage.cached_tokens == whole.prompt_tokens
    for method in (HALF, KVzipConfig(ratio=0.5, window_size=8)):
        handle = llm.index_documents(DOCS, method=method)
        assert 0.45 < handle.kept_bytes / handle.full_bytes < 0.55
    _compressed_sets_answer_alike(llm, tokenizer, tmp_path)


@pytest.mark.parametrize("family", ["mistral-window", "gemma3", "cohere2"])
def test_sliding_window_models_answer_over_a_stored_set(family, tokenizer):
    """Prompts longer than the window: kept whole, the tail over the stored set gives the whole
    prompt's tokens (each tail query sees only its window of the stored slots); compressed, the
    questions are answered from the set, and a batch equals single calls."""
    llm = SnapKVLLM(model=family_model(family, len(tokenizer)), tokenizer=tokenizer, max_new_tokens=8)
    assert any(spec.window is not None and spec.window < 200 for spec in llm.runner.specs)
    whole = llm.index_documents(DOCS, method=KeyNormConfig(ratio=1.0))
    assert whole.prompt_tokens > 400
    for question in QUESTIONS:
        over, alone = (
            whole.generate(question, ignore_eos=True),
            llm.generate(question, DOCS, snapkv=False, ignore_eos=True),
        )
        assert over.raw_text == alone.raw_text and over.usage.cached_tokens == whole.prompt_tokens
    _compressed_sets_answer_alike(llm, tokenizer)


def _compressed_sets_answer_alike(llm, tokenizer, tmp_path=None) -> None:
    """Over a set compressed by key-norm and by KVzip at 50%: each question gets its 8 tokens over the
    stored prefix, a batch equals single calls, and (with ``tmp_path``) a saved and loaded set
    answers the same in a fresh engine."""
    for method in (HALF, KVzipConfig(ratio=0.5, window_size=8)):
        handle = llm.index_documents(DOCS, method=method)
        single = [handle.generate(q, ignore_eos=True) for q in QUESTIONS]
        assert all(r.usage.completion_tokens == 8 and r.usage.cached_tokens == handle.prompt_tokens for r in single)
        batch = llm.generate_batch(QUESTIONS, [handle] * 3, ignore_eos=True)
        assert [r.raw_text for r in batch] == [r.raw_text for r in single]
        if tmp_path is not None:
            handle.save(tmp_path / "set.safetensors", overwrite=True)
            fresh = SnapKVLLM(model=llm.model, tokenizer=tokenizer, max_new_tokens=8)
            loaded = fresh.load_documents(tmp_path / "set.safetensors")
            assert [loaded.generate(q, ignore_eos=True).raw_text for q in QUESTIONS] == [r.raw_text for r in single]


def test_server_reuses_stored_caches_by_content(llm):
    """A query-agnostic request over documents seen before runs over their stored cache: same
    answer as over a handle, counted in /metrics; a SnapKV request over them does not use it."""
    with running_server(llm, max_documents=8) as (url, _):

        def ask(question, docs=DOCS, snapkv=None):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": question}],
                "documents": docs,
                "max_tokens": 6,
                "snapkv": snapkv or {"method": "keynorm", "budget": "50%", "window_size": 8},
            }
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()

        answers = [ask(q) for q in QUESTIONS]
        ask(QUESTIONS[0], filler_documents(3))
        snapkv = ask(QUESTIONS[0], snapkv={"method": "snapkv", "budget": 128, "window_size": 8})
        metrics = httpx.get(url + "/metrics").text
    handle = llm.index_documents(DOCS, method=HALF)
    assert [a["choices"][0]["message"]["content"] for a in answers] == [
        handle.generate(q, max_new_tokens=6).text for q in QUESTIONS
    ]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [handle.prompt_tokens] * 3
    assert snapkv["snapkv"]["compression"]["method"] == "snapkv"
    assert "snapkv_rag_doc_store_hits 4.0" in metrics and "snapkv_rag_doc_store_misses 2.0" in metrics
    saved = 3 * handle.prompt_tokens + llm.index_documents(filler_documents(3), method=HALF).prompt_tokens
    assert f"snapkv_rag_doc_store_tokens_saved {float(saved)}" in metrics
    assert "snapkv_rag_doc_store_entries 2.0" in metrics
