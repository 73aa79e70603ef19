"""The measured saving of a shared prefill: one ``compare()`` over k methods against k separate
``generate()`` calls (one prefill each) on the same prompts, in one process, alternating."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .datasets import build
from .methods import MethodSpec, configs_for_cell
from .runner import prompt_tokens


def measure(
    llm: Any,
    specs: Sequence[MethodSpec],
    num_prompts: int,
    *,
    seed: int,
    max_new_tokens: int,
    stop: Sequence[str],
    num_docs: int = 10,
) -> dict:
    examples = build("nq", num_prompts, [num_docs], ["middle"], seed)
    mean_tokens = sum(prompt_tokens(llm, e) for e in examples) / len(examples)
    configs, _ = configs_for_cell(specs, mean_tokens)
    options = {"max_new_tokens": max_new_tokens, "stop": list(stop)}
    shared = separate = 0.0
    for e in examples:
        start = time.perf_counter()
        llm.compare(e.question, list(e.documents), methods=configs, hit_rate=False, **options)
        shared += time.perf_counter() - start
        start = time.perf_counter()
        for config in configs.values():
            llm.generate(e.question, list(e.documents), snapkv=config if config is not None else False, **options)
        separate += time.perf_counter() - start
    result = {
        "prompts": len(examples),
        "num_docs": num_docs,
        "mean_prompt_tokens": round(mean_tokens),
        "methods": list(configs),
        "shared_s": round(shared, 2),
        "separate_s": round(separate, 2),
        "saving_ratio": round(separate / shared, 2),
    }
    print(
        f"{len(examples)} NQ prompts (N={num_docs}, ~{mean_tokens:.0f} tokens), {len(configs)} methods "
        f"({', '.join(configs)}): one compare() per prompt took {shared:.1f} s in all, {len(configs)} generate() "
        f"calls per prompt took {separate:.1f} s in all: sharing the prefill is {separate / shared:.2f}x faster "
        f"(hit_rate off in both)."
    )
    return result
