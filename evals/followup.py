"""Follow-up questions over one document set: compress the documents once, ask several questions.

    python -m evals.followup --groups 30 --out evals/results/followup     # resumable: run it again

Each group pools the documents of ``--per-group`` NQ questions (``--num-docs`` each: the gold passage
in the middle of its own BM25-ranked distractors) into one set, shuffled by the seed, and asks every
question of the group over the whole set. Per budget (the share of the documents' tokens kept):

- ``full``: the full cache, a prefill per question (the reference of "identical to full");
- ``snapkv``: SnapKV per question (the accuracy reference: every question pays its prefill);
- ``snapkv-q1``: the documents compressed once by SnapKV with question 1 as the observation window,
  then reused for every question of the group (the failure mode of reusing a query-aware cache);
- ``keynorm`` / ``kvzip`` / ``streaming``: query-agnostic, compressed once by
  :meth:`~snapkv_rag.SnapKVLLM.index_documents` and reused; ``keynorm-recent``: key-norm with half
  the budget given to the last documents' tokens (a recency window of ``budget // 2``), since on
  the embedded model the tokens nearest the question carry the answer's start. ``kvzip`` is
  :class:`~snapkv_rag.KVzipConfig`'s default (one budget ranked over every layer and head, 4 sinks,
  no pooling); ``kvzip-head``: the same votes with an even share per head, pooled (its first form);
  ``kvzip-slots``: the default ranking within the bytes of the kept share (``fit="slots"``).

Rows: identical to the full cache, token F1 against it, answer F1, citation F1, time to the first text
piece and the bytes stored. The engine runs without the document prefix cache, so that ``full`` and
``snapkv`` pay their whole prefill as the issue's reference does.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .datasets import nq_examples
from .metrics import answer_scores, citation_scores, fidelity_scores
from .report import append_rows, bootstrap_ci, read_rows

REUSED = ("snapkv-q1", "keynorm", "keynorm-recent", "kvzip-head", "kvzip", "kvzip-slots", "streaming")
METHODS = ("full", "snapkv", *REUSED)


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]  # 1-based numbers of its gold documents in the pooled set


@dataclass(frozen=True)
class Group:
    id: str
    documents: tuple[dict, ...]
    questions: tuple[Question, ...]


def groups(num_groups: int, per_group: int, num_docs: int, seed: int) -> list[Group]:
    """``num_groups`` pooled document sets of ``per_group`` NQ questions each (deterministic for ``seed``)."""
    examples = nq_examples(num_groups * per_group, [num_docs], ["middle"], seed)
    out = []
    for g in range(num_groups):
        members = examples[g * per_group : (g + 1) * per_group]
        pooled, seen = [], set()
        for example in members:
            for doc in example.documents:
                if doc["text"] not in seen:
                    seen.add(doc["text"])
                    pooled.append(doc)
        random.Random(f"{seed}-followup-{g}").shuffle(pooled)
        number = {doc["text"]: i + 1 for i, doc in enumerate(pooled)}
        questions = tuple(
            Question(e.question, e.answers, tuple(number[e.documents[i - 1]["text"]] for i in e.gold)) for e in members
        )
        out.append(Group(f"g{g}-" + "-".join(e.question_id for e in members), tuple(pooled), questions))
    return out


def question_one_set(llm, documents: Sequence[dict], question: str, ratio: float):
    """A document handle whose cache SnapKV chose with ``question`` as the observation window: the
    whole question tail votes (window = tail), ``ceil(ratio x documents' tokens)`` document positions
    are kept per head, and the tail itself is dropped so that any later question can follow."""
    from snapkv_rag import SnapKVConfig
    from snapkv_rag.documents.store import DocumentSet
    from snapkv_rag.documents.stored import Stored, entry_key, identity
    from snapkv_rag.kv import prefix_cache
    from snapkv_rag.kv.prompt_cache import LayerKV

    request = llm.request(question, documents)
    ids = request.input_ids
    at = prefix_cache.boundary(ids, request.spans)
    if at is None:
        raise ValueError("documents: the prompt's question could not be located")
    budget, tail = math.ceil(ratio * at), len(ids) - at
    pre = llm.runner.prefill([list(ids)], {"": SnapKVConfig(max_capacity_prompt=budget + tail, window_size=tail)})
    layers = []
    for kv in pre.compressed[""][0].layers:
        if not isinstance(kv, LayerKV):
            layers.append(None)
            continue
        order = kv.positions.argsort(dim=-1)[..., :budget]  # the tail's positions are the largest
        take = order[..., None].expand(-1, -1, -1, kv.keys.shape[-1])
        layers.append(LayerKV(kv.keys.gather(2, take), kv.values.gather(2, take), kv.positions.gather(2, order)))
    method = SnapKVConfig(max_capacity_prompt=budget, window_size=tail)
    entry = Stored.of(
        entry_key(identity(llm), method, ids[:at]) + "-q1", ids[:at], layers, method, request.documents, llm.instruction
    )
    llm.doc_store.put(entry)
    return DocumentSet(llm, entry)


def handles(llm, group: Group, ratio: float, methods: Sequence[str] = REUSED) -> dict[str, tuple[Any, float]]:
    """Each of ``methods``' handle on ``group``'s documents and the seconds it took to build."""
    from snapkv_rag import KeyNormConfig, KVzipConfig, StreamingLLMConfig
    from snapkv_rag.kv import prefix_cache

    probe = llm.request(group.questions[0].question, group.documents)
    budget = math.ceil(ratio * prefix_cache.boundary(probe.input_ids, probe.spans))
    recent = KeyNormConfig(max_capacity_prompt=budget, window_size=budget // 2)
    makers = {
        "snapkv-q1": lambda: question_one_set(llm, group.documents, group.questions[0].question, ratio),
        "keynorm": lambda: llm.index_documents(group.documents, method=KeyNormConfig(ratio=ratio)),
        "keynorm-recent": lambda: llm.index_documents(group.documents, method=recent),
        "kvzip": lambda: llm.index_documents(group.documents, method=KVzipConfig(ratio=ratio)),
        "kvzip-head": lambda: llm.index_documents(
            group.documents, method=KVzipConfig(ratio=ratio, share="head", sink_tokens=0, kernel_size=7)
        ),
        "kvzip-slots": lambda: llm.index_documents(group.documents, method=KVzipConfig(ratio=ratio, fit="slots")),
        "streaming": lambda: llm.index_documents(group.documents, method=StreamingLLMConfig(ratio=ratio)),
    }
    out = {}
    for name, make in ((n, makers[n]) for n in methods):
        start = time.perf_counter()
        out[name] = (make(), time.perf_counter() - start)
    return out


def ask(llm, question: str, documents, max_new_tokens: int, **options) -> tuple[float, Any]:
    """Seconds to the first text piece, and the finished result."""
    start, first, result = time.perf_counter(), None, None
    for item in llm.stream_result(question, documents, max_new_tokens=max_new_tokens, **options):
        if isinstance(item, str):
            first = first if first is not None or not item else time.perf_counter() - start
        else:
            result = item
    return (first if first is not None else time.perf_counter() - start), result


def group_rows(
    llm,
    group: Group,
    budgets: Sequence[float],
    max_new_tokens: int,
    methods: Sequence[str] = METHODS,
    full: dict[int, str] | None = None,
) -> list[dict]:
    """One group's rows: per question the full cache (unless ``full`` gives its answers), then per
    budget each of ``methods``."""
    from snapkv_rag import SnapKVConfig

    rows, full = [], dict(full or {})

    def row(method, budget, i, ttft, result, reference, **extra):
        q = group.questions[i]
        return {
            "group": group.id,
            "question_index": i,
            "question": q.question,
            "method": method,
            "budget": budget,
            "text": result.text,
            "ttft_s": ttft,
            "prompt_tokens": result.usage.prompt_tokens,
            **fidelity_scores(result.text, reference),
            **answer_scores(result.text, q.answers),
            **citation_scores(result.citations, q.gold),
            **extra,
        }

    for i, q in enumerate(group.questions):
        if i not in full:
            ttft, result = ask(llm, q.question, group.documents, max_new_tokens, snapkv=False)
            full[i] = result.text
            rows.append(row("full", 1.0, i, ttft, result, result.text))
    for budget in budgets:
        for i, q in enumerate(group.questions if "snapkv" in methods else ()):
            ttft, result = ask(llm, q.question, group.documents, max_new_tokens, snapkv=SnapKVConfig(ratio=budget))
            rows.append(row("snapkv", budget, i, ttft, result, full[i]))
        for name, (handle, build_s) in handles(llm, group, budget, [m for m in REUSED if m in methods]).items():
            for i, q in enumerate(group.questions):
                ttft, result = ask(llm, q.question, handle, max_new_tokens)
                rows.append(
                    row(
                        name,
                        budget,
                        i,
                        ttft,
                        result,
                        full[i],
                        build_s=build_s,
                        stored_bytes=handle.kept_bytes,
                        full_bytes=handle.full_bytes,
                    )
                )
    return rows


def run(
    llm,
    todo: Sequence[Group],
    budgets: Sequence[float],
    out: Path,
    max_new_tokens: int,
    progress: bool = True,
    methods: Sequence[str] = METHODS,
) -> Path:
    """Append each group's rows of ``methods`` not yet in ``out/rows.jsonl`` (a group at a time:
    resumable; a method added later runs on the groups already done, over their full answers)."""
    path = out / "rows.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    old = read_rows(path) if path.exists() else []
    for n, group in enumerate(todo):
        mine = [r for r in old if r["group"] == group.id]
        missing = [m for m in methods if m != "full" and not any(r["method"] == m for r in mine)]
        full = {r["question_index"]: r["text"] for r in mine if r["method"] == "full"}
        if not missing and len(full) == len(group.questions):
            continue
        start = time.perf_counter()
        rows = group_rows(
            llm, group, budgets, max_new_tokens, missing, full if len(full) == len(group.questions) else None
        )
        append_rows(path, rows)
        if progress:
            print(
                f"group {n + 1}/{len(todo)} ({len(group.documents)} documents, {rows[0]['prompt_tokens']} tokens): "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
    return path


def summarise(rows: Sequence[dict], later_only: bool = True) -> list[dict]:
    """Per (method, budget): means with 95% bootstrap intervals over the questions (questions 2+
    only by default: question 1 is the one ``snapkv-q1`` was compressed for), and the paired
    difference of identical-to-full against ``snapkv-q1`` at the same budget."""
    rows = [r for r in rows if r["method"] != "full" and (r["question_index"] > 0 or not later_only)]
    by = {}
    for r in rows:
        by.setdefault((r["method"], r["budget"]), {})[(r["group"], r["question_index"])] = r
    out = []
    for (method, budget), cell in sorted(by.items(), key=lambda kv: (kv[0][1], METHODS.index(kv[0][0]))):
        same = [r["identical_to_full"] for r in cell.values()]
        record = {
            "method": method,
            "budget": budget,
            "n": len(cell),
            "identical_to_full": sum(same) / len(same),
            "identical_ci": bootstrap_ci(same),
        }
        for key in ("f1_vs_full", "f1", "cit_f1", "ttft_s"):
            record[key] = sum(r[key] for r in cell.values()) / len(cell)
        stored = [r["stored_bytes"] / r["full_bytes"] for r in cell.values() if "stored_bytes" in r]
        record["stored_fraction"] = sum(stored) / len(stored) if stored else None
        base = by.get(("snapkv-q1", budget), {})
        keys = [k for k in cell if k in base]
        if method != "snapkv-q1" and keys:
            deltas = [cell[k]["identical_to_full"] - base[k]["identical_to_full"] for k in keys]
            record["vs_q1"] = (sum(deltas) / len(deltas), bootstrap_ci(deltas))
        out.append(record)
    return out


def markdown(records: Sequence[dict]) -> str:
    lines = [
        "| method | budget | n | identical to full [95%] | vs snapkv-q1 [95%] | F1 vs full | answer F1 | "
        "citation F1 | first token (s) | stored / full |",
        "|" + "---|" * 10,
    ]
    for r in records:
        lo, hi = r["identical_ci"]
        vs = f"{r['vs_q1'][0]:+.2f} [{r['vs_q1'][1][0]:+.2f}, {r['vs_q1'][1][1]:+.2f}]" if "vs_q1" in r else ""
        stored = f"{r['stored_fraction']:.3f}" if r["stored_fraction"] is not None else ""
        lines.append(
            f"| {r['method']} | {r['budget']:.0%} | {r['n']} | {r['identical_to_full']:.2f} [{lo:.2f}, "
            f"{hi:.2f}] | {vs} | {r['f1_vs_full']:.2f} | {r['f1']:.3f} | {r['cit_f1']:.2f} | "
            f"{r['ttft_s']:.2f} | {stored} |"
        )
    return "\n".join(lines) + "\n"


def readme(rows: Sequence[dict], records: Sequence[dict], command: str, planned: int) -> str:
    """The results folder's README: what ran, the summary table, and the time to the first text
    piece of questions 2+ (median) over each stored set against the full prefill."""
    done = len({r["group"] for r in rows})
    later = [r for r in rows if r["question_index"] > 0]

    def median(method):
        values = sorted(r["ttft_s"] for r in later if r["method"] == method)
        return values[len(values) // 2] if values else None

    full = median("full")
    speed = ", ".join(f"{m} {median(m):.2f} s ({full / median(m):.1f}x sooner)" for m in REUSED if median(m))
    return (
        f"# Follow-up questions over one compressed document set: {done} of {planned} groups\n\n"
        f"`{command}` (resumable; `command.txt`). Each group pools the documents of 3 NQ questions (5 each, "
        "gold in the middle of its own list) into one shuffled set of about 15 documents (~1,800-token prompts); "
        "each question is asked over the whole set on the embedded SmolLM2-135M (CPU, greedy, 32 new tokens, no "
        "prefix cache). The table covers questions 2 and 3 of each group: question 1 is the one `snapkv-q1` was "
        "compressed for. 'vs snapkv-q1' is the paired difference in identical-to-full rate (95% bootstrap). "
        "Methods added after the first groups ran have fewer rows (n).\n\n"
        + markdown(records)
        + f"\nTime to the first text piece of questions 2+, median: full prefill {full:.2f} s; over a stored set "
        f"{speed}. `followup.png` plots the table.\n"
    )


def plot(records: Sequence[dict], path: Path) -> Path:
    """Identical-to-full against the budget per method (95% intervals), and the mean time to the
    first text piece per method: ``path`` (a PNG)."""
    from .plots import plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    for i, method in enumerate(methods):
        cell = sorted((r for r in records if r["method"] == method), key=lambda r: r["budget"])
        xs = [100 * r["budget"] + 1.2 * (i - len(methods) / 2) for r in cell]
        ys = [r["identical_to_full"] for r in cell]
        err = [
            [y - r["identical_ci"][0] for y, r in zip(ys, cell)],
            [r["identical_ci"][1] - y for y, r in zip(ys, cell)],
        ]
        left.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
    left.set_xlabel("documents' tokens kept (%)")
    left.set_ylabel("answer identical to the full cache's")
    left.set_title("questions 2+ of each document set")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    times = {m: [r["ttft_s"] for r in records if r["method"] == m] for m in methods}
    right.bar(range(len(methods)), [sum(t) / len(t) for t in times.values()])
    right.set_xticks(range(len(methods)), methods, rotation=30, fontsize=8)
    right.set_ylabel("time to the first text piece (s, mean)")
    right.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None, engine=None) -> int:
    p = argparse.ArgumentParser(prog="python -m evals.followup", description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=30, help="document sets (default 30)")
    p.add_argument("--per-group", type=int, default=3, help="questions sharing one set (default 3)")
    p.add_argument("--num-docs", type=int, default=5, help="documents per question before pooling (default 5)")
    p.add_argument("--budgets", default="0.25,0.5", help="shares of the documents kept (default 0.25,0.5)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--out", type=Path, default=Path("evals/results/followup"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true", help="write the summary, README and plot from the rows so far")
    p.add_argument(
        "--methods",
        default=",".join(METHODS[1:]),
        help=f"comma-separated, of {', '.join(METHODS[1:])} (default all; the full cache always runs)",
    )
    args = p.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS[1:]]
    if unknown or not methods:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {', '.join(METHODS[1:])}")
    if args.groups < 1 or args.per_group < 2 or args.num_docs < 1 or not all(0 < b < 1 for b in budgets):
        raise SystemExit("--groups >= 1, --per-group >= 2, --num-docs >= 1 and budgets between 0 and 1 are needed")
    if engine is None and not args.report_only:
        from snapkv_rag import SnapKVLLM

        engine = SnapKVLLM(args.model, prefix_cache_bytes=0)
    path = args.out / "rows.jsonl"
    if not args.report_only:
        run(
            engine,
            groups(args.groups, args.per_group, args.num_docs, args.seed),
            budgets,
            args.out,
            args.max_new_tokens,
            not args.no_progress,
            ["full", *methods],
        )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    records = summarise(rows)
    table = markdown(records)
    (args.out / "summary.md").write_text(table)
    plot(records, args.out / "followup.png")
    given = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"]
    command = "python -m evals.followup " + " ".join(given)
    (args.out / "README.md").write_text(readme(rows, records, command.strip(), args.groups))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
