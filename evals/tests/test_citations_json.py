"""``--citations json`` end to end on the tiny model, and the paired JSON-vs-text report."""

from __future__ import annotations

import json

import pytest

from evals.__main__ import main
from evals.paired import pair_rows, write

ARGS = [
    "--datasets",
    "kv",
    "--num-docs",
    "5",
    "--gold-positions",
    "first,last",
    "--num-questions",
    "1",
    "--methods",
    "full,snapkv@64",
    "--max-new-tokens",
    "40",
    "--no-progress",
]


def test_json_rows_take_citations_and_answer_from_the_json(tmp_path, tiny):
    out = tmp_path / "json"
    assert main([*ARGS, "--citations", "json", "--out", str(out)], engine=tiny) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert '"answer"' in row["raw_text"] or not row["json_complete"]
        if row["json_complete"]:
            parsed = json.loads(row["raw_text"])
            assert row["text"] == parsed["answer"].strip()
            assert row["citations"] == list(dict.fromkeys(parsed["citations"]))
            assert all(1 <= n <= 5 for n in row["citations"]) and row["citations"]
        else:
            assert row["citations"] == [] and row["cit_f1"] == 0.0
    settings = json.loads((out / "run.json").read_text())
    assert settings["citations"] == "json" and settings["stop"] == ""
    assert '"citations"' in settings["instruction"]
    with pytest.raises(SystemExit, match="citations"):  # resuming in the other mode is refused
        main([*ARGS, "--out", str(out)], engine=tiny)


def _row(example, method, citations, f1, **extra):
    return {
        "example_id": example,
        "method": method,
        "question": "q",
        "answers": ["a"],
        "gold_docs": [2],
        "num_docs": 5,
        "gold_position": "middle",
        "citations": citations,
        "cit_precision": float(2 in citations),
        "cit_recall": float(2 in citations),
        "cit_f1": float(2 in citations),
        "f1": f1,
        **extra,
    }


def test_paired_report_differences_and_mismatch(tmp_path):
    json_dir, text_dir = tmp_path / "json", tmp_path / "text"
    json_dir.mkdir()
    text_dir.mkdir()
    json_rows = [_row("e1", "full", [2], 0.5, json_complete=True), _row("e2", "full", [1], 1.0, json_complete=True)]
    text_rows = [_row("e1", "full", [], 0.5), _row("e2", "full", [], 0.0), _row("e3", "full", [2], 1.0)]
    (json_dir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in json_rows))
    (text_dir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text_rows))
    report = write(json_dir, [text_dir]).read_text()
    assert "2 pairs (2 prompts)" in report
    assert "| 5 | full | 2 | 0.000 | 0.500 | +0.500" in report.split("### cit F1")[1]  # cit F1: text 0, JSON 0.5
    assert "| 5 | full | 2 | 0.250 | 0.750 | +0.500" in report.split("### answer F1")[1]
    assert "| 5 | full | 2 | 0.000 | 1.000 | +1.000" in report.split("### cites any")[1]
    with pytest.raises(ValueError, match="differ in gold_docs"):
        pair_rows([_row("e1", "full", [2], 0.5)], [{**_row("e1", "full", [], 0.5), "gold_docs": [1]}])
