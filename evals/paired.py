"""Cited answers as JSON beside free text, on the same prompts: ``paired.md``.

    python -m evals.paired evals/results/citations-json evals/results/cpu-2core/nq-n5-n10 \\
        evals/results/cpu-2core/nq-n20

Rows of the JSON run (``--citations json``) are paired with the free-text rows of the same example
id and method; a pair whose question, gold answers, gold documents, N or gold position differ is an
error (the runs did not use the same prompts). Per N and method: citation precision / recall / F1,
answer F1 and the share of answers citing the gold document, in each mode, and the mean paired
difference (JSON - text) with a 95% percentile-bootstrap interval over the pairs.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

from .ordering import method_order
from .report import bootstrap_ci, read_rows

METRICS = {
    "cit_precision": "cit P",
    "cit_recall": "cit R",
    "cit_f1": "cit F1",
    "f1": "answer F1",
    "cites_gold": "cites gold",
    "cites_any": "cites any",
}
SAME = ("question", "answers", "gold_docs", "num_docs", "gold_position")


def with_flags(row: dict) -> dict:
    gold = set(row.get("gold_docs") or ())
    return {**row, "cites_any": float(bool(row["citations"])), "cites_gold": float(bool(gold & set(row["citations"])))}


def pair_rows(json_rows: Sequence[dict], text_rows: Sequence[dict]) -> list[tuple[dict, dict]]:
    """(json row, text row) per (example id, method) present in both; differing prompts raise."""
    text = {(r["example_id"], r["method"]): r for r in text_rows}
    pairs = []
    for row in json_rows:
        other = text.get((row["example_id"], row["method"]))
        if other is None:
            continue
        differ = [k for k in SAME if row.get(k) != other.get(k)]
        if differ:
            raise ValueError(
                f"{row['example_id']} ({row['method']}): the runs differ in {', '.join(differ)}; "
                "they did not run the same prompts"
            )
        pairs.append((with_flags(row), with_flags(other)))
    return pairs


def table(pairs: Sequence[tuple[dict, dict]]) -> list[str]:
    groups: dict[tuple[int, str], list[tuple[dict, dict]]] = defaultdict(list)
    for j, t in pairs:
        groups[(j["num_docs"], j["method"])].append((j, t))
    methods = method_order(j for j, _ in pairs)
    lines = []
    for metric, label in METRICS.items():
        lines += [
            f"### {label}",
            "",
            "| N | method | pairs | text | JSON | JSON - text [95% CI] |",
            "|---|---|---|---|---|---|",
        ]
        for n in sorted({n for n, _ in groups}):
            for method in methods:
                group = [
                    (j, t)
                    for j, t in groups.get((n, method), [])
                    if j.get(metric) is not None and t.get(metric) is not None
                ]
                if not group:
                    continue
                diffs = [j[metric] - t[metric] for j, t in group]
                low, high = bootstrap_ci(diffs)
                lines.append(
                    f"| {n} | {method} | {len(group)} | {mean(t[metric] for _, t in group):.3f} | "
                    f"{mean(j[metric] for j, _ in group):.3f} | {mean(diffs):+.3f} [{low:+.3f}, {high:+.3f}] |"
                )
        lines.append("")
    return lines


def write(json_dir: Path, text_dirs: Sequence[Path], out: Path | None = None) -> Path:
    json_rows = read_rows(json_dir / "rows.jsonl")
    text_rows = [r for d in text_dirs for r in read_rows(d / "rows.jsonl")]
    pairs = pair_rows(json_rows, text_rows)
    complete = [j.get("json_complete") for j, _ in pairs]
    lines = [
        "# Cited answers: JSON (constrained) vs free text, paired on the same prompts",
        "",
        f"{len(pairs)} pairs ({len({j['example_id'] for j, _ in pairs})} prompts) of {len(json_rows)} JSON rows; "
        f"free-text rows from {', '.join(d.name for d in text_dirs)}. JSON answers complete (parsed): "
        f"{sum(1 for c in complete if c)} of {len(complete)}. 'cites gold': the answer cites the gold "
        "document; 'cites any': it cites something.",
        "",
        *table(pairs),
    ]
    out = out or json_dir / "paired.md"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evals.paired", description=__doc__.split("\n\n")[0])
    p.add_argument("json_dir", type=Path, help="the --citations json run's --out folder")
    p.add_argument("text_dirs", type=Path, nargs="+", help="free-text runs' --out folders (same prompts)")
    p.add_argument("--out", type=Path, default=None, help="output file (default: JSON_DIR/paired.md)")
    args = p.parse_args(argv)
    try:
        print(f"wrote {write(args.json_dir, args.text_dirs, args.out)}")
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
