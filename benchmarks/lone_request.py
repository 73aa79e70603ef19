"""One request at a time through ``SnapKVLLM.generate``: this tree against another checkout, in one run.

The scheduler puts every request through a worker thread and a batch that rows join and leave; a
lone request must not pay for that. This runs the same NQ RAG requests (``--prompts`` of them,
about ``--tokens`` tokens each, SnapKV at the default budget, greedy, ``--max-new-tokens``) with
each tree in turn (before, after, before, after, ...), each in its own process with that tree first
on ``sys.path``, and prints per request the best wall time of each side, the speed ratio
before / after (1.00 = same; the target is >= 0.95) and whether the answers are the same.

    git worktree add ../before <commit>
    python benchmarks/lone_request.py ../before --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(prompts: int, tokens: int, max_new: int, repeats: int) -> dict:
    """In this process: wall time of each request through ``generate``, best of ``repeats``."""
    sys.path.insert(0, str(HERE))
    from rag_prompts import build_prompt

    from snapkv_rag import SnapKVLLM

    llm = SnapKVLLM(max_new_tokens=max_new)
    chosen = [build_prompt(llm.tokenizer, tokens, index=i) for i in range(prompts)]
    llm.generate(chosen[0].question, chosen[0].documents, max_new_tokens=4)  # warm up
    rows = []
    for prompt in chosen:
        walls, result = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            result = llm.generate(prompt.question, prompt.documents)
            walls.append(time.perf_counter() - start)
        rows.append(
            {
                "prompt_tokens": result.usage.prompt_tokens,
                "wall_s": min(walls),
                "prefill_s": result.timings.prefill_s,
                "decode_ms_per_token": result.timings.decode_ms_per_token,
                "new_tokens": result.usage.completion_tokens,
                "text": result.text,
            }
        )
    return {"rows": rows}


def run_tree(tree: Path, args, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--prompts",
        str(args.prompts),
        "--tokens",
        str(args.tokens),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--out",
        str(out),
    ]
    subprocess.run(command, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "before", type=Path, nargs="?", help="the other checkout (e.g. a git worktree of an older commit)"
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=900)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree, interleaved")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON to write")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.out.write_text(json.dumps(measure(args.prompts, args.tokens, args.max_new_tokens, 1)))
        return
    if args.before is None:
        parser.error("before: give the other checkout to compare with")
    trees = {"before": args.before.resolve(), "after": HERE.parent}
    runs: dict[str, list[dict]] = {side: [] for side in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for side, tree in trees.items():
                runs[side].append(run_tree(tree, args, Path(scratch) / f"{side}{round_}.json"))
                print(f"round {round_ + 1}/{args.rounds} {side} done", flush=True)
    table, ratios = [], []
    for i in range(args.prompts):
        best = {side: min(run["rows"][i]["wall_s"] for run in runs[side]) for side in trees}
        median = {side: statistics.median(run["rows"][i]["wall_s"] for run in runs[side]) for side in trees}
        same = len({run["rows"][i]["text"] for side in trees for run in runs[side]}) == 1
        ratio = best["before"] / best["after"]
        ratios.append(ratio)
        row = runs["after"][0]["rows"][i]
        table.append(
            {
                "prompt_tokens": row["prompt_tokens"],
                "new_tokens": row["new_tokens"],
                "best_s": best,
                "median_s": median,
                "speed_ratio_best": ratio,
                "speed_ratio_median": median["before"] / median["after"],
                "same_answers": same,
            }
        )
        print(
            f"  {row['prompt_tokens']} tokens, {row['new_tokens']} new: before {best['before']:.2f} s, "
            f"after {best['after']:.2f} s (best of {args.rounds}); speed after/before {ratio:.3f} "
            f"(medians {median['before'] / median['after']:.3f}); same answers: {same}"
        )
    geo = statistics.geometric_mean(ratios)
    print(f"lone request speed, after vs before (geometric mean of best runs): {geo:.3f} (target >= 0.95)")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "benchmark": "lone_request",
                    "rounds": args.rounds,
                    "threads": args.threads,
                    "speed_ratio": geo,
                    "requests": table,
                    "command": "python benchmarks/lone_request.py BEFORE " + " ".join(a for a in sys.argv[2:]),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
