"""Tables and plots from ``rows.jsonl``: summary.md, summary.csv and plots/*.png.

Every mean comes with a 95% percentile-bootstrap interval over the rows of its group (1,000
resamples, fixed seed, so the same rows always give the same table). Rows of one question in
different cells are not independent, so compare cells by their intervals with that in mind.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .ordering import method_order, position_key

METRICS = {  # column -> (label, bootstrap CI?)
    "f1": ("answer F1", True),
    "f1_minus_full": ("F1 - full F1 (paired)", True),
    "subspan_em": ("subspan EM", True),
    "em": ("EM", True),
    "cit_precision": ("cit P", True),
    "cit_recall": ("cit R", True),
    "cit_f1": ("cit F1", True),
    "identical_to_full": ("same as full", True),
    "f1_vs_full": ("F1 vs full", True),
    "hit_rate": ("hit rate", True),
    "kept_tokens": ("kept tok", False),
    "kv_bytes_kept": ("KV MB", False),
    "kv_ratio": ("KV kept", False),
    "prefill_s": ("prefill s", False),
    "decode_ms_per_token": ("ms/tok", False),
    "prompt_tokens": ("prompt tok", False),
    "same_minus_snapkv": ("same as full - SnapKV's (paired)", True),
    "f1_vs_full_minus_snapkv": ("F1 vs full - SnapKV's (paired)", True),
}
AGAINST_SNAPKV = (
    "identical_to_full",
    "same_minus_snapkv",
    "f1_vs_full",
    "f1_vs_full_minus_snapkv",
    "kv_bytes_kept",
    "kv_ratio",
)
BY_BYTES = ("kv_ratio", "identical_to_full", "same_minus_snapkv", "f1_vs_full", "f1_minus_full")
"""The columns of the fidelity-against-kept-bytes table (:func:`bytes_table`)."""
TABLE_COLUMNS = (
    "f1",
    "f1_minus_full",
    "subspan_em",
    "cit_f1",
    "identical_to_full",
    "f1_vs_full",
    "hit_rate",
    "kept_tokens",
    "kv_bytes_kept",
    "kv_ratio",
    "prefill_s",
    "decode_ms_per_token",
)


def finished(path: Path, key: str) -> set:
    """The ``key`` of every row already in the JSON-lines file ``path`` (what a resumed run skips);
    creates ``path``'s folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return {json.loads(line)[key] for line in path.read_text().splitlines() if line} if path.exists() else set()


def append_rows(path: Path, rows: Sequence[dict]) -> None:
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def read_rows(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a run still going or killed
    return rows


def bootstrap_ci(values: Sequence[float], resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    data = np.asarray(values, dtype=float)
    if len(data) < 2:
        return float(data.mean()), float(data.mean())
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, len(data), size=(resamples, len(data)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def add_paired_deltas(rows: Sequence[dict]) -> None:
    """Give each row ``f1_minus_full``: its answer F1 minus the full cache's on the same prompt.
    Every method runs on the same prompts, so this difference's interval is the paired one, much
    narrower than comparing two groups' means; prompts without a full-cache row get none. Rows of
    ``KIND@B`` also get their fidelity minus ``snapkv@B``'s on the same prompt, where that was run."""
    full = {r["example_id"]: r["f1"] for r in rows if r["method"] == "full"}
    for r in rows:
        if r["example_id"] in full:
            r["f1_minus_full"] = r["f1"] - full[r["example_id"]]
    # every other method against SnapKV at the same budget (``KIND@25%`` against ``snapkv@25%``), prompt by prompt
    snapkv = {
        (r["example_id"], r["method"].partition("@")[2]): r
        for r in rows
        if r["method"].partition("@")[0] == "snapkv" and "@" in r["method"]
    }
    for r in rows:
        ref = snapkv.get((r["example_id"], r["method"].partition("@")[2])) if "@" in r["method"] else None
        if ref is not None and ref is not r and r.get("identical_to_full") is not None:
            r["same_minus_snapkv"] = r["identical_to_full"] - ref["identical_to_full"]
            r["f1_vs_full_minus_snapkv"] = r["f1_vs_full"] - ref["f1_vs_full"]


def aggregate(rows: Sequence[dict], keys: Sequence[str]) -> list[dict]:
    """One record per group of ``keys``: n, mean and CI of every metric, the budget."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(r[k] for k in keys)].append(r)
    methods = method_order(rows)
    out = []
    for key, members in groups.items():
        record = dict(zip(keys, key))
        record["n"] = len(members)
        budgets = sorted({m["budget"] for m in members if m.get("budget") is not None})
        record["budget"] = "/".join(map(str, budgets)) if budgets else "-"
        for column, (_, with_ci) in METRICS.items():
            values = [m[column] for m in members if m.get(column) is not None]
            if not values:
                continue
            record[column] = float(np.mean(values))
            if with_ci:
                record[column + "_lo"], record[column + "_hi"] = bootstrap_ci(values)
        out.append(record)

    def sort_key(rec):
        return tuple(
            methods.index(rec[k]) if k == "method" else position_key(rec[k]) if k == "gold_position" else rec[k]
            for k in keys
        )

    return sorted(out, key=sort_key)


def _fmt(record: dict, column: str) -> str:
    if column not in record:
        return "-"
    value = record[column]
    if column == "kv_bytes_kept":
        return f"{value / 2**20:.1f}"
    if column == "kv_ratio":
        return f"{value:.3f}"
    if column in ("kept_tokens", "prompt_tokens"):
        return f"{value:.0f}"
    if column == "prefill_s":
        return f"{value:.2f}"
    if column == "decode_ms_per_token":
        return f"{value:.0f}"
    if column + "_lo" in record:
        return f"{value:.3f} [{record[column + '_lo']:.2f}, {record[column + '_hi']:.2f}]"
    return f"{value:.3f}"


def markdown_table(records: Sequence[dict], keys: Sequence[str], columns: Sequence[str] = TABLE_COLUMNS) -> str:
    head = [*keys, "n", "budget", *(METRICS[c][0] for c in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [str(r[k]) for k in keys] + [str(r["n"]), str(r["budget"])] + [_fmt(r, c) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bytes_table(records: Sequence[dict], keys: Sequence[str] = ("dataset", "method")) -> str:
    """Fidelity against the bytes each method keeps, whatever its budget's label or its shape (ragged
    heads, per-layer budgets): the records of ``keys`` in each dataset by ``kv_ratio`` (the kept
    cache's bytes over the full cache's, as the request's cache holds them while it decodes), then the
    share of answers identical to the full cache's, the answer's F1 against the full cache's, and the
    answer F1 change against the gold answers paired with the full cache (95% intervals)."""
    shown = sorted(
        (r for r in records if r.get("kv_ratio") is not None),
        key=lambda r: (*(str(r[k]) for k in keys[:-1]), r["kv_ratio"]),
    )
    return markdown_table(shown, keys, BY_BYTES)


def write_csv(records: Sequence[dict], path: Path) -> None:
    fields: list[str] = []
    for r in records:
        fields += [k for k in r if k not in fields]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(records)


def collect_rows(out: Path) -> list[dict]:
    """``out/rows.jsonl``, or the rows of every ``out/*/rows.jsonl``: runs split into processes, one
    folder each, by cells or by methods, report together. A prompt's method found in two folders
    (each run has its own ``full``) is counted once; the two must have given the same answer."""
    paths = [out / "rows.jsonl"] if (out / "rows.jsonl").exists() else sorted(out.glob("*/rows.jsonl"))
    if not paths:
        raise SystemExit(f"no rows.jsonl in {out} or its subfolders: run the evals first")
    rows, seen = [], {}
    for path in paths:
        for row in read_rows(path):
            key = (row["example_id"], row["method"])
            if key not in seen:
                seen[key] = (path, row)
                rows.append(row)
            elif seen[key][1].get("text") != row.get("text"):
                raise SystemExit(
                    f"{key[0]}, {key[1]}: {seen[key][0].parent.name} and {path.parent.name} hold different "
                    f"answers (different settings or code): they cannot be reported together"
                )
    if not rows:
        raise SystemExit(f"{out} has no rows yet")
    return rows


def data_notes(out: Path, rows: Sequence[dict]) -> list[str]:
    """What the summary must say about the data: datasets scored without citation metrics (no gold
    documents given), and --data records left out as bad (from each run's run.json)."""
    notes = []
    no_gold = sorted({r["dataset"] for r in rows if "cit_f1" in r and r["cit_f1"] is None})
    if no_gold:
        notes.append(
            f"Citation metrics are left out for prompts without gold documents ({', '.join(no_gold)}): "
            "their cit columns average only the prompts that have gold, or show '-'."
        )
    paths = [out / "run.json"] if (out / "run.json").exists() else sorted(out.glob("*/run.json"))
    for path in paths:
        for data in json.loads(path.read_text()).get("data", []):
            if data.get("skipped"):
                notes.append(
                    f"--data {data['file']}: {data['skipped']} bad records skipped (--skip-bad), "
                    f"{data['records']} used."
                )
    return notes


def write_all(out: Path) -> str:
    """summary.md, summary.csv and plots/ for the rows in ``out`` (or its subfolders); returns the
    fidelity-against-kept-bytes table (:func:`bytes_table`), which the command prints."""
    rows = collect_rows(out)
    add_paired_deltas(rows)
    cells = aggregate(rows, ("dataset", "num_docs", "gold_position", "method"))
    by_n = aggregate(rows, ("dataset", "num_docs", "method"))
    by_position = aggregate(rows, ("dataset", "gold_position", "method"))
    overall = aggregate(rows, ("dataset", "method"))
    pooled = aggregate(rows, ("method",))
    write_csv(cells, out / "summary.csv")
    questions = {(r["dataset"], r["question_id"]) for r in rows}
    text = [
        "# Summary",
        "",
        f"{len(rows)} rows: {len({r['example_id'] for r in rows})} prompts from {len(questions)} questions, "
        f"methods {', '.join(method_order(rows))}. Means with 95% bootstrap intervals. Answer metrics are "
        "against the gold answers (citation markers removed); 'F1 - full F1' is the paired difference on "
        "the same prompts (an interval that excludes 0 is a measurable change); 'same as full', 'F1 vs full' "
        "and 'hit rate' measure fidelity to the full cache's greedy answer and decode attention. KV MB is "
        "the kept prompt cache per prompt; budget is tokens kept per layer.",
        "",
        *(line for note in data_notes(out, rows) for line in (note, "")),
        "## Fidelity against kept bytes (all N and positions)",
        "",
        "'KV kept' is the kept cache's bytes over the full cache's, as a request's cache holds them while it "
        "decodes (every layer padded to its widest head and as wide as its widest layer): methods of any shape "
        "and budget line up on it. 'F1 - full F1' is against the gold answers, paired with the full cache.",
        "",
        bytes_table(overall),
        "",
        "Over every prompt of every dataset:",
        "",
        bytes_table(pooled, ("method",)),
        "",
        "## By dataset and method (all N and positions)",
        "",
        markdown_table(overall, ("dataset", "method")),
        "",
        *(
            [
                "## Paired against SnapKV at the same budget (all N and positions)",
                "",
                "Each method's fidelity minus SnapKV's on the same prompts at the same budget; an interval above 0 "
                "keeps the full cache's answer measurably more often than SnapKV. KV MB shows what each keeps.",
                "",
                markdown_table([r for r in overall if "same_minus_snapkv" in r], ("dataset", "method"), AGAINST_SNAPKV),
                "",
            ]
            if any("same_minus_snapkv" in r for r in rows)
            else []
        ),
        "## By dataset, N and method (all gold positions)",
        "",
        markdown_table(by_n, ("dataset", "num_docs", "method")),
        "",
        "## By dataset, gold position and method (all N)",
        "",
        markdown_table(by_position, ("dataset", "gold_position", "method")),
        "",
        "## Every cell: dataset x N x gold position x method",
        "",
        markdown_table(cells, ("dataset", "num_docs", "gold_position", "method")),
        "",
    ]
    (out / "summary.md").write_text("\n".join(text))
    from .plots import plot_all

    plot_all(rows, by_n, cells, out / "plots")
    return bytes_table(overall) + "\n\n" + bytes_table(pooled, ("method",))
