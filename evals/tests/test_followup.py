"""The follow-up eval on real NQ data and the tiny engine: pooled groups, the question-1 SnapKV
handle, every method's rows, resuming, and the summary."""

from __future__ import annotations

import json
import math

import torch

from evals import followup
from snapkv_rag.kv import prefix_cache


def test_groups_pool_the_questions_documents_and_point_at_their_gold():
    first = followup.groups(2, 3, 4, seed=1)
    assert first == followup.groups(2, 3, 4, seed=1)
    for group in first:
        assert len(group.questions) == 3 and 4 < len(group.documents) <= 12
        texts = [d["text"] for d in group.documents]
        assert len(set(texts)) == len(texts)
    examples = followup.nq_examples(6, [4], ["middle"], 1)
    for example, question in zip(examples, [q for g in first for q in g.questions]):
        pooled = first[0] if question in first[0].questions else first[1]
        assert question.question == example.question
        assert [pooled.documents[n - 1]["text"] for n in question.gold] == [example.documents[2]["text"]]


def test_question_one_handle_keeps_the_budget_of_document_positions(tiny):
    group = followup.groups(1, 2, 3, seed=0)[0]
    handle = followup.question_one_set(tiny, group.documents, group.questions[0].question, 0.5)
    entry = handle.entry()
    request = tiny.request(group.questions[0].question, group.documents)
    at = prefix_cache.boundary(request.input_ids, request.spans)
    assert entry.length == at
    for kv in entry.layers:
        assert kv.positions.shape[-1] == math.ceil(0.5 * at) and int(kv.positions.max()) < at
        assert all(len(set(head.tolist())) == kv.positions.shape[-1] for head in kv.positions[0])
    assert abs(handle.kept_bytes - 0.5 * handle.full_bytes) <= 0.02 * handle.full_bytes
    later = handle.generate(group.questions[1].question, max_new_tokens=4)
    assert later.usage.cached_tokens == at


def test_rows_for_every_method_resume_and_summary(tiny, tmp_path):
    torch.manual_seed(0)
    todo = followup.groups(1, 2, 2, seed=0)
    path = followup.run(tiny, todo, [0.5], tmp_path, max_new_tokens=4, progress=False)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted({r["method"] for r in rows}) == sorted(followup.METHODS)
    assert len(rows) == 2 * len(followup.METHODS)
    assert all(r["identical_to_full"] == 1.0 for r in rows if r["method"] == "full")
    followup.run(tiny, todo, [0.5], tmp_path, max_new_tokens=4, progress=False)
    assert len(path.read_text().splitlines()) == len(rows)  # the finished group is not run again
    records = followup.summarise(rows)
    assert {r["method"] for r in records} == set(followup.METHODS) - {"full"}
    assert all(r["n"] == 1 for r in records)  # question 2 only
    keynorm = next(r for r in records if r["method"] == "keynorm")
    assert abs(keynorm["stored_fraction"] - 0.5) < 0.02 and "vs_q1" in keynorm
    assert "| keynorm | 50% |" in followup.markdown(records)
    assert followup.plot(records, tmp_path / "f.png").stat().st_size > 1000
    assert "of 1 groups" in followup.readme(rows, records, "python -m evals.followup", 1)


def test_a_method_added_later_runs_on_the_groups_already_done(tiny, tmp_path):
    todo = followup.groups(1, 2, 2, seed=0)
    path = followup.run(tiny, todo, [0.5], tmp_path, max_new_tokens=4, progress=False, methods=["full", "streaming"])
    first = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["method"] for r in first) == ["full", "full", "streaming", "streaming"]
    followup.run(tiny, todo, [0.5], tmp_path, max_new_tokens=4, progress=False, methods=["full", "streaming", "kvzip"])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[:4] == first and sorted(r["method"] for r in rows[4:]) == ["kvzip", "kvzip"]  # no full rerun
    full = {r["question_index"]: r["text"] for r in first if r["method"] == "full"}
    assert all(r["identical_to_full"] == float(r["text"] == full[r["question_index"]]) for r in rows[4:])
