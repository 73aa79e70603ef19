"""needle and lines: deterministic for a seed, the needle / asked line where the depth says, prompts
sized by the engine's own token count, and the depth x length heatmap."""

from __future__ import annotations

import json

import pytest

from evals import synthetic
from evals.__main__ import main


@pytest.fixture(scope="module")
def needles(tiny):
    return synthetic.build("needle", 2, [300, 600], [0, 50, 100], seed=5, count=tiny.prompt_tokens)


def test_needle_is_deterministic_and_fits_the_length(needles, tiny):
    assert synthetic.build("needle", 2, [300, 600], [0, 50, 100], seed=5, count=tiny.prompt_tokens) == needles
    other = synthetic.build("needle", 1, [300], [0], seed=6, count=tiny.prompt_tokens)
    assert other[0].answers != needles[0].answers
    for e in needles:
        tokens = tiny.prompt_tokens(e.question, list(e.documents))
        assert e.num_docs - 40 < tokens <= e.num_docs, (e.id, tokens)  # filled to within a sentence or two
        assert e.gold == () and len(e.documents) == 1


def test_needle_sits_at_its_depth_once(needles):
    for e in needles:
        text = e.documents[0]["text"]
        needle = synthetic.NEEDLE.format(number=e.answers[0])
        assert text.count(e.answers[0]) == 1 and needle in text
        share = text.index(needle) / (len(text) - len(needle))
        depth = int(e.gold_position[1:]) / 100
        assert abs(share - depth) < 0.1, (e.id, share)
    same_question = [e for e in needles if e.question_id == "0" and e.num_docs == 600]
    haystacks = {
        e.documents[0]["text"].replace(synthetic.NEEDLE.format(number=e.answers[0]), "") for e in same_question
    }
    assert len({" ".join(h.split()) for h in haystacks}) == 1  # only the needle moves


def test_lines_ask_the_line_at_the_depth():
    examples = synthetic.build("lines", 2, [10, 40], [0, 50, 100], seed=1)
    assert examples == synthetic.build("lines", 2, [10, 40], [0, 50, 100], seed=1)
    for e in examples:
        lines = e.documents[0]["text"].splitlines()
        assert len(lines) == e.num_docs
        name = e.question.split("line ")[1].rstrip("?")
        matching = [i for i, line in enumerate(lines) if line.startswith(f"line {name}:")]
        assert len(matching) == 1 and lines[matching[0]].endswith(f"<{e.answers[0]}>")
        assert matching[0] == round(int(e.gold_position[1:]) / 100 * (e.num_docs - 1))
    values = [line.rsplit("<", 1)[1] for line in examples[-1].documents[0]["text"].splitlines()]
    assert len(set(values)) == len(values)


def test_bad_synthetic_options_are_clear(tiny, tmp_path):
    with pytest.raises(SystemExit, match="every depth must be 0..100"):
        main(["--datasets", "needle", "--depths", "0,120", "--out", str(tmp_path)], engine=tiny)
    with pytest.raises(SystemExit, match="cannot hold the question"):
        main(["--datasets", "needle", "--num-docs", "needle=20", "--out", str(tmp_path)], engine=tiny)
    with pytest.raises(ValueError, match="at most"):
        synthetic.build("lines", 1, [5000], [0], seed=0)


def test_cli_runs_needle_and_lines_with_heatmaps(tiny, tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            [
                "--datasets",
                "needle,lines",
                "--num-docs",
                "needle=250,400",
                "--num-docs",
                "lines=8",
                "--depths",
                "0,100",
                "--num-questions",
                "1",
                "--methods",
                "full,snapkv@48",
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
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == (2 * 2 + 2) * 2
    assert {(r["dataset"], r["num_docs"], r["gold_position"]) for r in rows if r["method"] == "full"} == {
        ("needle", 250, "d000"),
        ("needle", 250, "d100"),
        ("needle", 400, "d000"),
        ("needle", 400, "d100"),
        ("lines", 8, "d000"),
        ("lines", 8, "d100"),
    }
    assert all(r["cit_f1"] is None for r in rows)
    for name in ("heatmap_needle", "heatmap_lines", "heatmap_needle_fidelity", "heatmap_lines_fidelity"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
