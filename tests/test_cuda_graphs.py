"""The CUDA-graph decode step (``compile=True`` on CUDA: the inductor-compiled step captured;
``compile="eager-graph"``: the eager step captured): requests joining and leaving a captured
batch, greedy and sampled, get the tokens of the eager step (the compiled one in float32; in
bfloat16 inductor's fused arithmetic rounds differently, so most, not all, answers match), and the slot cache growing (a longer prompt after shorter
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
            temperature=0.8 if i % 4 == 3 else 0.0,  # sampled inside the captured step
            seed=i,
        )
        for i in range(count)
    ]


def _together(llm: SnapKVLLM, args: list[dict]) -> list:
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(lambda a: llm.generate(a.pop("question"), **a), [dict(a) for a in args]))


def _same(got: list, expected: list, exact: bool) -> None:
    same = sum(g.raw_text == e.raw_text for g, e in zip(got, expected))
    assert same == len(expected) if exact else same >= 0.75 * len(expected), (same, len(expected))


@pytest.mark.parametrize("mode", [True, "eager-graph"], ids=["compiled", "eager_graph"])
def test_requests_joining_a_cuda_graph_batch_get_the_eager_tokens(tiny_model, tokenizer, mode):
    exact = mode == "eager-graph" or next(tiny_model.parameters()).dtype == torch.float32
    args = _workload(12)
    eager = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_batch=4)
    alone = [eager.generate(a["question"], **{k: v for k, v in a.items() if k != "question"}) for a in args]
    graph = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, compile=mode, max_batch=4)
    try:
        got = _together(graph, args)
        assert graph.runner.fallback is None  # compiled, not fallen back to the eager capture
        _same(got, alone, exact)
        assert max(r.timings.batch_size for r in got) > 1  # rows did decode together
        # a longer prompt than any before: the kept buffers grow, the graphs are captured again
        longer = dict(documents=filler_documents(12), snapkv=False, max_new_tokens=6, ignore_eos=True)
        grown = graph.generate("Which harbour?", **longer)
        assert grown.usage.completion_tokens == 6
        if exact:
            assert grown.raw_text == eager.generate("Which harbour?", **longer).raw_text
        _same(_together(graph, args[:4]), alone[:4], exact)
    finally:
        graph.close()
        eager.close()
