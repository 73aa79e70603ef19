"""Decode and prefill speed of this tree against another checkout of the project, in one run.

Runs ``cpu_decode.py --no-memory`` of each tree in turn (before, after, before, after, ...), each in
its own process with that tree first on ``sys.path``, so that drift on a shared machine hits both
sides alike, and prints after / before ratios of the decode ms/token (per method) and of the prefill
time, per prompt size, from the best (fastest) run of each side and from the medians: on a machine
others share, the best run is the one least disturbed. Below 1 is faster.

    git worktree add ../old <commit>
    python benchmarks/before_after.py ../old --sizes 2048 8000 --rounds 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(tree: Path, sizes: list[int], budget: int, threads: int, max_new: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [
        sys.executable,
        str(tree / "benchmarks" / "cpu_decode.py"),
        "--no-memory",
        "--sizes",
        *map(str, sizes),
        "--budgets",
        str(budget),
        "--threads",
        str(threads),
        "--max-new-tokens",
        str(max_new),
        "--out",
        str(out),
    ]
    subprocess.run(command, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="the other checkout (e.g. a git worktree of an older commit)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, interleaved")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="JSON with every run and the ratios")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": HERE.parent}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for side, tree in trees.items():
                report = run(
                    tree,
                    args.sizes,
                    args.budget,
                    args.threads,
                    args.max_new_tokens,
                    Path(scratch) / f"{side}{round_}.json",
                )
                runs[side].append(report)
                print(
                    f"round {round_ + 1} {side}: "
                    + ", ".join(
                        f"{row['prompt_tokens']} tok prefill {row['prefill_s']:.2f} s "
                        + " ".join(f"{name} {m['decode_ms_per_token']:.1f} ms" for name, m in row["methods"].items())
                        for row in report["rows"]
                    ),
                    flush=True,
                )
    ratios = []
    for i, size in enumerate(args.sizes):

        def figures(side: str) -> dict[str, list[float]]:
            rows = [report["rows"][i] for report in runs[side]]
            out = {"prefill": [r["prefill_s"] for r in rows]}
            for name in rows[0]["methods"]:
                out[name] = [r["methods"][name]["decode_ms_per_token"] for r in rows]
            return out

        before, after = figures("before"), figures("after")
        row = {
            "size": size,
            "prompt_tokens": runs["after"][0]["rows"][i]["prompt_tokens"],
            "best": {k: min(after[k]) / min(before[k]) for k in after},
            "median": {k: statistics.median(after[k]) / statistics.median(before[k]) for k in after},
        }
        ratios.append(row)
    names = list(ratios[0]["best"])
    print(
        "| prompt tokens | "
        + " | ".join(f"{n if n == 'prefill' else n + ' decode'} after/before (best; median)" for n in names)
        + " |"
    )
    print("|---|" + "---|" * len(names))
    for row in ratios:
        print(
            f"| {row['prompt_tokens']} | "
            + " | ".join(f"{row['best'][n]:.3f}; {row['median'][n]:.3f}" for n in names)
            + " |"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": "python benchmarks/before_after.py " + " ".join(sys.argv[1:]),
                    "runs": runs,
                    "ratios": ratios,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
