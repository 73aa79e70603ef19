"""Build snapkv_rag/data/demo.jsonl, the data of ``snapkv-rag demo``: NQ-open questions, each with
its gold passage and the 29 passages that BM25 ranks highest against the question in the eval
suite's distractor pool (other NQ gold passages, MuSiQue, HotpotQA and 2WikiMultihopQA paragraphs;
none containing a gold answer), taken from ``evals.datasets.nq_examples``: the evals' own NQ
prompts (data in evals/data, copied from the project's shared data folder).

Run from the repo root; the output is committed:

    PYTHONPATH=. python scripts/make_demo_data.py [--keep 3]

The demo's prompt for N documents (``--docs N``, 2 to 30) is the gold passage in the middle (slot
N // 2) of the first N - 1 distractors: what ``nq_examples`` builds for N documents, gold
"middle" (tests/test_cli.py checks that they are equal). Candidates are the evals' seeded NQ sample
(seed 0, 300 questions), in its order; we keep the first ``--keep`` that the embedded model answers
right with the full cache at the demo's default of 20 documents, its answer cut at the first
newline as the demo's is (few are: 3 of the first 50 candidates; an answer that the question
itself contains does not count), so that the demo shows what compression keeps rather than what a 135M
model cannot do. Nothing is chosen by how a compressed cache does on them: the script prints whether
lookahead SnapKV at 50% (the demo's default) gave the full cache's answer, for the data README.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.datasets import DATA_DIR, nq_examples  # noqa: E402
from evals.metrics import best_over, subspan_exact_match  # noqa: E402
from snapkv_rag.request.prompts import strip_citations  # noqa: E402

MAX_DOCS = 30
DEFAULT_DOCS = 20
CANDIDATES = 300
TARGET = ROOT / "snapkv_rag" / "data" / "demo.jsonl"


def _key(text: str) -> str:
    return " ".join(text.split())


def sources() -> dict[str, str]:
    """Each pool passage's text (whitespace normalised) -> the data set it comes from, the first
    one holding it, in the order ``evals.datasets.nq_pool`` pools them."""

    def load(name):
        with gzip.open(DATA_DIR / name, "rt", encoding="utf-8") as f:
            return json.load(f) if name.endswith(".json.gz") else [json.loads(line) for line in f if line.strip()]

    pools = [
        ("nq-open", [r["ctxs"][0]["text"] for r in load("nq-open-oracle.jsonl.gz")]),
        ("musique", [p["text"] for p in load("musique_train_corpus.json.gz")]),
        ("hotpotqa", ["".join(s) for s in load("hotpotqa_train_corpus.json.gz").values()]),
        ("2wikimultihopqa", [p["text"] for p in load("2wikimultihopqa_corpus.json.gz")]),
    ]
    found: dict[str, str] = {}
    for name, texts in pools:
        for text in texts:
            found.setdefault(_key(text), name)
    return found


def candidates():
    """The evals' seeded NQ sample as demo records: question, answers, gold passage, ranked distractors."""
    where = sources()
    for example in nq_examples(CANDIDATES, [MAX_DOCS], ["middle"], seed=0):
        gold = example.gold[0] - 1
        docs = [{**d, "source": where[_key(d["text"])]} for d in example.documents]
        yield {
            "question": example.question,
            "answers": list(example.answers),
            "nq_open_line": int(example.question_id) + 1,
            "gold": docs[gold],
            "distractors": docs[:gold] + docs[gold + 1 :],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=int, default=3, help="questions to keep (default 3)")
    args = parser.parse_args()
    from snapkv_rag import SnapKVLLM
    from snapkv_rag.cli import demo_documents
    from snapkv_rag.methods import LookaheadSnapKVConfig

    llm = SnapKVLLM(snapkv=False, prefix_cache_bytes=0)
    kept = []
    for record in candidates():
        docs, _ = demo_documents(record, DEFAULT_DOCS)
        full = llm.generate(record["question"], docs, max_new_tokens=64, stop=["\n"]).text
        # an answer the question itself holds ("$72" in "how much is a 72 oz steak") proves nothing
        answers = [a for a in record["answers"] if not subspan_exact_match(record["question"], a)]
        ok = best_over(subspan_exact_match, strip_citations(full), answers) == 1.0
        print(ok, record["question"], repr(full), flush=True)
        if not ok:
            continue
        ahead = llm.generate(
            record["question"], docs, max_new_tokens=64, stop=["\n"], snapkv=LookaheadSnapKVConfig(ratio=0.5)
        ).text
        print(f"   lookahead@50%: {ahead!r} ({'same as' if ahead == full else 'differs from'} the full cache)")
        kept.append(record)
        TARGET.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
        if len(kept) == args.keep:
            break
    print(f"wrote {len(kept)} question(s) to {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
