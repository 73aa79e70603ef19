"""Concurrent callers, faults and interrupted streams: nothing is lost, mixed or left locked."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from snapkv_testing import filler_documents

from snapkv_rag import GenerationOutOfMemoryError, SnapKVConfig

BUDGET = SnapKVConfig(max_capacity_prompt=64, window_size=8)
QUESTIONS = [
    f"Which {topic} lies north of number {i}?" for i, topic in enumerate(["river", "castle", "market", "orchard"] * 4)
]


def requests():
    return [(q, filler_documents(2 + i % 5)) for i, q in enumerate(QUESTIONS)]


def test_sixteen_threads_get_their_sequential_answers(tiny_engine):
    expected = [tiny_engine.generate(q, d, snapkv=BUDGET, max_new_tokens=6).text for q, d in requests()]
    barrier = threading.Barrier(16)

    def call(args):
        barrier.wait()  # all sixteen start together
        return tiny_engine.generate(*args, snapkv=BUDGET, max_new_tokens=6).text

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(call, requests())) == expected


def test_streams_interleaved_across_threads_do_not_mix(tiny_engine):
    expected = [tiny_engine.generate(q, d, max_new_tokens=6).text for q, d in requests()[:4]]
    streams = [tiny_engine.stream(q, d, max_new_tokens=6) for q, d in requests()[:4]]
    pieces = [[] for _ in streams]
    active = list(range(4))
    while active:  # round-robin: one piece from each open stream in turn
        for i in list(active):
            piece = next(streams[i], None)
            if piece is None:
                active.remove(i)
            else:
                pieces[i].append(piece)
    assert ["".join(p) for p in pieces] == expected


async def test_asyncio_tasks_get_their_sequential_answers_without_blocking_the_loop(tiny_engine, loop_watch):
    expected = [tiny_engine.generate(q, d, snapkv=BUDGET, max_new_tokens=6).text for q, d in requests()[:8]]
    async with loop_watch(tiny_engine.model) as watch:
        answers = await asyncio.gather(
            *(tiny_engine.agenerate(q, d, snapkv=BUDGET, max_new_tokens=6) for q, d in requests()[:8])
        )
    streamed = [piece async for piece in tiny_engine.astream(*requests()[0], snapkv=BUDGET, max_new_tokens=6)]
    assert [a.text for a in answers] == expected
    assert "".join(streamed) == expected[0]
    assert watch.loop_ran_during_forward


def raise_oom_on_call(model, call_number):
    """Make the model's n-th forward call fail as a GPU would when it runs out of memory."""
    calls = {"n": 0}

    def hook(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == call_number:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    return model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("phase,call_number", [("prefill", 1), ("decode", 3)])
def test_out_of_memory_names_prompt_and_budget_and_the_next_call_works(tiny_engine, phase, call_number):
    question, docs = requests()[3]
    before = tiny_engine.generate(question, docs, snapkv=BUDGET, max_new_tokens=6)
    handle = raise_oom_on_call(tiny_engine.model, call_number)
    try:
        with pytest.raises(GenerationOutOfMemoryError) as info:
            tiny_engine.generate(question, docs, snapkv=BUDGET, max_new_tokens=6)
    finally:
        handle.remove()
    assert f"prompt of {before.usage.prompt_tokens} tokens" in str(info.value)
    assert "budget 64" in str(info.value)
    assert tiny_engine.generate(question, docs, snapkv=BUDGET, max_new_tokens=6).text == before.text


def test_interrupted_and_abandoned_streams_leave_the_engine_usable(tiny_engine):
    question, docs = requests()[1]
    expected = tiny_engine.generate(question, docs, max_new_tokens=8).text
    with pytest.raises(KeyboardInterrupt):
        for _ in tiny_engine.stream(question, docs, max_new_tokens=8):
            raise KeyboardInterrupt
    abandoned = tiny_engine.stream(question, docs, max_new_tokens=8)
    next(abandoned)  # a consumer that stops reading and keeps the generator alive
    other = []
    worker = threading.Thread(target=lambda: other.append(tiny_engine.generate(question, docs, max_new_tokens=8)))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and other[0].text == expected
    assert tiny_engine.generate(question, docs, max_new_tokens=8).text == expected
    assert "".join(abandoned) != ""  # and the abandoned one can still be finished later
