"""What head-adaptive SnapKV (and lookahead SnapKV, head-adaptive too) hold against plain SnapKV at
the same budget, on real prompts.

Per NQ prompt (``--docs`` documents, gold in the middle) and share kept, one shared prefill
(``compare``) gives SnapKV's, Ada-SnapKV's and lookahead SnapKV's caches; printed per share: the K/V
bytes each ragged method holds over SnapKV's (its layers are padded to their largest head) and over
the full cache's, and how often each keeps the full cache's greedy answer (a small sample: a sign,
not a measurement of quality).

    python benchmarks/ada_bytes.py --prompts 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--docs", type=int, default=10)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--floor", type=float, default=0.2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    from evals.datasets import nq_examples
    from snapkv_rag import AdaSnapKVConfig, LookaheadSnapKVConfig, SnapKVConfig, SnapKVLLM

    llm = SnapKVLLM(prefix_cache_bytes=0)
    rows = {share: [] for share in args.shares}
    for example in nq_examples(args.prompts, [args.docs], ["middle"], 0):
        length = llm.prompt_tokens(example.question, example.documents)
        methods = {"full": None}
        for share in args.shares:
            budget = round(share * length)
            methods[f"snapkv@{share}"] = SnapKVConfig(max_capacity_prompt=budget)
            methods[f"ada@{share}"] = AdaSnapKVConfig(max_capacity_prompt=budget, floor=args.floor)
            methods[f"lookahead@{share}"] = LookaheadSnapKVConfig(max_capacity_prompt=budget, floor=args.floor)
        both = llm.compare(
            example.question,
            list(example.documents),
            methods=methods,
            hit_rate=False,
            max_new_tokens=args.max_new_tokens,
        )
        full = both.results["full"].text
        for share in args.shares:
            snap = both.results[f"snapkv@{share}"]
            cell = {"snap_same": snap.text == full}
            for name in ("ada", "lookahead"):
                result = both.results[f"{name}@{share}"].compression
                cell.update(
                    {
                        f"{name}_bytes": result.kv_bytes_kept / snap.compression.kv_bytes_kept,
                        f"{name}_full_bytes": result.kv_bytes_kept / result.kv_bytes_full,
                        f"{name}_same": both.results[f"{name}@{share}"].text == full,
                    }
                )
            rows[share].append(cell)
    print(
        "| kept | prompts | method | bytes / SnapKV's (median) | bytes / full | identical to full: SnapKV | method |\n"
        "|---|---|---|---|---|---|---|"
    )
    for share, cells in rows.items():
        for name in ("ada", "lookahead"):
            print(
                f"| {share:.0%} | {len(cells)} | {name} | {statistics.median(c[name + '_bytes'] for c in cells):.2f} | "
                f"{statistics.median(c[name + '_full_bytes'] for c in cells):.2f} | "
                f"{sum(c['snap_same'] for c in cells)}/{len(cells)} | {sum(c[name + '_same'] for c in cells)}/{len(cells)} |"
            )


if __name__ == "__main__":
    main()
