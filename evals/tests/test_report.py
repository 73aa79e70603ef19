"""The summary's paired difference against the full cache."""

from __future__ import annotations

import json

import pytest

from evals.plots import against_budget, against_bytes, share_of
from evals.report import add_paired_deltas, aggregate, bytes_table, collect_rows


def _row(example: str, method: str, f1: float) -> dict:
    return {"example_id": example, "dataset": "nq", "num_docs": 5, "gold_position": "first", "method": method, "f1": f1}


def test_paired_difference_is_taken_prompt_by_prompt():
    full = [0.0, 1.0, 0.5, 0.2, 0.9, 0.4]
    rows = [_row(f"e{i}", "full", f) for i, f in enumerate(full)]
    rows += [_row(f"e{i}", "snapkv@25%", f - 0.1) for i, f in enumerate(full)]  # always 0.1 lower
    rows += [_row("orphan", "snapkv@25%", 1.0)]  # no full-cache row: no difference
    add_paired_deltas(rows)
    assert "f1_minus_full" not in rows[-1]
    by_method = {r["method"]: r for r in aggregate(rows[:-1], ("dataset", "method"))}
    snap, ref = by_method["snapkv@25%"], by_method["full"]
    assert abs(snap["f1_minus_full"] + 0.1) < 1e-9 and ref["f1_minus_full"] == 0.0
    # the paired interval is a point (the difference never varies) while the two means' own intervals overlap
    assert abs(snap["f1_minus_full_lo"] + 0.1) < 1e-9 and abs(snap["f1_minus_full_hi"] + 0.1) < 1e-9
    assert snap["f1_hi"] > ref["f1_lo"]


def test_methods_are_paired_against_snapkv_at_their_own_budget_prompt_by_prompt():
    same = {
        "snapkv@25%": [1, 0, 0, 1],
        "snapkv@50%": [1, 1, 1, 1],
        "lookahead@25%": [1, 1, 0, 1],
        "lookahead@50%": [0, 1, 1, 1],
        "lookahead@512": [1, 1, 1, 1],
    }
    rows = [
        _row(f"e{i}", method, 0.5) | {"identical_to_full": float(v), "f1_vs_full": float(v)}
        for method, values in same.items()
        for i, v in enumerate(values)
    ]
    add_paired_deltas(rows)
    by_method = {r["method"]: r for r in aggregate(rows, ("dataset", "method"))}
    assert by_method["lookahead@25%"]["same_minus_snapkv"] == pytest.approx(0.25)  # one prompt more, none less
    assert by_method["lookahead@50%"]["same_minus_snapkv"] == pytest.approx(-0.25)  # against snapkv@50%, not @25%
    assert by_method["lookahead@25%"]["same_minus_snapkv_lo"] >= 0.0
    # no SnapKV at that budget, and SnapKV itself: nothing to pair with
    assert "same_minus_snapkv" not in by_method["lookahead@512"] and "same_minus_snapkv" not in by_method["snapkv@25%"]


def test_fidelity_is_plotted_against_the_share_kept_only_for_methods_run_at_a_share(tmp_path):
    assert share_of("snapkv@25%") == ("snapkv", 0.25) and share_of("ours:lookahead@50%") == ("ours:lookahead", 0.5)
    assert share_of("snapkv@1024") is None and share_of("full") is None and share_of("x@half%") is None
    rows = [
        _row(f"e{i}", method, 0.5) | {"identical_to_full": float(i % 2)}
        for i in range(4)
        for method in ("full", "snapkv@25%", "snapkv@50%", "h2o@25%")
    ]
    cells = [r | {"panel": "nq, N=5"} for r in aggregate(rows, ("dataset", "method"))]
    assert against_budget(cells, "identical_to_full", "same answer", tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 1000
    tokens = [c | {"method": c["method"].replace("%", "")} for c in cells]  # token budgets only: nothing to draw
    assert not against_budget(tokens, "identical_to_full", "same answer", tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_fidelity_is_printed_and_plotted_against_the_bytes_kept_whatever_the_budgets_label(tmp_path):
    ratios = {"full": 1.0, "snapkv@25%": 0.25, "snapkv@512": 0.4, "kvzip@25%": 0.3, "pyramidkv@50%": 0.45}
    rows = [
        _row(f"e{i}", method, 0.5) | {"identical_to_full": float(i % 2), "f1_vs_full": 0.5, "kv_ratio": ratio}
        for i in range(4)
        for method, ratio in ratios.items()
    ]
    add_paired_deltas(rows)
    overall = aggregate(rows, ("dataset", "method"))
    table = bytes_table(overall).splitlines()
    assert table[0].startswith("| dataset | method | n | budget | KV kept | same as full | same as full - SnapKV's")
    assert [line.split(" | ")[1] for line in table[2:]] == [
        "snapkv@25%",
        "kvzip@25%",
        "snapkv@512",
        "pyramidkv@50%",
        "full",
    ]  # in order of the bytes kept, a budget in tokens among the shares
    cells = [r | {"panel": "nq, N=5"} for r in overall]
    assert against_bytes(cells, "identical_to_full", "same answer", tmp_path / "bytes.png")
    assert (tmp_path / "bytes.png").stat().st_size > 1000
    old = [{k: v for k, v in c.items() if k != "kv_ratio"} for c in cells]  # rows without the figure: nothing to draw
    assert not against_bytes(old, "identical_to_full", "same answer", tmp_path / "none.png")


def test_runs_split_by_methods_report_together_with_each_prompts_full_cache_once(tmp_path):
    def run(folder: str, rows: list[dict]) -> None:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    full = [_row(f"e{i}", "full", 0.5) | {"text": f"answer {i}"} for i in range(3)]
    run("old", full + [_row(f"e{i}", "snapkv@25%", 0.4) | {"text": "x"} for i in range(3)])
    run("new", full[:2] + [_row(f"e{i}", "lookahead@25%", 0.5) | {"text": "y"} for i in range(2)])
    rows = collect_rows(tmp_path)
    assert sorted((r["example_id"], r["method"]) for r in rows if r["method"] == "full") == [
        ("e0", "full"),
        ("e1", "full"),
        ("e2", "full"),
    ]
    assert len(rows) == 3 + 3 + 2
    run("odd", [full[0] | {"text": "another answer"}])
    with pytest.raises(SystemExit, match="e0, full: new and odd hold different answers"):
        collect_rows(tmp_path)
