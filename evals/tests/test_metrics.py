"""Metrics against hand-computed cases."""

import pytest

from evals.metrics import (
    answer_scores,
    citation_scores,
    exact_match,
    fidelity_scores,
    normalize_answer,
    subspan_exact_match,
    token_f1,
)


def test_squad_normalisation():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("An apple, a pear and THE plum.") == "apple pear and plum"
    assert normalize_answer("Theory") == "theory"  # 'the' only as a whole word


def test_exact_match_and_f1():
    assert exact_match("the Beatles.", "Beatles") == 1.0
    assert exact_match("The Beatles band", "Beatles") == 0.0
    # prediction: [john, lennon, and, paul] vs gold [john, lennon]: P = 2/4, R = 1 -> F1 = 2/3
    assert token_f1("John Lennon and Paul", "John Lennon") == pytest.approx(2 / 3)
    assert token_f1("Paris", "London") == 0.0
    assert token_f1("", "London") == 0.0


def test_subspan_em_is_word_bounded():
    assert subspan_exact_match("It was written by John Lennon in 1965.", "john lennon") == 1.0
    assert subspan_exact_match("Lennonism", "Lennon") == 0.0
    assert subspan_exact_match("anything", "") == 0.0


def test_answer_scores_strip_citations_and_take_the_best_answer():
    scores = answer_scores("Wilhelm Röntgen [1][3]", ["Wilhelm Conrad Röntgen", "Röntgen"])
    assert scores["em"] == 0.0
    # against "Wilhelm Conrad Röntgen": P = 2/2, R = 2/3 -> 0.8; against "Röntgen": P = 1/2, R = 1 -> 2/3
    assert scores["f1"] == pytest.approx(0.8)
    assert scores["subspan_em"] == 1.0
    assert answer_scores("Paris [2]", ["paris"])["em"] == 1.0


def test_citation_precision_recall_f1():
    assert citation_scores([1, 3], [3]) == {"cit_precision": 0.5, "cit_recall": 1.0, "cit_f1": pytest.approx(2 / 3)}
    assert citation_scores([2], [2, 5, 7]) == {
        "cit_precision": 1.0,
        "cit_recall": pytest.approx(1 / 3),
        "cit_f1": pytest.approx(0.5),
    }
    assert citation_scores([], [4]) == {"cit_precision": 0.0, "cit_recall": 0.0, "cit_f1": 0.0}
    assert citation_scores([1], [2])["cit_f1"] == 0.0
    with pytest.raises(ValueError):
        citation_scores([1], [])


def test_citation_formats_parse_to_the_same_documents():
    from snapkv_rag.request.prompts import parse_citations

    for text in ("Paris [1][3].", "Paris [1, 3].", "Paris [1] and [3]"):
        assert citation_scores(parse_citations(text, 5), [1, 3])["cit_f1"] == 1.0


def test_fidelity():
    assert fidelity_scores("Paris [1]", "Paris [1]") == {"identical_to_full": 1.0, "f1_vs_full": 1.0}
    same_answer_other_citation = fidelity_scores("Paris [2]", "Paris [1]")
    assert same_answer_other_citation == {"identical_to_full": 0.0, "f1_vs_full": 1.0}
