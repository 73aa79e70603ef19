"""Build snapkv_rag/data/demo.jsonl: NQ-open questions, each with its gold passage placed in the
middle of other questions' gold passages (distractors that hold none of its answers).

Run from the repo root with the shared data folder as argument; the output is committed:

    python scripts/make_demo_data.py DATA_DIR [--keep 3]

Candidates are drawn with a fixed seed. We keep the questions that the embedded model answers
correctly under the full cache (about one in fifteen with ten documents), so that the demo shows
what compression keeps rather than what a 135M model cannot do.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
from pathlib import Path

NUM_DOCS = 10
CANDIDATES = 60
TARGET = Path(__file__).resolve().parents[1] / "snapkv_rag" / "data" / "demo.jsonl"


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9 ]", " ", text.lower())).strip()


def candidates(data_dir: Path):
    """The seeded candidate records, each a question with NUM_DOCS documents, gold in the middle."""
    rows = [json.loads(line) for line in gzip.open(data_dir / "nq-open-oracle.jsonl.gz", "rt")]
    rng = random.Random(0)
    for index in rng.sample(range(len(rows)), CANDIDATES):
        row = rows[index]
        answers = [normalise(a) for a in row["answers"]]
        pool = [
            r["ctxs"][0]
            for r in rows
            if r is not row and not any(a and a in normalise(r["ctxs"][0]["text"]) for a in answers)
        ]
        docs = [{"title": c["title"], "text": c["text"]} for c in rng.sample(pool, NUM_DOCS - 1)]
        gold_at = NUM_DOCS // 2
        docs.insert(gold_at, {"title": row["ctxs"][0]["title"], "text": row["ctxs"][0]["text"]})
        yield {"question": row["question"], "answers": row["answers"], "gold_document": gold_at + 1, "documents": docs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--keep", type=int, default=3, help="questions to keep (default 3)")
    args = parser.parse_args()
    from snapkv_rag import SnapKVLLM

    llm = SnapKVLLM(snapkv=False)
    kept = []
    for record in candidates(args.data_dir):
        text = normalise(llm.generate(record["question"], record["documents"], max_new_tokens=32).text)
        ok = any(normalise(a) in text for a in record["answers"])
        print(ok, record["question"], flush=True)
        if ok:
            kept.append(record)
            TARGET.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
        if len(kept) == args.keep:
            break
    print(f"wrote {len(kept)} question(s) to {TARGET.name}")


if __name__ == "__main__":
    main()
