"""Answer, citation and fidelity metrics, per example (aggregation lives in :mod:`evals.report`).

Answers are compared after SQuAD normalisation (lower case, no punctuation, no articles, single
spaces), best over every accepted answer, with citation markers removed first so that ``Paris [2]``
scores like ``Paris``. Best-subspan EM (the lost-in-the-middle study's accuracy) asks whether a
normalised gold answer occurs inside the normalised prediction: small chat models answer in whole
sentences, which exact match would always fail.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

from snapkv_rag.request.prompts import strip_citations

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower case, drop punctuation, drop articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 on normalised whitespace tokens (0 when either side is empty, 1 when both are)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def subspan_exact_match(prediction: str, gold: str) -> float:
    """1 when the normalised gold answer occurs in the normalised prediction (on word boundaries)."""
    ref = normalize_answer(gold)
    return float(bool(ref) and f" {ref} " in f" {normalize_answer(prediction)} ")


def best_over(metric, prediction: str, answers: Sequence[str]) -> float:
    """The best score of ``prediction`` against any accepted answer (0 when there is none)."""
    return max((metric(prediction, gold) for gold in answers), default=0.0)


def answer_scores(text: str, answers: Sequence[str]) -> dict[str, float]:
    """EM, token F1 and best-subspan EM of a generated text, citation markers removed first."""
    answer = strip_citations(text)
    return {
        "em": best_over(exact_match, answer, answers),
        "f1": best_over(token_f1, answer, answers),
        "subspan_em": best_over(subspan_exact_match, answer, answers),
    }


def citation_scores(cited: Iterable[int], gold: Iterable[int]) -> dict[str, float]:
    """Precision, recall and F1 of cited document numbers against the gold ones.

    No citation at all scores 0 precision, 0 recall and 0 F1: an uncited answer gives the reader
    nothing to check, so it must not look like a perfectly precise one.
    """
    cited_set, gold_set = set(cited), set(gold)
    if not gold_set:
        raise ValueError("citation_scores: an example needs at least one gold document")
    correct = len(cited_set & gold_set)
    precision = correct / len(cited_set) if cited_set else 0.0
    recall = correct / len(gold_set)
    f1 = 2 * precision * recall / (precision + recall) if correct else 0.0
    return {"cit_precision": precision, "cit_recall": recall, "cit_f1": f1}


def fidelity_scores(text: str, full_text: str) -> dict[str, float]:
    """How close a compressed-cache answer is to the full cache's: identical greedy text, and
    token F1 of the answers (citation markers removed) against each other."""
    return {
        "identical_to_full": float(text.strip() == full_text.strip()),
        "f1_vs_full": token_f1(strip_citations(text), strip_citations(full_text)),
    }
