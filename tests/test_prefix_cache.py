"""The document prefix cache on tiny random-weight models: a prompt whose instruction + documents
were prefilled before prefills only its question, and then keeps what it keeps without the cache."""

from __future__ import annotations

import concurrent.futures
import json
import logging

import httpx
import pytest
import torch
from families import FAMILIES, tiny_model
from server_testing import running_server
from snapkv_testing import filler_documents

from snapkv_rag import DocSnapKVConfig, H2OConfig, SnapKVConfig, SnapKVLLM, StreamingLLMConfig
from snapkv_rag.kv import tails
from snapkv_rag.kv.prefix_cache import Prefix, PrefixCache, PrefixLayer, boundary, unsupported
from snapkv_rag.models.layer_kinds import FULL, RECURRENT, LayerSpec

QUESTIONS = ["What lies north?", "Which castle is number 40?", "Where is the orchard that lies north of the river?"]
WINDOW_8 = SnapKVConfig(max_capacity_prompt=64, window_size=8)
WINDOW_48 = SnapKVConfig(max_capacity_prompt=96, window_size=48)  # reaches back into the cached instruction


@pytest.fixture()
def cached(tiny_model, tokenizer):
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=12)


@pytest.fixture()
def uncached(tiny_model, tokenizer):
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=12, prefix_cache_bytes=0)


def _prefill_both(llm, question, docs, methods):
    """(without the cache, from the cache) prefills of one prompt on ``llm``'s runner."""
    request = llm.request(question, docs)
    ids, spans = request.input_ids, request.spans
    methods = {name: m and m.for_prompt(len(ids)).with_spans(spans) for name, m in methods.items()}
    at = boundary(ids, spans)
    whole = llm.runner.prefill([ids], methods)
    llm.runner.prefill([llm.request(QUESTIONS[0], docs).input_ids], methods, at)  # stores the prefix
    split = llm.runner.prefill([ids], methods, at)
    return whole, split, at


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_split_prefill_keeps_the_same_positions(family, tokenizer):
    """Prefix from the cache + question on top: every method keeps exactly the positions it keeps
    after a whole prefill (the window's votes run over the whole prompt), and the next-token logits
    agree to float rounding. mistral-window has sliding layers shorter than the prompt."""
    model = tiny_model(family, len(tokenizer))
    llm = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=8)
    docs = filler_documents(6)
    methods = {
        "w8": WINDOW_8,
        "w48": WINDOW_48,
        "doc": DocSnapKVConfig(max_capacity_prompt=128, window_size=16),
        "streaming": StreamingLLMConfig(max_capacity_prompt=64),
        "full": None,
    }
    for question in QUESTIONS[1:]:
        whole, split, at = _prefill_both(llm, question, docs, methods)
        assert split.cached_tokens == at > 300 and whole.cached_tokens == 0
        for name in methods:
            a, b = whole.compressed[name][0], split.compressed[name][0]
            assert a.kept_tokens() == b.kept_tokens(), name
            for layer, positions in a.kept_positions().items():
                assert torch.equal(positions, b.kept_positions()[layer]), (name, layer)
                assert torch.allclose(a.layers[layer].keys, b.layers[layer].keys, atol=1e-5), (name, layer)
        assert torch.allclose(whole.logits, split.logits, atol=1e-4)
        assert whole.logits.argmax() == split.logits.argmax()


def test_greedy_answers_equal_and_later_questions_hit(cached, uncached):
    docs = filler_documents(6)
    for config in (WINDOW_8, WINDOW_48, None):
        for i, question in enumerate(QUESTIONS):
            a, b = uncached.generate(question, docs, snapkv=config), cached.generate(question, docs, snapkv=config)
            assert (b.text, b.compression.kept_tokens) == (a.text, a.compression.kept_tokens)
            assert a.usage.cached_tokens == 0
            first = config is WINDOW_8 and i == 0
            assert (b.usage.cached_tokens == 0) if first else (b.usage.cached_tokens > 300)
            assert b.usage.prompt_tokens == a.usage.prompt_tokens  # cached tokens are still prompt tokens
    stats = cached.prefix_stats()
    assert (stats.hits, stats.misses, stats.entries) == (8, 1, 1)
    assert stats.tokens_saved == 8 * b.usage.cached_tokens and stats.bytes_used > 0
    assert uncached.prefix_stats().hits == uncached.prefix_stats().misses == 0


def test_a_prompt_that_differs_inside_the_documents_is_not_a_hit(cached, uncached):
    docs = filler_documents(6)
    cached.generate(QUESTIONS[0], docs, snapkv=WINDOW_8)
    changed = [dict(d) for d in docs]
    changed[3]["text"] = changed[3]["text"].replace("number", "nummer", 1)
    for other in (changed, docs[:5], [docs[1], docs[0], *docs[2:]]):  # a word, one fewer, another order
        b = cached.generate(QUESTIONS[1], other, snapkv=WINDOW_8)
        assert b.usage.cached_tokens == 0
        assert b.text == uncached.generate(QUESTIONS[1], other, snapkv=WINDOW_8).text
    assert cached.prefix_stats().hits == 0


def test_lookup_is_the_longest_prefix_by_token_ids():
    cache = PrefixCache(1 << 20)
    cache.store(_prefix([1, 2, 3]))
    cache.store(_prefix([1, 2, 3, 4, 5]))
    assert cache.lookup([1, 2, 3, 4, 5, 6]).ids == (1, 2, 3, 4, 5)
    assert cache.lookup([1, 2, 3, 4, 9]).ids == (1, 2, 3)
    assert cache.lookup([1, 2, 3, 4, 5], limit=4).ids == (1, 2, 3)  # never past the prompt's boundary
    assert cache.lookup([1, 2, 3]) is None  # at least one token is left to prefill
    assert cache.lookup([1, 7, 3, 4, 5, 6]) is None
    assert cache.lookup([1, 2, 3, 4, 5, 6], queries=100) is None  # too few queries for that window
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.tokens_saved) == (3, 3, 5 + 3 + 3)


def test_lru_eviction_by_bytes():
    size = _prefix([1]).nbytes
    cache = PrefixCache(3 * size)
    for first in (1, 2, 3):
        assert cache.store(_prefix([first]))
    assert cache.lookup([1, 0]) is not None  # 1 is now the most recently used: 2 goes first
    cache.store(_prefix([4]))
    assert cache.lookup([2, 0]) is None and cache.lookup([1, 0]) is not None
    assert cache.stats().entries == 3 and cache.stats().bytes_used == 3 * size and cache.stats().evicted == 1
    assert not cache.store(_prefix(list(range(8))))  # larger than the whole cache: not kept, nothing evicted
    assert cache.stats().entries == 3
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        PrefixCache(-1)


def test_a_hit_does_not_write_into_the_cached_prefix(cached):
    docs = filler_documents(4)
    cached.generate(QUESTIONS[0], docs, snapkv=None)
    (entry,) = cached.prefix_cache._entries.values()
    before = [(layer.keys.clone(), layer.values.clone()) for layer in entry.layers]
    for question in QUESTIONS[1:]:
        assert cached.generate(question, docs, snapkv=None, max_new_tokens=6).usage.cached_tokens > 0
    for (k, v), layer in zip(before, entry.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


def test_concurrent_callers_share_the_cache(cached, uncached):
    sets = [filler_documents(5), filler_documents(4, words=90)]
    work = [(q, s) for q in QUESTIONS for s in (0, 1)] * 2
    expected = {(q, s): uncached.generate(q, sets[s], snapkv=WINDOW_8).text for q, s in set(work)}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda item: cached.generate(item[0], sets[item[1]], snapkv=WINDOW_8), work))
    assert [r.text for r in results] == [expected[item] for item in work]
    stats = cached.prefix_stats()
    assert (stats.hits, stats.misses, stats.entries) == (len(work) - 2, 2, 2)  # one worker: one miss per set
    assert sum(r.usage.cached_tokens > 0 for r in results) == stats.hits


def test_methods_and_models_that_are_not_cached_say_so(cached, uncached, caplog):
    docs = filler_documents(4)
    h2o = H2OConfig(max_capacity_prompt=64, recent_size=8)
    with caplog.at_level(logging.INFO, logger="snapkv_rag"):
        for question in QUESTIONS[:2]:
            result = cached.generate(question, docs, snapkv=h2o)
            assert result.usage.cached_tokens == 0
            assert result.text == uncached.generate(question, docs, snapkv=h2o).text
    assert sum("prefix cache not used: H2O" in r.message for r in caplog.records) == 1
    assert "recurrent" in unsupported([LayerSpec(FULL), LayerSpec(RECURRENT, state=True)])
    assert unsupported([LayerSpec(FULL), LayerSpec(FULL)]) is None
    assert cached.prefix_stats().hits == 0
    no_docs = cached.generate(QUESTIONS[0]), cached.generate(QUESTIONS[0])
    assert [r.usage.cached_tokens for r in no_docs] == [0, 0]  # no documents: no prefix boundary


def test_server_metrics_and_usage(cached):
    docs = filler_documents(4)
    with running_server(cached, max_documents=8) as (url, _):

        def ask(question, **extra):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": question}],
                "documents": docs,
                "max_tokens": 6,
                **extra,
            }
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)

        first, second = ask(QUESTIONS[0]).json(), ask(QUESTIONS[1]).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached_tokens = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 300 < cached_tokens < second["usage"]["prompt_tokens"]
        streamed = ask(QUESTIONS[2], stream=True, stream_options={"include_usage": True}).text
        events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached_tokens}
        metrics = httpx.get(url + "/metrics").text
    assert "snapkv_rag_prefix_cache_hits 2.0" in metrics
    assert "snapkv_rag_prefix_cache_misses 1.0" in metrics
    assert f"snapkv_rag_prefix_cache_tokens_saved {2.0 * cached_tokens}" in metrics
    assert "snapkv_rag_prefix_cache_entries 1.0" in metrics
    assert f"snapkv_rag_prefix_cache_bytes_used {float(cached.prefix_stats().bytes_used)}" in metrics


def _prefix(ids: list[int]) -> Prefix:
    layer = PrefixLayer(torch.zeros(1, 2, len(ids), 4), torch.zeros(1, 2, len(ids), 4), torch.zeros(1, 4, 1, 4))
    return Prefix(tuple(ids), (layer, None))


def test_a_prefix_larger_than_the_cache_is_not_kept(tiny_model, tokenizer, uncached):
    docs = filler_documents(6)
    small = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=12, prefix_cache_bytes=50_000)
    for question in QUESTIONS[:2]:
        result = small.generate(question, docs, snapkv=WINDOW_8)
        assert result.usage.cached_tokens == 0
        assert result.text == uncached.generate(question, docs, snapkv=WINDOW_8).text
    stats = small.prefix_stats()
    assert (stats.entries, stats.stored, stats.misses) == (0, 0, 2)


NOT_CACHED = (
    set() if tails.ONE_PASS else {"qwen3-next", "nemotron-h", "falcon-h1", "zamba", "zamba2", "lfm2", "lfm2-moe"}
)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_is_reused_exactly_or_not_at_all(family, tokenizer, caplog):
    """Each supported family: a hit keeps the positions a whole prefill keeps (SnapKV with a window
    inside the question and one reaching into the cached instruction, the full cache), latent
    attention (DeepSeek-V3) included, and recurrent and hybrid models (their states at the prefix's
    end stored too) where transformers continues them in one pass; else prefilled whole, said in the log."""
    llm = SnapKVLLM(model=tiny_model(family, len(tokenizer)), tokenizer=tokenizer, max_new_tokens=4)
    docs = filler_documents(6)
    with caplog.at_level(logging.INFO, logger="snapkv_rag"):
        whole, split, at = _prefill_both(llm, QUESTIONS[1], docs, {"w8": WINDOW_8, "w48": WINDOW_48, "full": None})
    if family in NOT_CACHED:
        assert split.cached_tokens == 0 and unsupported(llm.runner.specs) is not None
        assert any("prefix cache not used" in r.message for r in caplog.records)
    else:
        assert split.cached_tokens == at
    for name, per_row in whole.compressed.items():
        for layer, positions in per_row[0].kept_positions().items():
            assert swapped(positions, split.compressed[name][0].kept_positions()[layer]) <= 1, (name, layer)
    assert torch.allclose(whole.logits, split.logits, atol=1e-4)


def swapped(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many kept positions of one layer (``[B, H, n]``) one selection has and the other has not.
    The split prefill sums in another order: where two positions' pooled votes tie to the last float
    bits (one head of Zamba's shared block, with its slow SSM decay), the rounding may pick the other,
    so at most one swap is allowed; any real difference moves many."""
    assert a.shape == b.shape
    return sum(len(set(x.tolist()) - set(y.tolist())) for x, y in zip(a.flatten(0, 1), b.flatten(0, 1)))


@pytest.mark.skipif(not tails.ONE_PASS, reason="this transformers is not known to continue a state in one pass")
@pytest.mark.parametrize("family", ["lfm2", "zamba2"])
def test_models_with_recurrent_layers_hit_with_their_stored_states(family, tokenizer):
    """A hybrid model's prefix is stored with the states at its end (the first request runs it in
    two passes, counted as no cached tokens); later questions start from copies of those states and
    answer as without the cache, and the stored states never change."""
    model = tiny_model(family, len(tokenizer))
    cached = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=8)
    plain = SnapKVLLM(model=model, tokenizer=tokenizer, max_new_tokens=8, prefix_cache_bytes=0)
    docs = filler_documents(6)
    got = [cached.generate(q, docs, snapkv=WINDOW_8, ignore_eos=True) for q in QUESTIONS]
    want = [plain.generate(q, docs, snapkv=WINDOW_8, ignore_eos=True) for q in QUESTIONS]
    assert [r.raw_text for r in got] == [r.raw_text for r in want]
    assert [r.compression.kept_tokens for r in got] == [r.compression.kept_tokens for r in want]
    assert got[0].usage.cached_tokens == 0 and all(r.usage.cached_tokens > 300 for r in got[1:])
    (entry,) = cached.prefix_cache._entries.values()
    states = [t for state in entry.states if state is not None for t in state.conv_states.values() if t is not None]
    before = [t.clone() for t in states]
    cached.generate(QUESTIONS[0], docs, snapkv=WINDOW_8, max_new_tokens=2)
    assert states and all(torch.equal(a, b) for a, b in zip(before, states))


def test_compare_shares_the_cache(cached, uncached):
    """``compare`` (the evals' path: one prefill, several methods) reuses a prefix too, with the
    same results and kept positions."""
    docs = filler_documents(6)
    methods = {"full": None, "w8": WINDOW_8, "w48": WINDOW_48}
    for i, question in enumerate(QUESTIONS):
        a = uncached.compare(question, docs, methods=methods)
        b = cached.compare(question, docs, methods=methods)
        for name in methods:
            ra, rb = a.results[name], b.results[name]
            assert (rb.text, rb.compression.kept_tokens) == (ra.text, ra.compression.kept_tokens)
            assert (rb.usage.cached_tokens > 0) == (i > 0) and ra.usage.cached_tokens == 0
        assert a.hit_rate == b.hit_rate
    assert cached.prefix_stats().hits == 2
