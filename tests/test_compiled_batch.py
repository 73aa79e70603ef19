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
    """Wrap the runner's decode step: the (batch bucket, rows allocated, capacity, view length) of
    every step (one compiled graph each at most), and its operators."""
    counter, buckets, step = OpCounter(), set(), llm.runner.decode_step

    def watched(slots, b, *args):
        buckets.add((b, slots.rows, slots.capacity, slots.view_length(b)))
        if not count_ops:
            return step(slots, b, *args)
        with counter:
            return step(slots, b, *args)

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
    assert {b for b, _, _, _ in buckets} <= {1, 2, 4}
    # each step read its rows' slots in use, not the whole allocation
    assert all(length <= capacity for _, _, capacity, length in buckets)
    assert any(length < capacity for _, _, capacity, length in buckets)


def test_an_eager_decode_step_never_waits_for_the_device(tiny_model, tokenizer):
    """No ``.item()`` / ``nonzero`` (host syncs) inside a step: its one host copy is after it. (The
    compiled step is one graph, ``fullgraph=True``: a host sync would be a graph break, an error.)"""
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_batch=4)
    counter, _ = watch_steps(llm, count_ops=True)
    try:
        run_together(llm, workload(4))
    finally:
        llm.close()
    assert counter.ops["index_put_"] > 0  # the counter saw the steps' own operators
    assert {op: counter.ops[op] for op in SYNCS} == {op: 0 for op in SYNCS}


def assert_compiled_answers_as_eager(tiny_model, tokenizer, plain, args: list[dict], decode_attention="sdpa"):
    """``args`` answered alone by the eager engine and together by a compiled one: the same texts,
    and the step compiled (no fallback to eager)."""
    alone = [plain.generate(a["question"], **{k: v for k, v in a.items() if k != "question"}) for a in args]
    compiled = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, compile=True, max_batch=4)
    compiled.runner.decode_attention = decode_attention
    torch._dynamo.reset()
    try:
        got = run_together(compiled, args)
    finally:
        compiled.close()
    assert compiled.runner.fallback is None
    assert [r.text for r in got] == [r.text for r in alone]


def test_sampled_rows_pick_inside_the_compiled_step_as_eager_ones_do(tiny_model, tokenizer, plain):
    """Temperature and top-p rows are sampled inside the compiled step: each seeded request gets the
    tokens it gets from the eager engine, alone or beside greedy rows."""
    args = [
        dict(a, temperature=t, top_p=p, seed=7 + i)
        for i, (a, (t, p)) in enumerate(zip(workload(4), [(0.9, 1.0), (0.0, 1.0), (0.8, 0.7), (1.2, 0.9)]))
    ]
    assert_compiled_answers_as_eager(tiny_model, tokenizer, plain, args)


def test_the_split_decode_attention_answers_as_torch_attention_does(tiny_model, tokenizer, plain):
    """``decode_attention="split"`` (plain ops that inductor fuses into split reductions over the
    slots): the same answers as the eager engine, rows of unequal lengths in one batch."""
    assert_compiled_answers_as_eager(tiny_model, tokenizer, plain, workload(4), decode_attention="split")
