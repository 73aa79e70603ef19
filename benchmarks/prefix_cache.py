"""Time to first token with and without the document prefix cache, in one run.

One set of 5 documents (NQ passages from ``data/nq_passages.jsonl.gz``, joined into 5 documents
until the prompt reaches about ``--tokens`` tokens; the gold passages of the questions asked are
among them) is asked ``--questions`` different questions through the embedded model, greedy,
SnapKV at the default budget. For each question the same request runs on two engines over the
one loaded model, one without the prefix cache and one with it (alternating, the uncached one
first). The first question fills the cache; the 2nd and later reuse the documents' prefill. It
prints per question the time to first token (request to the first text piece) of each, their
ratio (target >= 3x for questions 2-8) and whether the answers are the same, and writes
``results/prefix_cache.json``.

    nice -n 19 python benchmarks/prefix_cache.py            # 8 questions, ~2,000-token prompts
    python benchmarks/prefix_cache.py --quick               # 2 questions, short prompts (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rag_prompts import prompt_tokens, records  # noqa: E402


def document_set(tokenizer, count: int, questions: int, target_tokens: int) -> tuple[list[dict], list[dict]]:
    """``count`` documents and the ``questions`` records whose passages are in them: the gold
    passages first (round robin over the documents), then other passages until ``target_tokens``."""
    pool = records()
    asked = list(pool[:questions])
    parts: list[list[str]] = [[] for _ in range(count)]
    titles = [r["title"] for r in pool[:count]]

    def docs() -> list[dict]:
        return [{"title": titles[i], "text": " ".join(parts[i])} for i in range(count)]

    for i, record in enumerate(asked):
        parts[i % count].append(record["text"])
    for j, record in enumerate(pool[questions:]):
        parts[j % count].append(record["text"])
        if prompt_tokens(tokenizer, asked[0]["question"], docs()) > target_tokens:
            parts[j % count].pop()
            break
    return docs(), asked


def first_token(llm, question: str, documents: list[dict], max_new_tokens: int) -> tuple[float, object]:
    """Seconds from the request to its first text piece, and the finished result."""
    start = time.perf_counter()
    first = None
    result = None
    for item in llm.stream_result(question, documents, max_new_tokens=max_new_tokens):
        if isinstance(item, str):
            if first is None and item:
                first = time.perf_counter() - start
        else:
            result = item
    return (first if first is not None else time.perf_counter() - start), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length to reach (default 2000)")
    parser.add_argument("--questions", type=int, default=8, help="questions over the one document set (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="2 questions, ~400-token prompts, 4 new tokens")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "prefix_cache.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.questions, args.max_new_tokens = 400, 2, 4

    from snapkv_rag import SnapKVLLM
    from snapkv_rag.models import loading

    loaded = loading.load(None)
    plain = SnapKVLLM(model=loaded.model, tokenizer=loaded.tokenizer, prefix_cache_bytes=0)
    cached = SnapKVLLM(model=loaded.model, tokenizer=loaded.tokenizer)
    documents, asked = document_set(loaded.tokenizer, 5, args.questions, args.tokens)
    for llm in (plain, cached):  # warm up, over other documents (nothing of the set is cached)
        llm.generate(
            "Who wrote it?", [{"title": "Warm-up", "text": "A short text written for the warm-up."}], max_new_tokens=2
        )
    rows = []
    for i, record in enumerate(asked, start=1):
        ttft_plain, a = first_token(plain, record["question"], documents, args.max_new_tokens)
        ttft_cached, b = first_token(cached, record["question"], documents, args.max_new_tokens)
        rows.append(
            {
                "question": record["question"],
                "prompt_tokens": a.usage.prompt_tokens,
                "cached_tokens": b.usage.cached_tokens,
                "ttft_s_without": ttft_plain,
                "ttft_s_with": ttft_cached,
                "prefill_s_without": a.timings.prefill_s,
                "prefill_s_with": b.timings.prefill_s,
                "ratio": ttft_plain / ttft_cached,
                "same_answer": a.text == b.text,
                "answer_without": a.text,
                "answer_with": b.text,
            }
        )
        r = rows[-1]
        print(
            f"Q{i} {r['prompt_tokens']} tokens ({r['cached_tokens']} cached): first token {ttft_plain:.3f} s "
            f"without, {ttft_cached:.3f} s with ({r['ratio']:.2f}x); same answer: {r['same_answer']}",
            flush=True,
        )
    summary = {
        "questions": len(rows),
        "documents": len(documents),
        "prompt_tokens": rows[0]["prompt_tokens"],
        "max_new_tokens": args.max_new_tokens,
        "model": Path(cached.model_name).name,
        **later_figures(rows),
        "prefix_cache": vars(cached.prefix_stats()),
        "quick": args.quick,
    }
    print(
        f"questions 2-{len(rows)}: first token {summary['ratio_later_median']:.2f}x sooner with the prefix cache "
        f"(median; least {summary['ratio_later_min']:.2f}x); differing answers: {summary['differing_answers']} "
        f"of {len(rows)}"
    )
    write(args.out, summary, rows)
    return 0


def later_figures(rows: list[dict]) -> dict:
    """Questions 2 and later: the median and least time-to-first-token ratio; answers that differ."""
    later = [r["ratio"] for r in rows[1:]]
    return {
        "ratio_later_median": statistics.median(later) if later else None,
        "ratio_later_min": min(later) if later else None,
        "differing_answers": sum(not r["same_answer"] for r in rows),
    }


def write(out: Path, summary: dict, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
