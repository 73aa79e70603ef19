"""The per-document reuse eval on real NQ data and the tiny engine: rows, resuming, the summary."""

from __future__ import annotations

import json

from evals import stitch
from evals.datasets import nq_examples


def test_rows_resume_and_summary(tiny, tmp_path):
    examples = nq_examples(2, [3], ["middle"], 0)
    path = stitch.run(tiny, examples, [0.0, 1.0], tmp_path, max_new_tokens=4, progress=False)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["method"], r["recompute"]) for r in rows] == [("full", None), ("stitched", 0.0), ("stitched", 1.0)] * 2
    first = [r for r in rows if r["method"] == "stitched" and r["id"] == examples[0].question_id]
    assert first[0]["documents_computed"] == 3 and first[1]["documents_computed"] == 0  # computed once
    assert first[0]["cached_tokens"] > first[1]["cached_tokens"] == 0  # recompute 1.0: nothing reused
    stitch.run(tiny, examples, [0.0, 1.0], tmp_path, max_new_tokens=4, progress=False)
    assert len(path.read_text().splitlines()) == len(rows)  # finished questions are not run again
    records = stitch.summarise(rows)
    everything = next(r for r in records if r["recompute"] == 1.0)
    assert everything["identical_to_full"] == 1.0 and everything["f1_delta"] == 0.0 and everything["n"] == 2
    assert "| 100% | 2 |" in stitch.markdown(records)


def test_first_token_divergence_is_zero_when_everything_is_recomputed(tiny, tmp_path):
    examples = nq_examples(2, [3], ["middle"], 0)
    path = stitch.first_token_rows(tiny, examples, [0.0, 1.0], tmp_path, progress=False)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2 and all(abs(r["kl@1.0"]) < 1e-6 and r["top1@1.0"] == 1.0 for r in rows)
    assert all(r["kl@0.0"] > 1e-6 for r in rows)  # documents computed alone do differ
    assert "| 100% | 2 |" in stitch.first_token_markdown(rows, [0.0, 1.0])
