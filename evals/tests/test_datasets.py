"""Dataset builders: deterministic for a seed, gold where asked, no answer-bearing distractor."""

import pytest

from evals import datasets
from evals.metrics import normalize_answer


def _contains_answer(text, answers):
    norm = f" {normalize_answer(text)} "
    return any(f" {normalize_answer(a)} " in norm for a in answers if normalize_answer(a))


@pytest.fixture(scope="module")
def nq():
    return datasets.build("nq", 4, [5, 10], ["first", "middle", "last"], seed=3)


def test_nq_is_deterministic_for_a_seed(nq):
    assert datasets.build("nq", 4, [5, 10], ["first", "middle", "last"], seed=3) == nq
    assert {e.question_id for e in datasets.build("nq", 4, [5], ["first"], seed=4)} != {e.question_id for e in nq}


def test_nq_gold_placement_and_distractor_exclusion(nq):
    slots = {"first": lambda n: 0, "middle": lambda n: n // 2, "last": lambda n: n - 1}
    records = datasets._load_jsonl("nq-open-oracle.jsonl.gz")
    assert len(nq) == 4 * 2 * 3
    for e in nq:
        assert len(e.documents) == e.num_docs
        gold_slot = slots[e.gold_position](e.num_docs)
        assert e.gold == (gold_slot + 1,)
        assert e.documents[gold_slot]["text"] == records[int(e.question_id)]["ctxs"][0]["text"].strip()
        for i, doc in enumerate(e.documents):
            if i != gold_slot:
                assert not _contains_answer(doc["text"], e.answers), (e.id, i)
        assert len({d["text"] for d in e.documents}) == e.num_docs


def test_nq_every_position_moves_the_gold_through_each_slot():
    examples = datasets.build("nq", 1, [5], ["every"], seed=0)
    assert [e.gold for e in examples] == [(i,) for i in range(1, 6)]
    distractors = {tuple(d["text"] for i, d in enumerate(e.documents) if i != e.gold[0] - 1) for e in examples}
    assert len(distractors) == 1  # only the gold moves; the distractors keep their BM25 order


@pytest.mark.parametrize("dataset", ["musique", "hotpotqa"])
def test_multihop_keeps_every_gold_and_scales_n(dataset):
    a = datasets.build(dataset, 3, [5, 10, 25], ["first"], seed=1)
    assert a == datasets.build(dataset, 3, [5, 10, 25], ["first"], seed=1)
    for e in a:
        assert len(e.documents) == e.num_docs and len(e.gold) >= 2
        assert e.gold_position == "shuffled"
    by_question = {}
    for e in a:
        by_question.setdefault(e.question_id, []).append(e)
    for group in by_question.values():
        gold_texts = [{e.documents[g - 1]["text"] for g in e.gold} for e in group]
        assert all(g == gold_texts[0] for g in gold_texts)  # the same gold at every N
        small, large = group[0], group[1]
        assert {d["text"] for d in small.documents} <= {d["text"] for d in large.documents}


def test_kv_moves_the_asked_key():
    examples = datasets.build("kv", 2, [10, 75], ["first", "middle", "last"], seed=0)
    for e in examples:
        gold_doc = e.documents[e.gold[0] - 1]["text"]
        key = e.question.split('"')[1]
        assert gold_doc == f'"{key}": "{e.answers[0]}"'
        assert sum(key in d["text"] for d in e.documents) == 1
    assert [e.gold[0] for e in examples[:3]] == [1, 6, 10]


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="dataset"):
        datasets.build("squad", 1, [5], ["first"], 0)
    with pytest.raises(ValueError, match="gold position"):
        datasets.build("nq", 1, [5], ["centre"], 0)
    with pytest.raises(ValueError, match="num-docs"):
        datasets.build("kv", 1, [80], ["first"], 0)
