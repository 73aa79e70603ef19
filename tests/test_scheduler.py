"""Continuous batching: requests join and leave one running decode batch, each keeping its own
settings, and get exactly the tokens they get alone."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from snapkv_testing import filler_documents

from snapkv_rag import SnapKVConfig, SnapKVLLM, StreamingLLMConfig

QUESTIONS = [
    f"Which {topic} lies north of number {i}?" for i, topic in enumerate(["river", "castle", "market", "orchard"] * 4)
]
# unequal prompts (2..9 documents) and budgets, the full cache among them
CONFIGS = [
    SnapKVConfig(max_capacity_prompt=64, window_size=8),
    False,
    SnapKVConfig(max_capacity_prompt=200),
    StreamingLLMConfig(max_capacity_prompt=96),
    SnapKVConfig(ratio=0.5, min_capacity_prompt=16, window_size=8),
]


def workload():
    return [
        dict(
            question=q,
            documents=filler_documents(2 + (i * 3) % 8),
            snapkv=CONFIGS[i % len(CONFIGS)],
            max_new_tokens=4 + i % 7,
        )
        for i, q in enumerate(QUESTIONS)
    ]


@pytest.fixture()
def batched(tiny_model, tokenizer):
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=12, max_batch=16)
    yield llm
    llm.scheduler.close()


def alone(llm, args):
    return llm.generate(
        args["question"], args["documents"], snapkv=args["snapkv"], max_new_tokens=args["max_new_tokens"]
    )


def test_sixteen_concurrent_requests_decode_together_and_get_their_lone_tokens(batched):
    expected = [alone(batched, args) for args in workload()]
    barrier = threading.Barrier(16)

    def call(args):
        barrier.wait()
        return alone(batched, args)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(call, workload()))
    assert [r.text for r in got] == [r.text for r in expected]
    assert [r.usage.completion_tokens for r in got] == [r.usage.completion_tokens for r in expected]
    assert [r.compression.kept_tokens for r in got] == [r.compression.kept_tokens for r in expected]
    assert max(r.timings.batch_size for r in got) >= 4  # they really shared decode steps
    assert all(r.timings.batch_size == 1 for r in expected)


def test_each_row_keeps_its_own_sampling_seed_stop_and_length(batched):
    docs = filler_documents(3)
    specs = [
        dict(temperature=0.9, seed=7, max_new_tokens=9),
        dict(temperature=0.0, max_new_tokens=5),
        dict(temperature=1.2, top_p=0.8, seed=11, max_new_tokens=7),
        dict(max_new_tokens=10, ignore_eos=True),
    ]
    expected = [batched.generate("What lies north?", docs, **spec) for spec in specs]
    text = expected[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3] if len(text) > 6 else None
    if stop and stop.strip():
        specs.append(dict(temperature=0.9, seed=7, max_new_tokens=9, stop=[stop]))
        expected.append(batched.generate("What lies north?", docs, **specs[-1]))
        assert stop not in expected[-1].text and expected[-1].finish_reason == "stop"
    with ThreadPoolExecutor(len(specs)) as pool:
        got = list(pool.map(lambda spec: batched.generate("What lies north?", docs, **spec), specs))
    assert [r.text for r in got] == [r.text for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert got[3].usage.completion_tokens == 10 and got[3].finish_reason == "length"  # ignore_eos


async def test_asyncio_callers_batch_on_one_event_loop(batched):
    args = workload()[:8]
    expected = [alone(batched, a).text for a in args]
    results = await asyncio.gather(
        *(
            batched.agenerate(a["question"], a["documents"], snapkv=a["snapkv"], max_new_tokens=a["max_new_tokens"])
            for a in args
        )
    )
    assert [r.text for r in results] == expected
    assert max(r.timings.batch_size for r in results) > 1


def test_max_batch_bounds_the_running_batch_and_the_rest_wait_in_order(tiny_model, tokenizer):
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=6, max_batch=2)
    seen = []

    def record(*_):  # at every forward pass: what runs and what waits, on a fast machine or a slow one
        if not seen:  # the first prefill waits for the other five requests to queue behind it
            deadline = time.monotonic() + 60
            while llm.stats().queued < 5 and time.monotonic() < deadline:
                time.sleep(0.001)
        stats = llm.stats()
        seen.append((stats.running, stats.queued))

    hook = tiny_model.register_forward_pre_hook(record)
    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda a: alone(llm, a), workload()[:6]))
        assert max(r for r, _ in seen) == 2 and max(q for _, q in seen) >= 1
        assert all(r.timings.batch_size <= 2 for r in results)
        assert llm.stats().finished == 6 and llm.stats().running == 0
    finally:
        hook.remove()
        llm.close()


def test_a_stream_closed_early_frees_its_batch_slot(batched):
    """Both streams ask for more tokens than any machine decodes in the seconds this test takes, so
    each is still running until it is closed, however fast the machine is."""
    docs = filler_documents(4)
    first = batched.stream("What lies north?", docs, max_new_tokens=6000, ignore_eos=True)
    next(first)
    second = batched.stream("Which river?", docs, max_new_tokens=6000, ignore_eos=True)
    next(second)
    deadline = time.monotonic() + 30
    while batched.stats().running < 2 and time.monotonic() < deadline:  # its row joins after its first token
        time.sleep(0.005)
    assert batched.stats().running == 2
    first.close()
    while batched.stats().running > 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert batched.stats().running == 1  # the closed stream left; the other goes on
    second.close()
    while batched.stats().running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert batched.stats().running == 0


def test_max_batch_is_checked(tiny_model, tokenizer):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_batch"):
            SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_batch=bad)
    with pytest.raises(ValueError, match="max_kv_bytes"):
        SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_kv_bytes=0)


def test_a_kv_memory_limit_queues_requests_but_answers_them_all(tiny_model, tokenizer):
    args = workload()[:6]
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_batch=16, max_kv_bytes=1)
    try:
        expected = [alone(llm, a).text for a in args]
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda a: alone(llm, a), args))
        assert [r.text for r in results] == expected
        assert all(r.timings.batch_size == 1 for r in results)  # 1 byte: never two at once
    finally:
        llm.close()


def test_closing_the_engine_ends_waiting_requests_with_an_error(tiny_model, tokenizer):
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_batch=1)
    docs = filler_documents(3)
    first = llm.stream("What lies north?", docs, max_new_tokens=400, ignore_eos=True)
    second = llm.stream("Which river?", docs, max_new_tokens=5)
    next(first)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(second)
    assert llm.generate("Which river?", docs, max_new_tokens=3).usage.completion_tokens <= 3  # usable again


def test_compare_together_decodes_the_methods_as_rows_of_one_batch(batched):
    docs = filler_documents(4)
    methods = {"full": None, "snapkv": CONFIGS[0], "streaming": CONFIGS[3]}
    both = batched.compare("What lies north?", docs, methods=methods, together=True, max_new_tokens=8)
    for name, config in methods.items():
        alone = batched.generate("What lies north?", docs, snapkv=config, max_new_tokens=8)
        assert both.results[name].text == alone.text, name
        assert both.results[name].timings.batch_size == len(methods), name
    assert set(both.hit_rate) == {"snapkv", "streaming"}
