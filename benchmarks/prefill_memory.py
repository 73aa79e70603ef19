"""Peak memory of long-prompt answers with and without the chunked MLP prefill (CPU, embedded model).

For each prompt size and each method (full cache, SnapKV at ``--budget``) one answer runs with the
engine's ``prefill_chunk`` (MLP slices of ``--chunk`` tokens) and one with the whole prompt through
each MLP at once, each in a process of its own (``peak_memory.py``), so that one peak cannot hide
another. glibc's malloc serves mid-sized blocks from a heap it rarely gives back, so sliced runs
would show the allocator's reuse rather than live tensors; every probe therefore runs with
``MALLOC_MMAP_THRESHOLD_=65536`` (blocks of 64 KiB and more are mapped and unmapped on free), the
same for both sides. Prints the peak RSS above the loaded model for each, the chunked/unchunked ratio, and
the model's KV bytes for comparison; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peak_memory  # noqa: E402

# blocks of 64 KiB and more are mapped and unmapped on free, so RSS follows live tensors
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def table(rows: list[dict]) -> str:
    lines = [
        "| prompt tokens | method | peak MiB, whole prompt per MLP | peak MiB, MLP in slices | "
        "sliced / whole | KV MiB kept |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        whole, sliced = row["whole"]["peak_rss_delta_mib"], row["sliced"]["peak_rss_delta_mib"]
        ratio = f"{sliced / whole:.2f}" if whole and sliced else "n/a"
        lines.append(
            f"| {row['sliced']['prompt_tokens']} | {row['method']} | {whole:.0f} | {sliced:.0f} | {ratio} | "
            f"{row['sliced']['kv_bytes_kept'] / 2**20:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder/GGUF/hub id (default: the embedded model)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8000], help="prompt lengths in tokens")
    parser.add_argument("--budget", type=int, default=1024, help="SnapKV max_capacity_prompt")
    parser.add_argument("--chunk", type=int, default=1024, help="MLP slice in tokens for the sliced runs")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "prefill_memory.json", help="JSON to write")
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        for budget in (0, args.budget):
            row = {"size": size, "method": f"snapkv@{budget}" if budget else "full"}
            for label, chunk in (("whole", 0), ("sliced", args.chunk)):
                row[label] = peak_memory.probe(
                    args.model, size, budget, args.max_new_tokens, args.threads, chunk or None, env=MALLOC
                )
            print(
                f"{size} {row['method']}: whole {row['whole']['peak_rss_delta_mib']:.0f} MiB, "
                f"sliced {row['sliced']['peak_rss_delta_mib']:.0f} MiB",
                flush=True,
            )
            rows.append(row)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(["python", "benchmarks/prefill_memory.py", *sys.argv[1:]]),
                "chunk": args.chunk,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
