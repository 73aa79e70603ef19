"""Fidelity of one eval run's full-cache answers to another's on the same prompts (e.g. bfloat16
against the committed float32 run): identical greedy answers, token F1 between the answers, and
each run's answer F1 against the gold answers.

    python scripts/dtype_fidelity.py evals/results/cpu-2core/nq-n5-n10/rows.jsonl RUN/rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evals.metrics import fidelity_scores  # noqa: E402


def full_rows(path: Path) -> dict[str, dict]:
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return {row["example_id"]: row for row in rows if row["method"] == "full"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", type=Path, help="rows.jsonl of the reference run (e.g. float32)")
    parser.add_argument("other", type=Path, help="rows.jsonl of the run to compare (e.g. bfloat16)")
    args = parser.parse_args()
    reference, other = full_rows(args.reference), full_rows(args.other)
    shared = sorted(set(reference) & set(other))
    if not shared:
        raise SystemExit("no example_id is in both runs' full-cache rows")
    same = [fidelity_scores(other[k]["text"], reference[k]["text"]) for k in shared]
    n = len(shared)
    identical = sum(s["identical_to_full"] for s in same)
    print(
        f"{n} prompts in both runs: identical answers {identical:.0f}/{n} ({identical / n:.0%}), token F1 between "
        f"answers {sum(s['f1_vs_full'] for s in same) / n:.3f}; answer F1 reference "
        f"{sum(reference[k]['f1'] for k in shared) / n:.3f}, other {sum(other[k]['f1'] for k in shared) / n:.3f}; "
        f"prefill s reference {sum(reference[k]['prefill_s'] for k in shared) / n:.2f}, "
        f"other {sum(other[k]['prefill_s'] for k in shared) / n:.2f}"
    )


if __name__ == "__main__":
    main()
