"""CPU decode speed and memory: full cache vs SnapKV, on real RAG prompts of 2K, 4K and 8K tokens.

For each prompt size, ONE ``SnapKVLLM.compare`` call prefills the prompt once and decodes it with
the full cache and with SnapKV at each budget, so the decode ms/token of the methods come from the
same process, prompt and minute: the figure that matters is their ratio. Then, unless
``--no-memory``, each (size, method) answers once more in a short subprocess (``peak_memory.py``)
that reports its peak RSS above the loaded model. Selection share = the time SnapKV's selection
takes / the prefill time it belongs to.

    python benchmarks/cpu_decode.py --out benchmarks/results/cpu_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peak_memory  # noqa: E402
from rag_prompts import build_prompt  # noqa: E402

QUICK_SIZES = [400]
QUICK_BUDGETS = [128]


def method_name(budget: int) -> str:
    return f"snapkv@{budget}"


def decode_speeds(llm, sizes: list[int], budgets: list[int], max_new_tokens: int) -> list[dict]:
    """One shared-prefill comparison per size; speedups are full ms/token over SnapKV ms/token."""
    from snapkv_rag import SnapKVConfig

    warm = build_prompt(llm.tokenizer, min(sizes))  # first forward pays one-time costs: not in a figure
    llm.generate(warm.question, warm.documents, max_new_tokens=4, snapkv=False)
    rows = []
    for size in sizes:
        prompt = build_prompt(llm.tokenizer, size)
        methods = {"full": None, **{method_name(b): SnapKVConfig(max_capacity_prompt=b) for b in budgets}}
        comparison = llm.compare(
            prompt.question, prompt.documents, methods=methods, hit_rate=False, max_new_tokens=max_new_tokens
        )
        full = comparison.results["full"]
        prefill_ms = 1000 * comparison.prefill_s
        selection = {name: comparison.results[name].compression.selection_ms for name in methods if name != "full"}
        row = {
            "size": size,
            "prompt_tokens": full.usage.prompt_tokens,
            "prefill_s": comparison.prefill_s,
            "methods": {},
        }
        for name, result in comparison.results.items():
            entry = {
                "decode_ms_per_token": result.timings.decode_ms_per_token,
                "completion_tokens": result.usage.completion_tokens,
                "text": result.text,
                "kv_bytes_full": result.compression.kv_bytes_full,
                "kv_bytes_kept": result.compression.kv_bytes_kept,
                "kept_tokens_max": max(result.compression.kept_tokens),
                "same_answer_as_full": result.text == full.text,
            }
            if name != "full":
                # compare()'s prefill also ran the other budgets' selections: take them out
                own_prefill_ms = prefill_ms - sum(ms for other, ms in selection.items() if other != name)
                entry["selection_ms"] = selection[name]
                entry["selection_share_of_prefill"] = selection[name] / own_prefill_ms
                entry["speedup_vs_full"] = full.timings.decode_ms_per_token / result.timings.decode_ms_per_token
            row["methods"][name] = entry
        rows.append(row)
        print(
            f"  {size}: "
            + ", ".join(f"{n} {e['decode_ms_per_token']:.1f} ms/token" for n, e in row["methods"].items()),
            flush=True,
        )
    return rows


def table(rows: list[dict], budgets: list[int]) -> str:
    head = ["prompt tokens", "full ms/token"]
    for b in budgets:
        head += [f"SnapKV@{b} ms/token", f"speedup @{b}", f"selection share @{b}"]
    has_memory = any("peak_rss_delta_mib" in m for r in rows for m in r["methods"].values())
    if has_memory:
        head += ["peak MiB full"] + [
            f"peak MiB @{b}" for b in budgets if any("peak_rss_delta_mib" in r["methods"][method_name(b)] for r in rows)
        ]
    head += ["KV MiB full"] + [f"KV MiB @{b}" for b in budgets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        m = row["methods"]
        cells = [str(row["prompt_tokens"]), f"{m['full']['decode_ms_per_token']:.1f}"]
        for b in budgets:
            e = m[method_name(b)]
            cells += [
                f"{e['decode_ms_per_token']:.1f}",
                f"{e['speedup_vs_full']:.2f}x",
                f"{100 * e['selection_share_of_prefill']:.2f}%",
            ]
        if has_memory:
            cells += [_mib(m["full"].get("peak_rss_delta_mib"))]
            cells += [
                _mib(m[method_name(b)]["peak_rss_delta_mib"])
                for b in budgets
                if any("peak_rss_delta_mib" in r["methods"][method_name(b)] for r in rows)
            ]
        cells += [f"{m['full']['kv_bytes_kept'] / 2**20:.0f}"]
        cells += [f"{m[method_name(b)]['kv_bytes_kept'] / 2**20:.0f}" for b in budgets]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder/GGUF/hub id (default: the embedded model)")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[2048, 4096, 8000],
        help="prompt lengths in tokens (default: 2048 4096 8000)",
    )
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[1024, 256],
        help="SnapKV max_capacity_prompt values, each compared with the full cache (default: 1024 256)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--no-memory", action="store_true", help="skip the per-method peak-memory subprocesses")
    parser.add_argument(
        "--memory-budgets",
        type=int,
        nargs="*",
        default=None,
        help="budgets whose peak memory is measured besides the full cache (default: the first budget)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 is steadier on a machine others share",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"a smoke test: sizes {QUICK_SIZES}, budget {QUICK_BUDGETS}, 4 new tokens"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "cpu_decode.json", help="JSON to write")
    args = parser.parse_args()
    sizes, budgets, max_new = args.sizes, args.budgets, args.max_new_tokens
    if args.quick:
        sizes, budgets, max_new = QUICK_SIZES, QUICK_BUDGETS, 4

    from snapkv_rag import SnapKVLLM

    if args.threads:
        torch.set_num_threads(args.threads)
    memory_budgets = budgets[:1] if args.memory_budgets is None else args.memory_budgets
    started = time.time()
    llm = SnapKVLLM(args.model)
    print(f"decode speed ({llm.model_name}, {torch.get_num_threads()} threads):", flush=True)
    rows = decode_speeds(llm, sizes, budgets, max_new)
    model_name = llm.model_name
    del llm
    if not args.no_memory:
        print("peak memory (one subprocess per size and method):", flush=True)
        for row in rows:
            for budget in [0] + memory_budgets:
                probe = peak_memory.probe(args.model, row["size"], budget, max_new, args.threads)
                name = "full" if budget == 0 else method_name(budget)
                row["methods"][name]["peak_rss_delta_mib"] = probe["peak_rss_delta_mib"]
                row["methods"][name]["peak_memory_probe"] = probe
                print(f"  {row['size']} {name}: {_mib(probe['peak_rss_delta_mib'])} MiB", flush=True)
    report = {
        "benchmark": "cpu_decode",
        "model": model_name,
        "sizes": sizes,
        "budgets": budgets,
        "max_new_tokens": max_new,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "command": "python benchmarks/cpu_decode.py " + " ".join(sys.argv[1:]),
        "wall_s": time.time() - started,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(rows, budgets))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
