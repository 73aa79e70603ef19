"""--data FILE.jsonl: the schema's checks name file, line and field; --skip-bad; --num-docs; no gold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals import userdata
from evals.__main__ import main
from evals.datasets import DATA_DIR

EXAMPLE = DATA_DIR / "example_own_data.jsonl"
GOOD = {
    "question": "Who wrote Hamlet?",
    "answers": ["Shakespeare"],
    "documents": [
        {"title": "Faust", "text": "Faust is by Goethe."},
        "Hamlet is by Shakespeare.",
        {"title": None, "text": "Don Quixote is by Cervantes."},
    ],
    "gold": [2],
}


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_the_shipped_example_file_follows_the_schema():
    data = userdata.load(EXAMPLE)
    assert data.name == "example_own_data" and not data.skipped
    assert [e.question_id for e in data.examples] == ["hamlet", "fuji", "light", "python", "danube"]
    assert data.without_gold == 1 and data.examples[-1].gold == ()
    assert data.examples[0].gold == (2,) and data.examples[0].documents[1]["title"] == "Hamlet"
    assert data.examples[2].documents[0] == {"title": None, "text": data.examples[2].documents[0]["text"]}
    assert all(e.num_docs == 3 and e.gold_position == "given" for e in data.examples)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"question": ""}, "field 'question': expected a non-empty string"),
        ({"answers": "Shakespeare"}, "field 'answers': expected a non-empty list"),
        ({"answers": []}, "field 'answers'"),
        ({"documents": []}, "field 'documents': expected a non-empty list"),
        ({"documents": [{"title": "x"}]}, r"field 'documents\[1\].text': expected a non-empty string"),
        ({"documents": ["a", 3]}, r"field 'documents\[2\]': expected a string or an object"),
        ({"documents": [{"title": 5, "text": "a"}]}, r"field 'documents\[1\].title'"),
        ({"gold": [4]}, r"field 'gold': \[4\] outside 1..3"),
        ({"gold": 2}, "field 'gold': expected a non-empty list"),
        ({"gold": [True]}, "field 'gold'"),
        ({"id": ["x"]}, "field 'id'"),
    ],
)
def test_a_bad_field_names_the_file_line_and_field(tmp_path, change, message):
    path = _write(tmp_path / "qa.jsonl", [GOOD, "", {**GOOD, **change}])
    with pytest.raises(userdata.DataError, match=f"{path}:3: {message}"):
        userdata.load(path)


def test_bad_json_duplicate_ids_missing_file_and_builtin_name(tmp_path):
    with pytest.raises(userdata.DataError, match=r"qa.jsonl:2: not valid JSON"):
        userdata.load(_write(tmp_path / "qa.jsonl", [GOOD, '{"question": "x",']))
    with pytest.raises(userdata.DataError, match=r"qa.jsonl:2: field 'id': 'a' repeats line 1"):
        userdata.load(_write(tmp_path / "qa.jsonl", [{**GOOD, "id": "a"}, {**GOOD, "id": "a"}]))
    with pytest.raises(userdata.DataError, match="no such file"):
        userdata.load(tmp_path / "missing.jsonl")
    with pytest.raises(userdata.DataError, match="built-in dataset"):
        userdata.load(_write(tmp_path / "nq.jsonl", [GOOD]))


def test_num_docs_takes_the_first_n_or_fails_clearly(tmp_path):
    path = _write(tmp_path / "qa.jsonl", [GOOD, {**GOOD, "gold": [1, 3]}])
    data = userdata.load(path, num_docs=[2, 3])
    assert [(e.num_docs, e.gold) for e in data.examples] == [(2, (2,)), (3, (2,)), (2, (1,)), (3, (1, 3))]
    assert data.examples[0].documents == tuple(userdata.parse_record(GOOD, "x", None)[1].documents[:2])
    with pytest.raises(
        userdata.DataError, match=r"qa.jsonl:1: field 'documents': 3 documents, fewer than --num-docs 4"
    ):
        userdata.load(path, num_docs=[4])
    with pytest.raises(userdata.DataError, match=r"qa.jsonl:1: field 'gold': every gold document \[2\] lies beyond"):
        userdata.load(path, num_docs=[1])


def test_cli_checks_before_loading_any_model(tmp_path, monkeypatch):
    """A bad record stops the run before the model loads (a model that cannot load is never reached)."""
    bad = _write(tmp_path / "qa.jsonl", [GOOD, {**GOOD, "answers": [""]}])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match=r"qa.jsonl:2: field 'answers'"):
        main(["--data", str(bad), "--model", "no/such-model-here", "--out", str(tmp_path / "out")])


def test_cli_skip_bad_counts_and_no_gold_leaves_citations_out(tmp_path, tiny, capsys):
    path = _write(
        tmp_path / "qa.jsonl", [GOOD, {**GOOD, "gold": [9]}, "not json", {**GOOD, "id": "nogold", "gold": None}]
    )
    with pytest.raises(SystemExit, match=r"qa.jsonl:2: field 'gold'"):
        main(["--data", str(path), "--out", str(tmp_path / "strict")], engine=tiny)
    out = tmp_path / "run"
    assert (
        main(
            [
                "--data",
                str(path),
                "--skip-bad",
                "--methods",
                "full,snapkv@40",
                "--max-new-tokens",
                "2",
                "--no-progress",
                "--out",
                str(out),
            ],
            engine=tiny,
        )
        == 0
    )
    printed = capsys.readouterr()
    assert "2 records, 2 skipped as bad, 1 without gold" in printed.out
    assert "qa.jsonl:3: not valid JSON" in printed.err
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert sorted({r["question_id"] for r in rows}) == ["1", "nogold"] and len(rows) == 4
    assert {r["dataset"] for r in rows} == {"qa"}
    by_id = {(r["question_id"], r["method"]): r for r in rows}
    assert by_id[("nogold", "full")]["cit_f1"] is None and by_id[("1", "full")]["cit_f1"] is not None
    summary = (out / "summary.md").read_text()
    assert "2 bad records skipped (--skip-bad), 2 used" in summary
    assert "Citation metrics are left out for prompts without gold documents (qa)" in summary
