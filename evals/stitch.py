"""Per-document reuse at any position against a full prefill of the same prompt.

    python -m evals.stitch --questions 40 --out evals/results/stitch     # resumable: run it again

Each NQ question is asked over ``--num-docs`` documents (the gold passage in the middle). Every
document's cache is computed once alone (:meth:`~snapkv_rag.SnapKVLLM.reuse_documents`, warmed
before the question is timed, as a store that has seen the documents would hold them) and stitched
into the prompt at its own position there, keys re-rotated, with a share of the reused tokens
recomputed (``--recompute``, CacheBlend-style). Rows per question and recompute share: identical to
the full prefill's answer, token F1 against it, answer F1, citation F1 and the prefill time of each
(the stitched one counts the recompute probe and the prefill of what no document covers). The
summary gives the paired answer-F1 difference against the full prefill with a 95% bootstrap interval.
``--first-token`` measures instead how far each stitched prompt's next-token distribution lies from
the full prefill's (KL divergence, top-token agreement): the direct check that recomputing more
brings the stitched cache closer to the full one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from .datasets import nq_examples
from .metrics import answer_scores, citation_scores, fidelity_scores
from .report import append_rows, bootstrap_ci, finished


def example_rows(llm, example, shares: Sequence[float], max_new_tokens: int) -> list[dict]:
    """The full prefill's row and one row per recompute share for one question."""

    def row(method, share, result, reference, **extra):
        return {
            "id": example.question_id,
            "question": example.question,
            "method": method,
            "recompute": share,
            "text": result.text,
            "prompt_tokens": result.usage.prompt_tokens,
            "prefill_s": result.timings.prefill_s,
            "cached_tokens": result.usage.cached_tokens,
            **fidelity_scores(result.text, reference),
            **answer_scores(result.text, example.answers),
            **citation_scores(result.citations, example.gold),
            **extra,
        }

    full = llm.generate(example.question, example.documents, snapkv=False, max_new_tokens=max_new_tokens)
    rows = [row("full", None, full, full.text)]
    for share in shares:
        handle = llm.reuse_documents(example.documents, recompute=share)
        start = time.perf_counter()
        computed = handle.warm()
        warm_s = time.perf_counter() - start
        result = handle.generate(example.question, max_new_tokens=max_new_tokens)
        rows.append(row("stitched", share, result, full.text, documents_computed=computed, warm_s=warm_s))
    return rows


def run(llm, examples, shares: Sequence[float], out: Path, max_new_tokens: int, progress: bool = True) -> Path:
    """Append each unfinished question's rows to ``out/rows.jsonl`` (resumable by question)."""
    path = out / "rows.jsonl"
    done = finished(path, "id")
    for n, example in enumerate(examples):
        if example.question_id in done:
            continue
        rows = example_rows(llm, example, shares, max_new_tokens)
        append_rows(path, rows)
        if progress:
            print(
                f"question {n + 1}/{len(examples)}: full prefill {rows[0]['prefill_s']:.2f} s, stitched "
                + ", ".join(f"{r['recompute']:.2f}: {r['prefill_s']:.2f} s" for r in rows[1:]),
                flush=True,
            )
    return path


def first_token_rows(llm, examples, shares: Sequence[float], out: Path, progress: bool = True) -> Path:
    """Per question (resumable, ``out/first_token.jsonl``): the KL divergence of each stitched
    prompt's next-token distribution from the full prefill's, and whether their top token agrees."""
    path = out / "first_token.jsonl"
    done = finished(path, "id")
    for n, example in enumerate(examples):
        if example.question_id in done:
            continue
        request = llm.request(example.question, example.documents)
        full = llm.runner.prefill([list(request.input_ids)], {"": None}).logits.double().log_softmax(-1)
        row = {"id": example.question_id, "prompt_tokens": len(request.input_ids)}
        for share in shares:
            handle = llm.reuse_documents(example.documents, recompute=share)
            stitched = handle.next_token_logits(example.question).double().log_softmax(-1)
            row[f"kl@{share}"] = float((full.exp() * (full - stitched)).sum())
            row[f"top1@{share}"] = float(int(full.argmax()) == int(stitched.argmax()))
        append_rows(path, [row])
        if progress:
            print(
                f"question {n + 1}/{len(examples)}: " + ", ".join(f"{s:.2f}: KL {row[f'kl@{s}']:.3f}" for s in shares),
                flush=True,
            )
    return path


def first_token_markdown(rows: Sequence[dict], shares: Sequence[float]) -> str:
    lines = [
        "| recompute | n | KL(full || stitched), mean [95%] | median | top token as full's [95%] |",
        "|---|---|---|---|---|",
    ]
    for share in shares:
        kl, top = (
            [r[f"kl@{share}"] for r in rows if f"kl@{share}" in r],
            [r[f"top1@{share}"] for r in rows if f"top1@{share}" in r],
        )
        if kl:
            (lo, hi), (tlo, thi) = bootstrap_ci(kl), bootstrap_ci(top)
            lines.append(
                f"| {share:.0%} | {len(kl)} | {statistics.mean(kl):.3f} [{lo:.3f}, {hi:.3f}] | "
                f"{statistics.median(kl):.3f} | {statistics.mean(top):.2f} [{tlo:.2f}, {thi:.2f}] |"
            )
    return "\n".join(lines) + "\n"


def summarise(rows: Sequence[dict]) -> list[dict]:
    """Per recompute share: means, identical-to-full with its interval, the paired answer-F1
    difference against the full prefill (95% bootstrap), and the median prefill speed-up."""
    full = {r["id"]: r for r in rows if r["method"] == "full"}
    shares = sorted({r["recompute"] for r in rows if r["method"] == "stitched"})
    out = []
    for share in shares:
        cell = [r for r in rows if r["method"] == "stitched" and r["recompute"] == share and r["id"] in full]
        same = [r["identical_to_full"] for r in cell]
        delta = [r["f1"] - full[r["id"]]["f1"] for r in cell]
        out.append(
            {
                "recompute": share,
                "n": len(cell),
                "identical_to_full": statistics.mean(same),
                "identical_ci": bootstrap_ci(same),
                "f1_vs_full": statistics.mean(r["f1_vs_full"] for r in cell),
                "f1": statistics.mean(r["f1"] for r in cell),
                "full_f1": statistics.mean(full[r["id"]]["f1"] for r in cell),
                "f1_delta": statistics.mean(delta),
                "f1_delta_ci": bootstrap_ci(delta),
                "cit_f1": statistics.mean(r["cit_f1"] for r in cell),
                "full_cit_f1": statistics.mean(full[r["id"]]["cit_f1"] for r in cell),
                "reused_share": statistics.mean(r["cached_tokens"] / r["prompt_tokens"] for r in cell),
                "speedup": statistics.median(full[r["id"]]["prefill_s"] / r["prefill_s"] for r in cell),
            }
        )
    return out


def markdown(records: Sequence[dict]) -> str:
    lines = [
        "| recompute | n | tokens reused | identical to full [95%] | F1 vs full | answer F1 (full) | "
        "answer F1 - full [95%] | citation F1 (full) | prefill speed-up (median) |",
        "|" + "---|" * 9,
    ]
    for r in records:
        (lo, hi), (dlo, dhi) = r["identical_ci"], r["f1_delta_ci"]
        lines.append(
            f"| {r['recompute']:.0%} | {r['n']} | {r['reused_share']:.0%} | {r['identical_to_full']:.2f} "
            f"[{lo:.2f}, {hi:.2f}] | {r['f1_vs_full']:.2f} | {r['f1']:.3f} ({r['full_f1']:.3f}) | "
            f"{r['f1_delta']:+.3f} [{dlo:+.3f}, {dhi:+.3f}] | {r['cit_f1']:.2f} ({r['full_cit_f1']:.2f}) | "
            f"{r['speedup']:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, engine=None) -> int:
    p = argparse.ArgumentParser(prog="python -m evals.stitch", description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--num-docs", type=int, default=10)
    p.add_argument("--recompute", default="0,0.15,0.3", help="shares of the reused tokens recomputed")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--out", type=Path, default=Path("evals/results/stitch"))
    p.add_argument(
        "--first-token",
        action="store_true",
        help="instead: the next-token KL against a full prefill, "
        "per recompute share (first_token.jsonl, first_token.md)",
    )
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    shares = [float(s) for s in args.recompute.split(",")]
    if args.questions < 1 or args.num_docs < 1 or not all(0 <= s <= 1 for s in shares):
        raise SystemExit("--questions >= 1, --num-docs >= 1 and recompute shares between 0 and 1 are needed")
    if engine is None:
        from snapkv_rag import SnapKVLLM

        engine = SnapKVLLM(args.model, prefix_cache_bytes=0)
    examples = nq_examples(args.questions, [args.num_docs], ["middle"], args.seed)
    if args.first_token:
        path = first_token_rows(engine, examples, shares, args.out, not args.no_progress)
        table = first_token_markdown([json.loads(line) for line in path.read_text().splitlines() if line], shares)
        (args.out / "first_token.md").write_text(table)
        print(table)
        return 0
    path = run(engine, examples, shares, args.out, args.max_new_tokens, not args.no_progress)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    table = markdown(summarise(rows))
    (args.out / "summary.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
