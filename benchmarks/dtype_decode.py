"""CPU: bfloat16 against float32 on the embedded model, in one run, and the cause of bfloat16's
slow full-cache decode: torch's SDPA kernel for one decode query, timed alone in both dtypes.

For each prompt size, two engines over the same weights answer the same prompt through
``compare`` (one prefill shared by the full cache and SnapKV@256), in alternating order. Printed:
prefill and decode ms/token of each and their ratio, whether the answers are the same, and the
time of ``scaled_dot_product_attention`` for one query over the prompt's keys (the model's heads)
in bfloat16 over float32.

    python benchmarks/dtype_decode.py --sizes 2048 --rounds 2 --out benchmarks/results/dtype_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from rag_prompts import build_prompt  # noqa: E402


def run(llm, prompt, max_new_tokens: int) -> dict:
    from snapkv_rag import SnapKVConfig

    comparison = llm.compare(
        prompt.question,
        prompt.documents,
        hit_rate=False,
        max_new_tokens=max_new_tokens,
        methods={"full": None, "snapkv@256": SnapKVConfig(max_capacity_prompt=256)},
        stop=[],
    )
    return {
        "prefill_s": comparison.prefill_s,
        **{f"{name} ms/token": r.timings.decode_ms_per_token for name, r in comparison.results.items()},
        "texts": {name: r.text for name, r in comparison.results.items()},
    }


def sdpa_ms(config, length: int, dtype: torch.dtype, repeats: int = 50) -> float:
    """ms of one decode query's attention over ``length`` keys with the model's head layout."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q = torch.randn(1, heads, 1, dim, dtype=dtype)
    k, v = torch.randn(1, kv_heads, length, dim, dtype=dtype), torch.randn(1, kv_heads, length, dim, dtype=dtype)
    attend = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    for _ in range(5):
        attend()
    begin = time.perf_counter()
    for _ in range(repeats):
        attend()
    return 1000 * (time.perf_counter() - begin) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from snapkv_rag import SnapKVLLM
    from snapkv_rag.models import loading

    fp32 = SnapKVLLM(dtype="float32")
    bf16 = SnapKVLLM(model=loading.load(None, device="cpu", dtype="bfloat16").model, tokenizer=fp32.tokenizer)
    variants = {"float32": fp32, "bfloat16": bf16}
    report = {
        "benchmark": "dtype_decode",
        "torch": torch.__version__,
        "cpu": platform.processor(),
        "native_bfloat16": loading.cpu_has_native_bfloat16(),
        "threads": torch.get_num_threads(),
        "rows": [],
    }
    for size in args.sizes:
        prompt = build_prompt(fp32.tokenizer, size)
        for llm in variants.values():  # untimed: first-use costs
            run(llm, build_prompt(fp32.tokenizer, 300), 2)
        runs = {name: [] for name in variants}
        for round_ in range(args.rounds):
            order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
            for name in order:
                runs[name].append(run(variants[name], prompt, args.max_new_tokens))
        row = {"size": size, "prompt_tokens": fp32.prompt_tokens(prompt.question, prompt.documents), "variants": {}}
        for name, results in runs.items():
            row["variants"][name] = {
                key: statistics.median(r[key] for r in results) for key in results[0] if key != "texts"
            }
            row["variants"][name]["texts"] = results[0]["texts"]
        kernel = {
            str(d).removeprefix("torch."): sdpa_ms(fp32.model.config, row["prompt_tokens"], d)
            for d in (torch.float32, torch.bfloat16)
        }
        row["sdpa_one_query_ms"] = kernel
        base = row["variants"]["float32"]
        print(f"{row['prompt_tokens']} tokens (native bfloat16: {report['native_bfloat16']}):")
        for name, v in row["variants"].items():
            same = all(v["texts"][m] == base["texts"][m] for m in base["texts"])
            print(
                f"  {name:28s} prefill {v['prefill_s']:.2f} s ({v['prefill_s'] / base['prefill_s']:.2f}x fp32), "
                + ", ".join(
                    f"{m} {v[f'{m} ms/token']:.1f} ms/token ({v[f'{m} ms/token'] / base[f'{m} ms/token']:.2f}x fp32)"
                    for m in base["texts"]
                )
                + f", same answers as fp32: {same}"
            )
        print(
            f"  torch SDPA, one decode query over {row['prompt_tokens']} keys: float32 {kernel['float32']:.3f} ms, "
            f"bfloat16 {kernel['bfloat16']:.3f} ms ({kernel['bfloat16'] / kernel['float32']:.1f}x)"
        )
        report["rows"].append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
