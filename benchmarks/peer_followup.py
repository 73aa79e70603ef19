"""Follow-up questions beside kvpress: its query-agnostic presses (KVzip, Expected Attention, key
norm) compress a pooled document set once and answer every question of the group over it, on the
very token ids of ``evals.followup``'s rows.

Our half is the follow-up eval's committed rows (``evals/results/followup/rows.jsonl``: per-question
SnapKV, question-1 SnapKV reused, key-norm / KVzip / StreamingLLM stored and reused); this script
rebuilds each finished group's prompts with the same engine, cuts them where the question starts
(the stored prefix), and asks the kvpress worker (its own venv, ``kvpress_worker.py``, a
``"tails"`` request) for each press at each budget: the context prefilled once under the press,
each question's tail run over it and answered greedily (``--max-new-tokens`` as the eval's). Each
side is scored against its own full cache (kvpress: the same request with no press). Printed and
written to ``OUT/summary.md``: per budget and method, identical to full over questions 2+ with a
95% bootstrap interval, and each kvpress press's paired difference from our best reused method.

    python benchmarks/peer_followup.py --out benchmarks/results/peer_followup      # resumable
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from peer_kvpress import KVPressWorker  # noqa: E402

from evals.followup import groups  # noqa: E402
from evals.metrics import fidelity_scores  # noqa: E402
from evals.report import bootstrap_ci  # noqa: E402

PRESSES = ("kvzip", "expected_attention", "knorm")


def our_rows(path: Path) -> dict:
    """The eval's rows by (group, question, method, budget)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["group"], r["question_index"], r["method"], r["budget"]): r for r in rows}


def peer_rows(llm, worker, group, budgets, max_new_tokens: int, eos) -> list[dict]:
    """kvpress's rows of one group: its full cache, then each press at each budget."""
    from snapkv_rag.kv import prefix_cache

    requests = [llm.request(q.question, group.documents) for q in group.questions]
    at = prefix_cache.boundary(requests[0].input_ids, requests[0].spans)
    context = requests[0].input_ids[:at]
    if any(r.input_ids[:at] != context for r in requests):
        raise RuntimeError(f"{group.id}: the questions' prompts do not share their documents' tokens")
    base = {
        "context_ids": context,
        "tails": [r.input_ids[at:] for r in requests],
        "max_new_tokens": max_new_tokens,
        "eos_ids": eos,
    }
    runs = [("full", None, 1.0, at)] + [(p, p, b, math.ceil(b * at)) for b in budgets for p in PRESSES]
    out, full = [], None
    for name, press, budget, kept in runs:
        answer = worker.ask({**base, "press": press, "budget": kept})
        texts = [llm.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in answer["answers"]]
        full = texts if full is None else full
        for i, text in enumerate(texts):
            out.append(
                {
                    "group": group.id,
                    "question_index": i,
                    "method": f"kvpress:{name}",
                    "budget": budget,
                    "text": text,
                    "first_token_s": answer["first_token_s"][i],
                    "build_s": answer["build_s"],
                    "kept": answer["kept"],
                    "context_tokens": at,
                    **fidelity_scores(text, full[i]),
                }
            )
    return out


def summary(ours: dict, peers: list[dict], budgets) -> str:
    """Identical to full over questions 2+, both halves, and kvpress's paired differences."""
    cells: dict[tuple, dict] = defaultdict(dict)
    done = {r["group"] for r in peers}
    for (group, i, method, budget), r in ours.items():
        if group in done and i > 0 and method != "full":
            cells[(budget, f"ours:{method}")][(group, i)] = r["identical_to_full"]
    for r in peers:
        if r["question_index"] > 0 and r["method"] != "kvpress:full":
            cells[(r["budget"], r["method"])][(r["group"], r["question_index"])] = r["identical_to_full"]
    agree = [
        r["text"] == ours[(r["group"], r["question_index"], "full", 1.0)]["text"]
        for r in peers
        if r["method"] == "kvpress:full"
    ]
    lines = [
        f"# Follow-up questions beside kvpress: {len(done)} groups, questions 2+ of each",
        "",
        f"The two full caches (ours, kvpress's transformers) give the same answer on {sum(agree)} of {len(agree)} "
        "questions. Each side against its own full cache. 'vs best ours' is the paired difference from our best reused "
        "(query-agnostic or question-1) method at that budget, 95% bootstrap.",
        "",
        "| budget | method | n | identical to full [95%] | vs best ours [95%] |",
        "|---|---|---|---|---|",
    ]
    for budget in budgets:
        reused = {m: c for (b, m), c in cells.items() if b == budget and m.startswith("ours:") and m != "ours:snapkv"}
        best = max(reused, key=lambda m: sum(reused[m].values()) / len(reused[m])) if reused else None
        for (b, method), cell in sorted(cells.items()):
            if b != budget:
                continue
            values = list(cell.values())
            lo, hi = bootstrap_ci(values)
            vs = ""
            if best and method.startswith("kvpress:"):
                deltas = [cell[k] - reused[best][k] for k in cell if k in reused[best]]
                dlo, dhi = bootstrap_ci(deltas)
                vs = f"{sum(deltas) / len(deltas):+.2f} [{dlo:+.2f}, {dhi:+.2f}] ({best})"
            lines.append(
                f"| {budget:.0%} | {method} | {len(values)} | {sum(values) / len(values):.2f} "
                f"[{lo:.2f}, {hi:.2f}] | {vs} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvpress-python", default=str(HERE / ".venv-kvpress" / "bin" / "python"))
    parser.add_argument("--ours", type=Path, default=HERE.parent / "evals" / "results" / "followup" / "rows.jsonl")
    parser.add_argument("--groups", type=int, default=30, help="the eval's --groups (its seeded sample)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--limit", type=int, default=None, help="stop after this many new groups")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "peer_followup")
    args = parser.parse_args()

    from snapkv_rag import SnapKVLLM
    from snapkv_rag.models.loading import default_model_dir

    ours = our_rows(args.ours)
    finished = {key[0] for key in ours}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rows.jsonl"
    peers = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    done = {r["group"] for r in peers}
    model_dir = str(default_model_dir())
    llm = SnapKVLLM(model_dir, prefix_cache_bytes=0)
    eos_config = llm.model.generation_config.eos_token_id
    eos = sorted(
        {llm.tokenizer.eos_token_id, *([eos_config] if isinstance(eos_config, int) else eos_config or [])} - {None}
    )
    todo = [g for g in groups(args.groups, 3, 5, 0) if g.id in finished and g.id not in done][: args.limit]
    worker = KVPressWorker(args.kvpress_python, model_dir, None) if todo else None  # none: the summary only
    try:
        for group in todo:
            rows = peer_rows(llm, worker, group, args.budgets, args.max_new_tokens, eos)
            with path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            peers += rows
            print(f"{group.id}: done", flush=True)
    finally:
        if worker is not None:
            worker.close()
    text = summary(ours, peers, args.budgets)
    (args.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
