"""Decode speed of the compiled fixed-size-cache step (``compile=True``) against the plain loop.

One engine per mode on the SAME loaded model. For each prompt size, each mode runs ``compare`` with
two methods (full cache = a budget above the prompt length, and SnapKV at ``--budget``): one
shared prefill, then both caches decode as rows of one batch through the scheduler. An untimed
compiled call first compiles each bucket; then the modes run plain, compiled, compiled, plain (so
drift on a shared machine hits both sides alike). Prints decode ms/token of each mode, the
plain/compiled ratio and whether the answers agree; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rag_prompts import build_prompt  # noqa: E402


def decode_once(engine, prompt, methods: dict, max_new_tokens: int):
    """One shared-prefill ``compare`` of ``methods`` with ``engine`` (plain or compiled), greedy."""
    return engine.compare(
        prompt.question, prompt.documents, methods=methods, hit_rate=False, max_new_tokens=max_new_tokens
    ).results


def measure(plain, compiled, size: int, budget: int, max_new_tokens: int) -> list[dict]:
    from snapkv_rag import SnapKVConfig

    prompt = build_prompt(plain.tokenizer, size)
    length = len(plain.request(prompt.question, prompt.documents).input_ids)
    methods = {
        "full": SnapKVConfig(max_capacity_prompt=length + 1),
        f"snapkv@{budget}": SnapKVConfig(max_capacity_prompt=budget),
    }
    order = ("plain", "compiled", "compiled", "plain")
    start = time.perf_counter()
    decode_once(compiled, prompt, methods, max_new_tokens)  # compiles each bucket, untimed
    print(f"  {length}: first compiled call (compiles) {time.perf_counter() - start:.0f} s", flush=True)
    runs = {name: {"plain": [], "compiled": []} for name in methods}
    texts = {name: set() for name in methods}
    for mode in order:
        results = decode_once(plain if mode == "plain" else compiled, prompt, methods, max_new_tokens)
        for name, result in results.items():
            runs[name][mode].append(result.timings.decode_ms_per_token)
            texts[name].add(result.text)
    rows = []
    for name, cfg in methods.items():
        plain_ms, compiled_ms = statistics.mean(runs[name]["plain"]), statistics.mean(runs[name]["compiled"])
        row = {
            "prompt_tokens": length,
            "method": name,
            "kept_tokens": min(length, cfg.max_capacity_prompt),
            "plain_ms_per_token": plain_ms,
            "compiled_ms_per_token": compiled_ms,
            "speedup": plain_ms / compiled_ms,
            "runs": runs[name],
            "answers_identical": len(texts[name]) == 1,
        }
        print(
            f"  {length} {name}: plain {plain_ms:.1f} ms/token, compiled {compiled_ms:.1f} ms/token, "
            f"{row['speedup']:.2f}x, answers identical: {row['answers_identical']}",
            flush=True,
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder/GGUF/hub id (default: the embedded model)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8000], help="prompt lengths in tokens")
    parser.add_argument("--budget", type=int, default=1024, help="SnapKV max_capacity_prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "compiled_decode.json", help="JSON to write")
    args = parser.parse_args()
    import torch

    from snapkv_rag import SnapKVLLM

    if args.threads:
        torch.set_num_threads(args.threads)
    plain = SnapKVLLM(args.model)
    compiled = SnapKVLLM(plain.model, tokenizer=plain.tokenizer, compile=True)
    rows = [row for size in args.sizes for row in measure(plain, compiled, size, args.budget, args.max_new_tokens)]
    print("| prompt tokens | method | plain ms/token | compiled ms/token | plain / compiled | same answer |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['prompt_tokens']} | {r['method']} | {r['plain_ms_per_token']:.1f} | "
            f"{r['compiled_ms_per_token']:.1f} | {r['speedup']:.2f}x | {'yes' if r['answers_identical'] else 'no'} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(["python", "benchmarks/compiled_decode.py", *sys.argv[1:]]),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
