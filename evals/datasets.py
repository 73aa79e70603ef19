"""Multi-document QA examples built from the real data in ``evals/data`` (see its README).

Every builder is deterministic for a seed: the questions drawn, the distractors and their order
depend only on ``(seed, question, N)``. The same questions are used in every (N, gold position)
cell, so that differences between cells come from N and position, not from the questions.

- ``nq``: NQ-open, the one gold passage + the N-1 passages ranked highest by BM25 against the
  question (from other questions' gold passages and the MuSiQue, HotpotQA and 2WikiMultihopQA
  paragraph pools), in rank order, dropping any passage that contains a gold answer. The gold
  passage goes first (0), middle (N // 2), last (N - 1) or at every position.
- ``musique`` / ``hotpotqa``: the question's own paragraphs (2-4 / 2 gold). N below the native
  count drops distractors (a seeded subset, never gold; smaller N is a subset of larger N); N above
  it adds BM25-ranked answer-free paragraphs from the dataset's pool. The documents are then
  shuffled with the seed (gold position ``shuffled``).
- ``kv``: lost-in-the-middle key-value retrieval, each ``"key": "value"`` pair a document (75 per
  record; N < 75 keeps the first N - 1 other pairs). The asked key moves to first / middle / last
  / every position; its document is the gold citation.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from .metrics import normalize_answer

DATA_DIR = Path(__file__).resolve().parent / "data"
DATASETS = ("nq", "musique", "hotpotqa", "kv")
POSITIONS = ("first", "middle", "last", "every")
MULTIHOP = ("musique", "hotpotqa")
_STOPWORDS = frozenset(
    "a an the of in on at to for is was were be by and or what who when where which how "
    "did does do with from as that this it its".split()
)


@dataclass(frozen=True)
class Example:
    """One prompt: a question over ``documents`` (dicts with ``title``, ``text``), with the 1-based
    numbers of its ``gold`` documents (the citation labels) and the accepted ``answers``."""

    id: str
    dataset: str
    question_id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[dict, ...]
    gold: tuple[int, ...]
    num_docs: int
    gold_position: str
    extra: dict = field(default_factory=dict, compare=False)


def _open(name: str):
    path = DATA_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"evals data file {path} is missing (see evals/data/README.md)")
    return gzip.open(path, "rt", encoding="utf-8")


@cache
def _load_json(name: str):
    with _open(name) as f:
        return json.load(f)


@cache
def _load_jsonl(name: str) -> tuple[dict, ...]:
    with _open(name) as f:
        return tuple(json.loads(line) for line in f if line.strip())


def bm25_tokens(text: str) -> list[str]:
    return [t for t in re.findall(r"\w+", text.lower()) if t not in _STOPWORDS]


class Pool:
    """A de-duplicated passage pool with a BM25 index (rank-bm25)."""

    def __init__(self, passages: Iterable[dict]):
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise ImportError("the evals need rank-bm25: pip install 'snapkv-rag[evals]'") from error
        seen, self.passages = set(), []
        for p in passages:
            key = " ".join(p["text"].split())
            if key and key not in seen:
                seen.add(key)
                self.passages.append({"title": p.get("title") or "", "text": p["text"].strip()})
        self.normalised = [normalize_answer(p["text"]) for p in self.passages]
        self.index = BM25Okapi([bm25_tokens(f"{p['title']} {p['text']}") for p in self.passages])

    def ranked(self, query: str, answers: Sequence[str], exclude: set[str], k: int) -> list[dict]:
        """The ``k`` best BM25 passages for ``query`` that contain no answer and are not excluded."""
        scores = self.index.get_scores(bm25_tokens(query))
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        gold = [f" {a} " for a in (normalize_answer(x) for x in answers) if a]
        out = []
        for i in order:
            if len(out) == k:
                break
            text = " ".join(self.passages[i]["text"].split())
            if text in exclude or any(g in f" {self.normalised[i]} " for g in gold):
                continue
            out.append(self.passages[i])
        if len(out) < k:
            raise ValueError(f"the distractor pool has only {len(out)} usable passages for {query!r}, {k} needed")
        return out


@cache
def nq_pool() -> Pool:
    nq = [r["ctxs"][0] for r in _load_jsonl("nq-open-oracle.jsonl.gz")]
    musique = _load_json("musique_train_corpus.json.gz")
    hotpot = [{"title": t, "text": "".join(s)} for t, s in _load_json("hotpotqa_train_corpus.json.gz").items()]
    wiki2 = _load_json("2wikimultihopqa_corpus.json.gz")
    return Pool([*nq, *musique, *hotpot, *wiki2])


@cache
def multihop_pool(dataset: str) -> Pool:
    if dataset == "musique":
        return Pool(_load_json("musique_train_corpus.json.gz"))
    return Pool({"title": t, "text": "".join(s)} for t, s in _load_json("hotpotqa_train_corpus.json.gz").items())


def gold_indices(position: str, n: int) -> list[tuple[str, int]]:
    """0-based gold slots with their labels for a position name."""
    if position == "first":
        return [("first", 0)]
    if position == "middle":
        return [("middle", n // 2)]
    if position == "last":
        return [("last", n - 1)]
    if position == "every":
        return [(f"p{i:02d}", i) for i in range(n)]
    raise ValueError(f"gold position: expected one of {POSITIONS}, got {position!r}")


def _sample(records: Sequence, num_questions: int, seed: int, dataset: str) -> list[int]:
    if num_questions > len(records):
        raise ValueError(f"--num-questions {num_questions}: {dataset} has only {len(records)} questions")
    order = list(range(len(records)))
    random.Random(f"{seed}-{dataset}").shuffle(order)
    return sorted(order[:num_questions])


def _norm_key(text: str) -> str:
    return " ".join(text.split())


def nq_examples(num_questions: int, num_docs: Sequence[int], positions: Sequence[str], seed: int) -> list[Example]:
    records = _load_jsonl("nq-open-oracle.jsonl.gz")
    pool = nq_pool()
    out = []
    for q in _sample(records, num_questions, seed, "nq"):
        r = records[q]
        gold_doc = {"title": r["ctxs"][0]["title"], "text": r["ctxs"][0]["text"].strip()}
        distractors = pool.ranked(r["question"], r["answers"], {_norm_key(gold_doc["text"])}, max(num_docs) - 1)
        for n in num_docs:
            for position in positions:
                for label, slot in gold_indices(position, n):
                    docs = list(distractors[: n - 1])
                    docs.insert(slot, gold_doc)
                    out.append(
                        Example(
                            f"nq-{q}-n{n}-{label}",
                            "nq",
                            str(q),
                            r["question"],
                            tuple(r["answers"]),
                            tuple(docs),
                            (slot + 1,),
                            n,
                            label,
                        )
                    )
    return out


def _multihop_record(dataset: str, r: dict) -> tuple[str, list[str], list[dict], list[bool]]:
    if dataset == "musique":
        docs = [{"title": p["title"], "text": p["paragraph_text"].strip()} for p in r["paragraphs"]]
        return (
            r["question"],
            [r["answer"], *r.get("answer_aliases", [])],
            docs,
            [p["is_supporting"] for p in r["paragraphs"]],
        )
    titles = {t for t, _ in r["supporting_facts"]}
    docs = [{"title": t, "text": "".join(s).strip()} for t, s in r["context"]]
    return r["question"], [r["answer"]], docs, [d["title"] in titles for d in docs]


def multihop_examples(dataset: str, num_questions: int, num_docs: Sequence[int], seed: int) -> list[Example]:
    records = _load_json("musique_train.json.gz" if dataset == "musique" else "hotpotqa_train.json.gz")
    out = []
    for q in _sample(records, num_questions, seed, dataset):
        question, answers, docs, is_gold = _multihop_record(dataset, records[q])
        gold = [d for d, g in zip(docs, is_gold) if g]
        distractors = [d for d, g in zip(docs, is_gold) if not g]
        random.Random(f"{seed}-{dataset}-{q}-drop").shuffle(distractors)
        extra_needed = max(num_docs) - len(docs)
        if extra_needed > 0:
            exclude = {_norm_key(d["text"]) for d in docs}
            distractors += multihop_pool(dataset).ranked(question, answers, exclude, extra_needed)
        for n in num_docs:
            if n < len(gold) + 1:
                raise ValueError(
                    f"--num-docs {n}: {dataset} question {q} has {len(gold)} gold documents; "
                    f"N must leave room for at least one distractor"
                )
            chosen = [(d, True) for d in gold] + [(d, False) for d in distractors[: n - len(gold)]]
            random.Random(f"{seed}-{dataset}-{q}-n{n}").shuffle(chosen)
            out.append(
                Example(
                    f"{dataset}-{q}-n{n}-shuffled",
                    dataset,
                    str(q),
                    question,
                    tuple(answers),
                    tuple(d for d, _ in chosen),
                    tuple(i + 1 for i, (_, g) in enumerate(chosen) if g),
                    n,
                    "shuffled",
                )
            )
    return out


def kv_examples(num_questions: int, num_docs: Sequence[int], positions: Sequence[str], seed: int) -> list[Example]:
    records = _load_jsonl("kv-retrieval-75_keys.jsonl.gz")
    out = []
    for q in _sample(records, num_questions, seed, "kv"):
        r = records[q]
        others = [p for p in r["ordered_kv_records"] if p[0] != r["key"]]
        for n in num_docs:
            if not 2 <= n <= len(others) + 1:
                raise ValueError(f"--num-docs {n}: kv records hold {len(others) + 1} pairs (N must be 2..75)")
            for position in positions:
                for label, slot in gold_indices(position, n):
                    pairs = others[: n - 1]
                    pairs.insert(slot, [r["key"], r["value"]])
                    docs = tuple({"title": None, "text": f'"{k}": "{v}"'} for k, v in pairs)
                    question = f'What is the value associated with the key "{r["key"]}"?'
                    out.append(
                        Example(
                            f"kv-{q}-n{n}-{label}", "kv", str(q), question, (r["value"],), docs, (slot + 1,), n, label
                        )
                    )
    return out


def build(
    dataset: str, num_questions: int, num_docs: Sequence[int], positions: Sequence[str], seed: int
) -> list[Example]:
    """Examples of one dataset for every N and gold position (multi-hop sets ignore positions)."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset: expected one of {DATASETS}, got {dataset!r}")
    if num_questions < 1:
        raise ValueError(f"--num-questions: must be >= 1, got {num_questions}")
    if any(n < 2 for n in num_docs):
        raise ValueError(f"--num-docs: every N must be >= 2, got {list(num_docs)}")
    if dataset == "nq":
        return nq_examples(num_questions, num_docs, positions, seed)
    if dataset == "kv":
        return kv_examples(num_questions, num_docs, positions, seed)
    return multihop_examples(dataset, num_questions, num_docs, seed)
