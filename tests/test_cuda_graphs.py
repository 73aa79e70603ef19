"""The CUDA-graph decode step (``compile=True`` on CUDA): requests joining and leaving a captured
batch get the tokens of the eager step, and the slot cache growing (a longer prompt after shorter
ones: new buffers, new captures) keeps working. Run by the standing GPU check
(``benchmarks/gpu_check.py``, ``SNAPKV_TEST_DEVICE=cuda``); there is no CUDA graph on a CPU."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from snapkv_testing import filler_documents

from snapkv_rag import SnapKVConfig, SnapKVLLM, StreamingLLMConfig

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and os.environ.get("SNAPKV_TEST_DEVICE", "").startswith("cuda")),
    reason="CUDA graphs need a CUDA device (the GPU check runs this file with SNAPKV_TEST_DEVICE=cuda)",
)
CONFIGS = [SnapKVConfig(max_capacity_prompt=64, window_size=8), StreamingLLMConfig(max_capacity_prompt=96), None]


def _workload(count: int) -> list[dict]:
    return [
        dict(
            question=f"Which castle lies north of number {i}?",
            documents=filler_documents(1 + i % 4),
            snapkv=CONFIGS[i % 3] or False,
            max_new_tokens=3 + i % 5,
            ignore_eos=True,
        )
        for i in range(count)
    ]


def _together(llm: SnapKVLLM, args: list[dict]) -> list:
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(lambda a: llm.generate(a.pop("question"), **a), [dict(a) for a in args]))


def test_requests_joining_a_cuda_graph_batch_get_the_eager_tokens(tiny_model, tokenizer):
    args = _workload(12)
    eager = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_batch=4)
    alone = [eager.generate(a["question"], **{k: v for k, v in a.items() if k != "question"}) for a in args]
    graph = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, compile=True, max_batch=4)
    try:
        got = _together(graph, args)
        assert [r.raw_text for r in got] == [r.raw_text for r in alone]
        assert max(r.timings.batch_size for r in got) > 1  # rows did decode together
        # a longer prompt than any before: the kept buffers grow, the graphs are captured again
        longer = dict(documents=filler_documents(12), snapkv=False, max_new_tokens=6, ignore_eos=True)
        assert (
            graph.generate("Which harbour?", **longer).raw_text == eager.generate("Which harbour?", **longer).raw_text
        )
        assert [r.raw_text for r in _together(graph, args[:4])] == [r.raw_text for r in alone[:4]]
    finally:
        graph.close()
        eager.close()
