"""CPU, embedded model: decode speed with quantized weights against float32, in one run.

Engines over the same weights (``quantize_model`` as ``SnapKVLLM(quantize=...)`` applies it:
float32, int8, int4; and each scheme with the other choice for the output head; the unquantized
model in bfloat16, for scale, and int8 on it) answer the same RAG prompts, batch 1 (one request) and batch 8 (eight
concurrent requests through the scheduler), in rotating order over ``--rounds`` rounds; each
reports decode ms/token (its results' ``timings``). Printed per batch size: tokens/s of each and
its ratio to float32, the prefill time and its ratio to float32's, the weight bytes a step reads,
and how many of the answers equal float32's (greedy, ``ignore_eos`` off). ``int4-kernel-prefill``
and ``int8-kernel-prefill`` are int4 and int8 with every prefill token through their kernel, as
before prefill chunks got a dense matmul: the comparison that change is measured by.

    python benchmarks/quantized.py --out benchmarks/results/quantized.json
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

VARIANTS = {  # name: (dtype the model loads in, quantize scheme)
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "int8-float-head": ("float32", "int8"),
    "int8-kernel-prefill": ("float32", "int8"),  # int8 before prefill chunks got a dense matmul
    "bfloat16-int8": ("bfloat16", "int8"),  # int8 weights on the model loaded in bfloat16
    "int4": ("float32", "int4"),
    "int4+head": ("float32", "int4"),
    "int4-kernel-prefill": ("float32", "int4"),  # int4 before prefill chunks got a dense matmul
}


def engines(names: list[str]) -> dict:
    """One engine per variant, each over its own copy of the embedded model (quantized in place)."""
    from snapkv_rag import SnapKVLLM
    from snapkv_rag.models import loading
    from snapkv_rag.models import quantize as quantizing

    out = {}
    for name in names:
        dtype, scheme = VARIANTS[name]
        model = loading.load(None, device="cpu", dtype=dtype)
        if scheme:
            head = True if name.endswith("+head") else False if name.endswith("-float-head") else None
            quantizing.quantize_model(model.model, scheme, head=head)
        if name.endswith("-kernel-prefill"):  # every token through the int4/int8 kernel, as it once was
            for layer in model.model.modules():
                if isinstance(layer, quantizing.Int4Linear):
                    layer.unpacks = False
                elif isinstance(layer, quantizing.Int8Linear):
                    layer.dense_prefill = False
        out[name] = SnapKVLLM(model=model.model, tokenizer=model.tokenizer, prefix_cache_bytes=0)
    return out


def decode(llm, prompts: list, tokens: int) -> dict:
    """``len(prompts)`` concurrent requests of ``tokens`` new tokens (SnapKV keeping 512 tokens):
    the mean decode ms/token and the answers."""
    from snapkv_rag import SnapKVConfig

    results = llm.generate_batch(
        [p.question for p in prompts],
        [p.documents for p in prompts],
        batch_size=len(prompts),
        max_new_tokens=tokens,
        snapkv=SnapKVConfig(max_capacity_prompt=512),
        stop=[],
    )
    return {
        "ms_per_token": statistics.mean(r.timings.decode_ms_per_token for r in results),
        "prefill_s": statistics.mean(r.timings.prefill_s for r in results),
        "texts": [r.text for r in results],
    }


def measure(variants: dict, prompts: list, rounds: int, tokens: int) -> dict:
    """Rotating order each round; per variant the median ms/token and the first round's answers."""
    names = list(variants)
    runs: dict[str, list] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(decode(variants[name], prompts, tokens))
    base = runs["float32"][0]["texts"]
    row = {}
    for name, done in runs.items():
        ms = statistics.median(r["ms_per_token"] for r in done)
        row[name] = {
            "ms_per_token": ms,
            "tokens_per_s": 1000 * len(prompts) / ms,
            "prefill_s": statistics.median(r["prefill_s"] for r in done),
            "same_answers_as_float32": sum(a == b for a, b in zip(done[0]["texts"], base)),
            "answers": len(base),
        }
    for name, cell in row.items():
        cell["speedup_vs_float32"] = cell["tokens_per_s"] / row["float32"]["tokens_per_s"]
        # each round's own ratio (the variants of a round ran minutes apart at most): the spread
        cell["speedup_by_round"] = [
            ref["ms_per_token"] / own["ms_per_token"] for ref, own in zip(runs["float32"], runs[name])
        ]
        cell["prefill_vs_float32"] = cell["prefill_s"] / row["float32"]["prefill_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if "float32" not in args.variants:
        parser.error("--variants: float32 is the baseline every ratio is to; keep it")
    if args.threads:
        torch.set_num_threads(args.threads)
    from snapkv_rag.models import quantize as quantizing

    variants = engines(args.variants)
    report = {
        "benchmark": "quantized",
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "weight_bytes": {name: quantizing.weight_bytes(llm.model) for name, llm in variants.items()},
        "batches": {},
    }
    tokenizer = variants["float32"].tokenizer
    for llm in variants.values():  # untimed: first-use costs
        decode(llm, [build_prompt(tokenizer, 300)], 2)
    for batch in args.batches:
        prompts = [build_prompt(tokenizer, args.prompt_tokens, index=i) for i in range(batch)]
        begin = time.perf_counter()
        row = measure(variants, prompts, args.rounds, args.max_new_tokens)
        report["batches"][str(batch)] = row
        print(f"batch {batch} ({args.prompt_tokens}-token prompts, {time.perf_counter() - begin:.0f} s):")
        for name, cell in row.items():
            print(
                f"  {name:10s} {cell['ms_per_token']:7.1f} ms/step {cell['tokens_per_s']:7.1f} tokens/s "
                f"({cell['speedup_vs_float32']:.2f}x float32; rounds {min(cell['speedup_by_round']):.2f}-"
                f"{max(cell['speedup_by_round']):.2f}x), prefill {cell['prefill_s']:.2f} s "
                f"({cell['prefill_vs_float32']:.2f}x float32's time), weights {report['weight_bytes'][name] / 2**20:.0f} MiB, "
                f"same answers as float32 {cell['same_answers_as_float32']}/{cell['answers']}"
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
