"""Build snapkv_rag/data/demo.jsonl: a few NQ-open questions, each with its gold passage placed in
the middle of 9 other questions' gold passages (distractors that hold none of its answers).

Run once from the repo root with the shared data folder as argument; the output is committed.
We keep questions on which the embedded model answers correctly under the full cache (about one in
five), so the demo shows what compression keeps rather than what a 135M model cannot do.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import sys
from pathlib import Path

NUM_DOCS = 10
CANDIDATES = 60


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9 ]", " ", text.lower())).strip()


def main(data_dir: str, keep: int = 3) -> None:
    from snapkv_rag import SnapKVConfig, SnapKVLLM

    rows = [json.loads(line) for line in gzip.open(Path(data_dir) / "nq-open-oracle.jsonl.gz", "rt")]
    rng = random.Random(0)
    picks = rng.sample(range(len(rows)), CANDIDATES)
    llm = SnapKVLLM()
    out = []
    for index in picks:
        row = rows[index]
        answers = [normalise(a) for a in row["answers"]]
        pool = [r["ctxs"][0] for r in rows if r is not row
                and not any(a and a in normalise(r["ctxs"][0]["text"]) for a in answers)]
        docs = [{"title": c["title"], "text": c["text"]} for c in rng.sample(pool, NUM_DOCS - 1)]
        gold_at = NUM_DOCS // 2
        docs.insert(gold_at, {"title": row["ctxs"][0]["title"], "text": row["ctxs"][0]["text"]})
        both = llm.compare(row["question"], docs, methods={"full": None, "snapkv": SnapKVConfig(max_capacity_prompt=256)},
                           hit_rate=False, max_new_tokens=32)
        texts = {name: normalise(r.text) for name, r in both.results.items()}
        ok = any(a in texts["full"] for a in answers)
        print(ok, row["question"], {k: r.text for k, r in both.results.items()}, flush=True)
        if ok:
            out.append({"question": row["question"], "answers": row["answers"], "gold_document": gold_at + 1,
                        "documents": docs})
        if len(out) == keep:
            break
    target = Path(__file__).resolve().parents[1] / "snapkv_rag" / "data" / "demo.jsonl"
    target.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    print(f"wrote {len(out)} questions to {target.name}")


if __name__ == "__main__":
    main(sys.argv[1])
