"""Run examples through ``SnapKVLLM.compare`` (one shared prefill per prompt) and checkpoint rows.

``rows.jsonl`` gets one row per (example, method), written as the run goes: all rows of one
example in a single write, flushed and fsync'ed. A run that is killed and started again with the
same ``--out`` reads the file back, drops a torn last line and any example whose rows are
incomplete, and runs only what is missing, so no row is lost or doubled. ``run.json`` records the
settings that change the answers; resuming with different ones is refused rather than mixed.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from statistics import mean
from typing import Any

from .datasets import DATASETS, Example
from .methods import MethodSpec, configs_for_cell
from .metrics import answer_scores, citation_scores, fidelity_scores

ROWS = "rows.jsonl"
SETTINGS = "run.json"
_SETTINGS_KEYS = (
    "model",
    "instruction",
    "max_new_tokens",
    "stop",
    "seed",
    "dtype",
    "citations",
    "quantize",
    "kv_dtype",
)
# a record without gold documents (--data without 'gold', needle, lines): citations are not scored
NO_CITATION_SCORES = {"cit_precision": None, "cit_recall": None, "cit_f1": None}


def prompt_tokens(llm: Any, example: Example) -> int:
    """The prompt length exactly as the engine will tokenise it (chat template included)."""
    return llm.prompt_tokens(example.question, list(example.documents))


def cell_key(example: Example) -> tuple[str, int, str]:
    return example.dataset, example.num_docs, example.gold_position


def plan_budgets(
    llm: Any, examples: Sequence[Example], specs: Sequence[MethodSpec], max_new_tokens: int
) -> tuple[dict[str, int], dict[tuple, tuple[dict, dict, float]]]:
    """Prompt lengths of every example and, per cell, the compare() methods and their budgets."""
    lengths = {e.id: prompt_tokens(llm, e) for e in examples}
    limit = llm.context_window
    for e in examples:
        if lengths[e.id] + max_new_tokens > limit:
            raise ValueError(
                f"{e.id}: the prompt is {lengths[e.id]} tokens, over the model's context window of "
                f"{limit} with {max_new_tokens} new tokens; use a smaller --num-docs for this model"
            )
    cells: dict[tuple, list[int]] = defaultdict(list)
    for e in examples:
        cells[cell_key(e)].append(lengths[e.id])
    plans = {}
    for key, values in cells.items():
        configs, budgets = configs_for_cell(specs, mean(values))
        plans[key] = (configs, budgets, mean(values))
    return lengths, plans


def run_order(examples: Sequence[Example]) -> list[Example]:
    """Question-major and interleaved across datasets: a run stopped early still covers every cell
    with the same questions (useful when the full grid does not fit the time available)."""
    rank: dict[tuple[str, str], int] = {}
    dataset_rank = {d: i for i, d in enumerate(DATASETS)}  # built-ins first, then in order of appearance
    for e in examples:
        rank.setdefault((e.dataset, e.question_id), sum(1 for d, _ in rank if d == e.dataset))
        dataset_rank.setdefault(e.dataset, len(dataset_rank))
    indexed = list(enumerate(examples))
    indexed.sort(
        key=lambda item: (rank[(item[1].dataset, item[1].question_id)], dataset_rank[item[1].dataset], item[0])
    )
    return [e for _, e in indexed]


def load_rows(path: Path, method_names: Sequence[str]) -> dict[str, list[dict]]:
    """Complete examples already in ``rows.jsonl`` (by example id); rewrites the file without a torn
    last line or incomplete examples so that appending continues cleanly."""
    if not path.exists():
        return {}
    raw = path.read_bytes()
    rows, dirty = [], False
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            dirty = True  # a line torn by a kill: its example is rerun
    by_example: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_example[row["example_id"]].append(row)
    wanted = set(method_names)
    complete = {k: v for k, v in by_example.items() if {r["method"] for r in v} == wanted and len(v) == len(wanted)}
    if dirty or len(complete) != len(by_example) or (raw and not raw.endswith(b"\n")):
        tmp = path.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for v in complete.values():
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in v)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return complete


def check_settings(out: Path, settings: dict, resume: bool) -> None:
    path = out / SETTINGS
    if resume and path.exists():
        old = json.loads(path.read_text())
        changed = [k for k in _SETTINGS_KEYS if old.get(k) != settings.get(k)]
        if changed:
            raise ValueError(
                f"{out} holds a run with different {', '.join(changed)} "
                f"({', '.join(f'{k}={old.get(k)!r}' for k in changed)}): use another --out, or --no-resume "
                f"to start it over"
            )
    elif not resume and (out / ROWS).exists():
        (out / ROWS).unlink()
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def example_rows(
    example: Example, comparison: Any, budgets: dict[str, int], mean_tokens: float, settings: dict
) -> list[dict]:
    full = comparison.results["full"]
    rows = []
    for name, result in comparison.results.items():
        c = result.compression
        row = {
            "example_id": example.id,
            "dataset": example.dataset,
            "question_id": example.question_id,
            "num_docs": example.num_docs,
            "gold_position": example.gold_position,
            "method": name,
            "budget": budgets.get(name),
            "cell_mean_prompt_tokens": round(mean_tokens, 1),
            "question": example.question,
            "answers": list(example.answers),
            "gold_docs": list(example.gold),
            "text": result.text,
            "citations": result.citations,
            "finish_reason": result.finish_reason,
            **answer_scores(result.text, example.answers),
            **(citation_scores(result.citations, example.gold) if example.gold else NO_CITATION_SCORES),
            **fidelity_scores(result.text, full.text),
            "hit_rate": 1.0 if name == "full" else comparison.hit_rate.get(name),
            "prompt_tokens": result.usage.prompt_tokens,
            "completion_tokens": result.usage.completion_tokens,
            "kept_tokens": mean(c.kept_tokens),
            "kv_bytes_kept": c.kv_bytes_kept,
            "kv_bytes_full": c.kv_bytes_full,
            "kv_ratio": c.ratio,
            "selection_ms": c.selection_ms,
            "prefill_s": comparison.prefill_s,
            "decode_ms_per_token": result.timings.decode_ms_per_token,
            "model": settings["model"],
        }
        if settings.get("citations") == "json":  # the cited-answer mode: text and citations come from the JSON
            row.update(raw_text=result.raw_text, json_complete=result.parsed is not None)
        rows.append(row)
    return rows


def pending(
    llm: Any,
    examples: Sequence[Example],
    specs: Sequence[MethodSpec],
    out: Path,
    *,
    settings: dict,
    max_new_tokens: int,
    resume: bool = True,
) -> tuple[Path, list[Example], dict]:
    """Check the settings against ``out``, read back the finished rows and plan the budgets: the rows
    path, the examples still to run (in run order) and the per-cell plans."""
    out.mkdir(parents=True, exist_ok=True)
    check_settings(out, settings, resume)
    path = out / ROWS
    done = load_rows(path, [s.name for s in specs]) if resume else {}
    _, plans = plan_budgets(llm, examples, specs, max_new_tokens)
    return path, [e for e in run_order(examples) if e.id not in done], plans


def append_rows(f, rows: Sequence[dict]) -> None:
    """All rows of one example in a single write, flushed and fsync'ed: a kill tears at most this write."""
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    f.flush()
    os.fsync(f.fileno())


def run(
    llm: Any,
    examples: Sequence[Example],
    specs: Sequence[MethodSpec],
    out: Path,
    *,
    settings: dict,
    max_new_tokens: int,
    stop: Sequence[str],
    resume: bool = True,
    progress: bool = True,
) -> Path:
    """Run every example not yet in ``out/rows.jsonl``; returns the rows path. ``settings["citations"]``
    ``"json"`` runs the engine's cited-answer mode (``cite="json"``); ``settings["batch_methods"]`` decodes a
    prompt's methods as rows of one batch."""
    path, todo, plans = pending(
        llm, examples, specs, out, settings=settings, max_new_tokens=max_new_tokens, resume=resume
    )
    bar = _progress(len(examples), len(examples) - len(todo), progress)
    with path.open("a", encoding="utf-8") as f:
        for example in todo:
            configs, budgets, mean_tokens = plans[cell_key(example)]
            comparison = llm.compare(
                example.question,
                list(example.documents),
                methods=configs,
                hit_rate=True,
                max_new_tokens=max_new_tokens,
                stop=list(stop),
                cite=settings.get("citations") or "text",
                together=bool(settings.get("batch_methods")),
            )
            append_rows(f, example_rows(example, comparison, budgets, mean_tokens, settings))
            bar.update(1)
    bar.close()
    return path


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="prompt",
        desc="evals",
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        smoothing=0.05,
    )
