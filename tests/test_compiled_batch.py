"""Requests joining and leaving a compiled decode batch (CPU, ``compile=True``): the tokens of each
request alone, no graph break, one compile per bucket, and no host sync inside a decode step."""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from snapkv_testing import filler_documents
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from snapkv_rag import SnapKVConfig, SnapKVLLM, StreamingLLMConfig

SYNCS = ("_local_scalar_dense", "nonzero", "item")
CONFIGS = [SnapKVConfig(max_capacity_prompt=64, window_size=8), StreamingLLMConfig(max_capacity_prompt=96)]


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active (here: inside decode steps)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def watch_steps(llm: SnapKVLLM, count_ops: bool) -> tuple[OpCounter, set]:
    """Wrap the runner's decode step: the (batch bucket, rows allocated, capacity) of every step (one
    compiled graph each at most), and its operators."""
    counter, buckets, step = OpCounter(), set(), llm.runner.decode_step

    def watched(slots, b, pick=None):
        buckets.add((b, slots.rows, slots.capacity))
        if not count_ops:
            return step(slots, b, pick)
        with counter:
            return step(slots, b, pick)

    llm.runner.decode_step = watched
    return counter, buckets


def workload(count: int) -> list[dict]:
    return [
        dict(
            question=f"Which castle lies north of number {i}?",
            documents=filler_documents(1 + i % 4),
            snapkv=CONFIGS[i % 2],
            max_new_tokens=3 + i % 5,
        )
        for i in range(count)
    ]


def run_together(llm: SnapKVLLM, args: list[dict]) -> list:
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(lambda a: llm.generate(a.pop("question"), **a), [dict(a) for a in args]))


@pytest.fixture()
def plain(tiny_model, tokenizer):
    return SnapKVLLM(model=tiny_model, tokenizer=tokenizer)


def test_sixteen_requests_join_and_leave_a_compiled_batch(tiny_model, tokenizer, plain):
    args = workload(16)
    alone = [
        plain.generate(a["question"], a["documents"], snapkv=a["snapkv"], max_new_tokens=a["max_new_tokens"])
        for a in args
    ]
    assert len({r.usage.prompt_tokens for r in alone}) >= 4  # unequal prompts
    compiled = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, compile=True, max_batch=4)
    _, buckets = watch_steps(compiled, count_ops=False)
    torch._dynamo.reset()
    counters.clear()
    try:
        got = run_together(compiled, args)
    finally:
        compiled.close()
    assert [r.usage.completion_tokens for r in got] == [r.usage.completion_tokens for r in alone]
    assert [r.text for r in got] == [r.text for r in alone]
    assert max(r.timings.batch_size for r in got) == 4  # rows left and others joined mid-run
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= len(buckets), (dict(counters["stats"]), buckets)
    assert {b for b, _, _ in buckets} <= {1, 2, 4}


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_decode_step_never_waits_for_the_device(tiny_model, tokenizer, compile):
    """No ``.item()`` / ``nonzero`` (host syncs) inside a step: its one host copy is after it."""
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, compile=compile, max_batch=4)
    counter, _ = watch_steps(llm, count_ops=True)
    try:
        run_together(llm, workload(4))
    finally:
        llm.close()
    assert counter.ops["index_put_"] > 0  # the counter saw the steps' own operators
    assert {op: counter.ops[op] for op in SYNCS} == {op: 0 for op in SYNCS}
