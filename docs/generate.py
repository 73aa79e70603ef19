"""Every results table and figure of the docs, made from the committed result files.

    python -m docs.generate            # writes docs/generated/*.md, plots.json and *.png
    python -m docs.generate --check    # exit 1, naming the files, when a committed one is stale

Tables come from ``evals/results/`` and ``benchmarks/results/`` (rows, summaries and benchmark
JSON), through the project's own report code where it has some (``evals.report``,
``evals.followup``, ``benchmarks/gpu_report.py``, ``benchmarks/load_report.py``). Figures are drawn
by ``evals.plots`` from the values in ``generated/plots.json``, which holds exactly what each figure
shows: ``tests/test_docs.py`` compares the Markdown and that file with what this script makes now,
so a result file changed without regenerating fails there. A PNG is drawn again only when its values
changed or the file is missing (``--force``: always), so rerunning does not churn the pictures.

The server's OpenAPI page is not made here: ``docs/conf.py`` calls :func:`write_openapi` at every
build (the routes belong to the server code, not to a result file).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "generated"
BENCH = ROOT / "benchmarks" / "results"
EVALS = ROOT / "evals" / "results"

for path in (ROOT, ROOT / "benchmarks"):  # evals.*, and the benchmark scripts' own report modules
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

COMMAND = "python -m docs.generate"


def _header(*sources: str) -> str:
    files = ", ".join(f"`{s}`" for s in sources)
    return f"<!-- made by `{COMMAND}` from {files}: edit the result files or the script, not this file -->\n\n"


def _source(*sources: str) -> str:
    return "\n\nSource: " + ", ".join(f"`{s}`" for s in sources) + ".\n"


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _round(value, digits: int = 4):
    """Plot values as stored in plots.json: rounded, so that the file reads the same everywhere."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: _round(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round(v, digits) for v in value]
    return value


# --- evals -------------------------------------------------------------------------------------


@functools.cache
def _eval_records(folder: Path, keys: tuple[str, ...]) -> tuple[list[dict], list[str]]:
    """Aggregated records of a committed eval run (its rows.jsonl, or those of its subfolders), as
    ``python -m evals --report-only`` computes them, and the run's methods in report order."""
    from evals.ordering import method_order
    from evals.report import add_paired_deltas, aggregate, collect_rows

    rows = collect_rows(folder)
    add_paired_deltas(rows)
    return aggregate(rows, keys), method_order(rows)


EVAL_COLUMNS = ("f1", "f1_minus_full", "identical_to_full", "f1_vs_full", "hit_rate", "kv_bytes_kept")
PLOT_KEYS = ("dataset", "num_docs", "method", "panel")


def _plot_records(records: Sequence[dict], metrics: Sequence[str]) -> list[dict]:
    keep = set(PLOT_KEYS) | {m + suffix for m in metrics for suffix in ("", "_lo", "_hi")}
    return [_round({k: v for k, v in r.items() if k in keep}) for r in records]


def evals_by_n(tables: dict, figures: dict) -> None:
    """The committed CPU run: answer F1 and fidelity to the full cache against the number of documents."""
    from evals.report import markdown_table

    by_n, methods = _eval_records(EVALS / "cpu-2core", ("dataset", "num_docs", "method"))
    source = "evals/results/cpu-2core/*/rows.jsonl"
    tables["evals_by_n.md"] = (
        _header(source) + "Means over every gold position with 95% bootstrap intervals; 'F1 - full F1' is the paired "
        "difference on the same prompts; 'same as full' and 'F1 vs full' compare with the full cache's "
        "own answer; KV MB is the kept prompt cache per prompt.\n\n"
        + markdown_table(by_n, ("dataset", "num_docs", "method"), EVAL_COLUMNS)
        + _source(source, "evals/results/cpu-2core/README.md")
    )
    for metric, ylabel, name in (
        ("f1", "answer token F1", "evals_f1_vs_n.png"),
        ("f1_vs_full", "answer F1 vs full-cache answer", "evals_fidelity_vs_n.png"),
    ):
        figures[name] = {
            "kind": "against_n",
            "metric": metric,
            "ylabel": ylabel,
            "methods": methods,
            "records": _plot_records(by_n, [metric]),
        }


def evals_methods(tables: dict, figures: dict) -> None:
    """The method grid: every method at 25% and 50%, fidelity paired against SnapKV at the same budget."""
    from evals.plots import METRIC_LABELS
    from evals.report import AGAINST_SNAPKV, markdown_table

    overall, _ = _eval_records(EVALS / "methods", ("dataset", "method"))
    source = "evals/results/methods/*/rows.jsonl"
    tables["evals_methods.md"] = (
        _header(source)
        + "Every method on the same prompts (NQ N=10 and 20 pooled, HotpotQA N=10, 25-key KV retrieval), "
        "fidelity to the full cache's answer and its paired difference from SnapKV at the same budget "
        "(95% bootstrap intervals); KV MB is what each keeps per prompt.\n\n"
        + markdown_table([r for r in overall if r["method"] != "full"], ("dataset", "method"), AGAINST_SNAPKV)
        + _source(source, "evals/results/methods/README.md")
    )
    by_n, _ = _eval_records(EVALS / "methods", ("dataset", "num_docs", "method"))
    panels = [{**r, "panel": f"{r['dataset']}, N={r['num_docs']}"} for r in by_n]
    figures["evals_fidelity_vs_budget.png"] = {
        "kind": "against_budget",
        "metric": "identical_to_full",
        "ylabel": METRIC_LABELS["identical_to_full"],
        "records": _plot_records(panels, ["identical_to_full"]),
    }


def evals_followup(tables: dict, figures: dict) -> None:
    """Follow-up questions over one compressed document set (``python -m evals.followup``)."""
    from evals.followup import markdown, summarise
    from evals.report import read_rows

    source = "evals/results/followup/rows.jsonl"
    records = summarise(read_rows(EVALS / "followup" / "rows.jsonl"))
    tables["evals_followup.md"] = (
        _header(source)
        + "Questions 2 and 3 of each group of NQ questions over their pooled documents, answered from one "
        "compressed set; 'vs snapkv-q1' is the paired difference from reusing question 1's SnapKV cache "
        "(95% bootstrap).\n\n" + markdown(records) + _source(source, "evals/results/followup/README.md")
    )


# --- benchmarks: quality against kvpress ----------------------------------------------------------


def _ci(value: float, ci: Sequence[float], signed: bool = False) -> str:
    sign = "+" if signed else ""
    return f"{value:{sign}.2f} [{ci[0]:{sign}.2f}, {ci[1]:{sign}.2f}]"


def peer_presses(tables: dict, figures: dict) -> None:
    """Our methods and kvpress's presses on the very same token ids and budgets, all 300 prompts."""
    import peer_presses as peer

    source = "benchmarks/results/peer_presses/summary.json"
    summary = _json(BENCH / "peer_presses" / "summary.json")
    lines = [
        "| kept | method | n | identical to full | vs our SnapKV | F1 vs full | vs our SnapKV |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary["table"]:
        if r["set"] != "all" or r["n"] < summary["prompts"]:  # methods tried on a few prompts only
            continue
        reference = r["method"].split("@")[0] == peer.BASELINE
        vs = (
            ("(reference)", "(reference)")
            if reference
            else (
                _ci(r["identical_to_full_vs_snapkv"], r["identical_to_full_vs_snapkv_ci"], signed=True),
                _ci(r["f1_vs_full_vs_snapkv"], r["f1_vs_full_vs_snapkv_ci"], signed=True),
            )
        )
        lines.append(
            f"| {r['share']} | {r['method']} | {r['n']} | {_ci(r['identical_to_full'], r['identical_to_full_ci'])} "
            f"| {vs[0]} | {_ci(r['f1_vs_full'], r['f1_vs_full_ci'])} | {vs[1]} |"
        )
    tables["peer_presses.md"] = (
        _header(source)
        + f"{summary['prompts']} prompts (NQ N=10, NQ N=20, HotpotQA; 100 each); the two full caches agree on "
        f"{summary['full_caches_agree']} of {summary['prompts']}. Each side is scored against its own full "
        "cache; 95% bootstrap intervals, 'vs our SnapKV' paired on the same prompts.\n\n"
        + "\n".join(lines)
        + _source(source, "benchmarks/results/peer_presses/summary.md")
    )
    sets = ("nq (N=10 and 20)", "hotpotqa")
    prompts = {s: max((r["n"] for r in summary["table"] if r["set"] == s), default=0) for s in sets}
    records = [
        {
            "method": r["method"],
            "panel": f"{r['set']}, {prompts[r['set']]} prompts",
            "identical_to_full": r["identical_to_full"],
            "identical_to_full_lo": r["identical_to_full_ci"][0],
            "identical_to_full_hi": r["identical_to_full_ci"][1],
        }
        for r in summary["table"]
        if r["set"] in sets and r["method"].split("@")[0] in peer.PLOTTED
    ]
    figures["peer_presses_fidelity_vs_budget.png"] = {
        "kind": "against_budget",
        "metric": "identical_to_full",
        "ylabel": "fidelity (same answer as the full cache)",
        "dashed_prefix": "kvpress:",
        "records": _round(records),
    }


def peer_kvpress(tables: dict, figures: dict) -> None:
    source = "benchmarks/results/peer_kvpress.json"
    data = _json(BENCH / "peer_kvpress.json")
    s = data["summary"]
    ratios = [r["time_ratio_ours_over_kvpress"] for r in data["rows"]]
    tables["peer_kvpress.md"] = (
        _header(source)
        + "| prompts | prompt tokens | kept per layer | identical answers | time per answer, ours / kvpress (median; range) |\n"
        "|---|---|---|---|---|\n"
        f"| {s['prompts']} | {data['rows'][0]['prompt_tokens']} | {data['budget']} | "
        f"{s['identical_share']:.0%} | {s['time_ratio_ours_over_kvpress_median']:.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}) |" + _source(source)
    )


# --- benchmarks: speed and memory ---------------------------------------------------------------


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f}"


def cpu_decode(tables: dict, figures: dict) -> None:
    """Decode speed per prompt size (the idle run) beside peak memory (the run with per-method processes)."""
    idle, full = _json(BENCH / "cpu_decode_idle.json"), _json(BENCH / "cpu_decode.json")
    peaks = {r["size"]: r["methods"] for r in full["rows"]}
    budgets = idle["budgets"]
    head = ["prompt tokens", "full ms/token"]
    for b in budgets:
        head += [f"SnapKV@{b}", "speedup"]
    head += [
        "KV cache full / " + " / ".join(f"@{b}" for b in budgets) + " MiB",
        f"peak memory full / @{budgets[0]} MiB",
        f"selection share of prefill @{budgets[0]}",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in idle["rows"]:
        m = row["methods"]
        cells = [str(row["prompt_tokens"]), f"{m['full']['decode_ms_per_token']:.1f}"]
        for b in budgets:
            e = m[f"snapkv@{b}"]
            cells += [f"{e['decode_ms_per_token']:.1f}", f"{e['speedup_vs_full']:.2f}x"]
        cells.append(" / ".join(_mib(m[k]["kv_bytes_kept"]) for k in ["full", *(f"snapkv@{b}" for b in budgets)]))
        peak = peaks.get(row["size"], {})
        cells.append(
            " / ".join(f"{peak[k]['peak_rss_delta_mib']:.0f}" for k in ("full", f"snapkv@{budgets[0]}"))
            if all("peak_rss_delta_mib" in peak.get(k, {}) for k in ("full", f"snapkv@{budgets[0]}"))
            else "-"
        )
        cells.append(f"{100 * m[f'snapkv@{budgets[0]}']['selection_share_of_prefill']:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    tables["cpu_decode.md"] = (
        _header("benchmarks/results/cpu_decode_idle.json", "benchmarks/results/cpu_decode.json")
        + f"{idle['model']}, fp32, {idle['threads']} threads, {idle['max_new_tokens']} new tokens: `{idle['command']}` "
        f"(one shared prefill per prompt, then each method decoded in turn). Peak memory above the loaded "
        f"model: `{full['command']}` (one process per method and size).\n\n"
        + "\n".join(lines)
        + _source("benchmarks/results/cpu_decode_idle.json", "benchmarks/results/cpu_decode.json")
    )


def cpu_switches(tables: dict, figures: dict) -> None:
    """``compile=True`` and ``prefill_chunk``: one run each."""
    compiled, sliced = _json(BENCH / "compiled_decode.json"), _json(BENCH / "prefill_memory.json")
    lines = [
        "| switch | prompt tokens | method | off | on | ratio | same answers |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in compiled["rows"]:
        lines.append(
            f"| `compile=True` (decode ms/token) | {r['prompt_tokens']} | {r['method']} | "
            f"{r['plain_ms_per_token']:.0f} | {r['compiled_ms_per_token']:.0f} | {r['speedup']:.2f}x faster | "
            f"{'yes' if r['answers_identical'] else 'no'} |"
        )
    for r in sliced["rows"]:
        whole, part = r["whole"], r["sliced"]
        lines.append(
            f"| `prefill_chunk={part['prefill_chunk']}` (peak MiB) | {whole['prompt_tokens']} | {r['method']} | "
            f"{whole['peak_rss_delta_mib']:.0f} | {part['peak_rss_delta_mib']:.0f} | "
            f"{part['peak_rss_delta_mib'] / whole['peak_rss_delta_mib']:.2f}x | - |"
        )
    sources = ("benchmarks/results/compiled_decode.json", "benchmarks/results/prefill_memory.json")
    tables["cpu_switches.md"] = (
        _header(*sources)
        + f"`{compiled['command']}` and `{sliced['command']}`, the embedded model on the CPU.\n\n"
        + "\n".join(lines)
        + _source(*sources)
    )


def _store_row(name: str, data: dict, ratio_label: str) -> str:
    s = data["summary"]
    share = f"{s['stored_share']:.3f}" if "stored_share" in s else "whole"
    return (
        f"| {name} | {s['model']} | {s['documents']} x {s['questions']} | {s['prompt_tokens']} | "
        f"{s['ratio_later_median']:.1f}x ({s['ratio_later_min']:.1f}x) {ratio_label} | {share} | "
        f"{s['differing_answers']} of {s['questions']} |"
    )


def documents(tables: dict, figures: dict) -> None:
    """The document prefix cache and the compressed document store: time to the first token."""
    sources = (
        "benchmarks/results/prefix_cache.json",
        "benchmarks/results/doc_store.json",
        "benchmarks/results/doc_store_lfm2.json",
    )
    prefix, store, lfm2 = (_json(ROOT / s) for s in sources)
    tables["documents.md"] = (
        _header(*sources)
        + "| benchmark | model | documents x questions | prompt tokens | questions 2+ reach the first token, "
        "median (least) | cache kept / full bytes | answers differing |\n|---|---|---|---|---|---|---|\n"
        + "\n".join(
            (
                _store_row("`prefix_cache.py`", prefix, "sooner than without the cache"),
                _store_row("`doc_store.py` (key norm, 50%)", store, "sooner than a full prefill"),
                _store_row("`doc_store.py --family lfm2` (random weights)", lfm2, "sooner than a full prefill"),
            )
        )
        + "\n\nAnswers differing: the prefix cache's against the same engine without it; the stored set's "
        "against compressing each whole prompt with the same method (a different cache, by design)." + _source(*sources)
    )


def load(tables: dict, figures: dict) -> None:
    import load_report

    source = "benchmarks/results/load/load.json"
    tables["load.md"] = _header(source) + load_report.markdown(_json(ROOT / source)) + _source(source)


GPU = BENCH / "gpu-h200-3"
GPU_METHODS = {
    "full": "full cache, eager",
    "snapkv": "SnapKV@1024, eager",
    "full_compiled": "full cache, CUDA graph",
    "snapkv_compiled": "SnapKV@1024, CUDA graph",
}


def gpu(tables: dict, figures: dict) -> None:
    """The standing GPU check's benchmark on an H200 (random-weight Llama-2-7B shape, bf16)."""
    import gpu_report

    decode, concurrent, check = (_json(GPU / n) for n in ("gpu_decode.json", "gpu_concurrent.json", "gpu_check.json"))
    steps = ", ".join(f"{name} {step['status']}" for name, step in check["steps"].items())
    sources = [f"benchmarks/results/gpu-h200-3/{n}" for n in ("gpu_decode.json", "gpu_concurrent.json")]
    tables["gpu.md"] = (
        _header(*sources, "benchmarks/results/gpu-h200-3/gpu_check.json")
        + f"{decode['device']}, {decode['dtype']}, torch {decode['torch']}, transformers {check['transformers']}; "
        f"SnapKV keeps {decode['budget']} positions per layer and head. ms/token is the decode step "
        "(x its memory-bandwidth floor); 'speedup / ceiling' is full over SnapKV beside the most the floors "
        f"allow; peak GiB is the device's peak allocation. The check's steps: {steps}.\n\n"
        "**Long prompts, batch 1 and 2:**\n\n"
        + gpu_report.table(decode)
        + "\n\n**Concurrent 4K-token requests:**\n\n"
        + gpu_report.table(concurrent)
        + _source(*sources)
    )
    cells = decode["models"]["llama2-7b"]["cells"]
    speed, memory = [], []
    for cell in cells:
        for method in GPU_METHODS:
            entry = cell.get(method, {})
            if entry.get("status") != "ok":
                continue
            point = {"method": method, "batch": cell["batch"], "tokens": cell["size"]}
            speed.append({**point, "ms_per_token": entry["decode_ms_per_token"]})
            if method in ("full", "snapkv"):
                memory.append({**point, "peak_gib": entry["peak_bytes"] / 2**30})
    throughput = [
        {"method": method, "requests": cell["batch"], "tokens_per_s": cell[method]["tokens_per_s"]}
        for cell in concurrent["models"]["llama2-7b"]["cells"]
        for method in GPU_METHODS
        if cell.get(method, {}).get("status") == "ok"
    ]
    figures["gpu_h200.png"] = {
        "kind": "gpu",
        "device": decode["device"],
        "speed": _round(speed, 3),
        "memory": _round(memory, 3),
        "throughput": _round(throughput, 2),
    }


SECTIONS: tuple[Callable[[dict, dict], None], ...] = (
    evals_by_n,
    evals_methods,
    evals_followup,
    peer_presses,
    peer_kvpress,
    cpu_decode,
    cpu_switches,
    documents,
    load,
    gpu,
)


def build() -> dict[str, str]:
    """Every generated text file, by name (the tables, and ``plots.json`` with each figure's values)."""
    tables: dict[str, str] = {}
    figures: dict[str, dict] = {}
    for section in SECTIONS:
        section(tables, figures)
    tables["plots.json"] = json.dumps(figures, indent=1, sort_keys=True) + "\n"
    return tables


# --- the README's headline table -----------------------------------------------------------------

README = ROOT / "README.md"
HEADLINE_START = "<!-- headline results: made by `python -m docs.generate`; do not edit by hand -->"
HEADLINE_END = "<!-- end of headline results -->"


def _press(summary: dict, method: str, share: str) -> dict:
    return next(r for r in summary["table"] if r["set"] == "all" and r["method"] == f"{method}@{share}")


def _best_press(summary: dict, share: str) -> dict:
    presses = [
        r
        for r in summary["table"]
        if r["set"] == "all"
        and r["share"] == share
        and r["method"].startswith("kvpress:")
        and r["n"] == summary["prompts"]
    ]
    return max(presses, key=lambda r: r["identical_to_full"])


def headline() -> str:
    """The README's small table of headline results, each figure from its result file."""
    peer = _json(BENCH / "peer_presses" / "summary.json")
    ahead = {share: _press(peer, "ours:lookahead", share) for share in ("25%", "50%")}
    snap = _press(peer, "ours:snapkv", "50%")
    best = {share: _best_press(peer, share) for share in ("25%", "50%")}
    by_n, _ = _eval_records(EVALS / "cpu-2core", ("dataset", "num_docs", "method"))
    cost = {r["num_docs"]: r for r in by_n if r["dataset"] == "nq" and r["method"] == "snapkv@25%"}
    few, many = min(cost), max(cost)
    idle = _json(BENCH / "cpu_decode_idle.json")
    longest = max(idle["rows"], key=lambda r: r["prompt_tokens"])
    kept = longest["methods"][f"snapkv@{idle['budgets'][0]}"]
    decode = _json(GPU / "gpu_decode.json")
    cells = decode["models"]["llama2-7b"]["cells"]
    big = max(cells, key=lambda c: (c["size"], c["batch"]))
    graph = [c["snapkv_compiled"]["decode_ms_per_token"] for c in cells if c["snapkv_compiled"]["status"] == "ok"]
    concurrent = _json(GPU / "gpu_concurrent.json")["models"]["llama2-7b"]["cells"]
    widest = max(concurrent, key=lambda c: c["batch"])
    most = widest["snapkv_compiled"]
    prefix, store = _json(BENCH / "prefix_cache.json")["summary"], _json(BENCH / "doc_store.json")["summary"]

    def paired(r):
        return f"{r['f1_minus_full']:+.3f} [{r['f1_minus_full_lo']:+.3f}, {r['f1_minus_full_hi']:+.3f}]"

    rows = [
        (
            "Same answer as the full cache, 50% of the prompt kept (embedded 135M model, 300 NQ / HotpotQA prompts)",
            f"lookahead SnapKV **{ahead['50%']['identical_to_full']:.2f}**, SnapKV {snap['identical_to_full']:.2f}, "
            f"kvpress's best press {best['50%']['identical_to_full']:.2f}; at 25%: "
            f"{ahead['25%']['identical_to_full']:.2f} against {best['25%']['identical_to_full']:.2f}",
            "[methods](docs/methods.md#measured-against-kvpress), "
            "[summary.json](benchmarks/results/peer_presses/summary.json)",
        ),
        (
            "Answer F1 cost of SnapKV at 25% of the prompt (NQ, paired against the full cache)",
            f"{paired(cost[few])} with {few} documents; {paired(cost[many])} with {many}",
            "[evals](docs/evals.md), [cpu-2core](evals/results/cpu-2core/)",
        ),
        (
            f"CPU decode at {longest['prompt_tokens']:,} tokens, SnapKV@{idle['budgets'][0]} (2 cores)",
            f"**{kept['speedup_vs_full']:.2f}x** faster; KV cache {_mib(longest['methods']['full']['kv_bytes_kept'])} "
            f"-> {_mib(kept['kv_bytes_kept'])} MiB",
            "[benchmarks](docs/benchmarks.md#on-the-cpu), [cpu_decode_idle.json](benchmarks/results/cpu_decode_idle.json)",
        ),
        (
            f"GPU memory at {big['size'] // 1024}K tokens x {big['batch']} ({decode['device']}, Llama-2-7B shape)",
            f"SnapKV@{decode['budget']} **{big['snapkv']['peak_bytes'] / 2**30:.1f} GiB** against the full cache's "
            f"{big['full']['peak_bytes'] / 2**30:.1f} GiB; CUDA-graph step {min(graph):.1f}-{max(graph):.1f} ms/token "
            f"from {min(decode['sizes']) // 1024}K to {max(decode['sizes']) // 1024}K",
            "[benchmarks](docs/benchmarks.md#on-a-gpu), [gpu_decode.json](benchmarks/results/gpu-h200-3/gpu_decode.json)",
        ),
        (
            f"{widest['batch']} concurrent {widest['size'] // 1024}K-token requests, same GPU",
            f"**{most['tokens_per_s']:,.0f} tokens/s**, {most['tokens_per_s_vs_one_request']:.1f}x one request's",
            "[gpu_concurrent.json](benchmarks/results/gpu-h200-3/gpu_concurrent.json)",
        ),
        (
            f"Follow-up questions over the same documents (CPU, {prefix['documents']} documents, "
            f"{prefix['prompt_tokens']:,}-token prompts)",
            f"first token **{prefix['ratio_later_median']:.1f}x** sooner from the prefix cache; "
            f"{store['ratio_later_median']:.1f}x from a stored set compressed to {store['stored_share']:.2f} of the bytes",
            "[documents](docs/documents.md), [prefix_cache.json](benchmarks/results/prefix_cache.json), "
            "[doc_store.json](benchmarks/results/doc_store.json)",
        ),
    ]
    lines = ["| what | result | where |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def readme_with_headline(text: str) -> str:
    """``text`` (the README) with the block between the headline markers replaced by :func:`headline`."""
    start, end = text.index(HEADLINE_START) + len(HEADLINE_START), text.index(HEADLINE_END)
    return text[:start] + "\n" + headline() + "\n" + text[end:]


# --- figures ------------------------------------------------------------------------------------


def _gpu_figure(spec: dict, path: Path) -> None:
    from evals.plots import plt

    fig, (speed_ax, memory_ax, rate_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    for method, label in GPU_METHODS.items():
        for batch, style in ((1, "-"), (2, ":")):
            points = sorted(
                (p["tokens"], p["ms_per_token"]) for p in spec["speed"] if p["method"] == method and p["batch"] == batch
            )
            if points:
                speed_ax.plot(*zip(*points), style, marker="o", label=f"{label}, batch {batch}")
    speed_ax.set(title="decode step", xlabel="prompt tokens", ylabel="ms per token", xscale="log", ylim=(0, None))
    for method in ("full", "snapkv"):
        for batch, style in ((1, "-"), (2, ":")):
            points = sorted(
                (p["tokens"], p["peak_gib"]) for p in spec["memory"] if p["method"] == method and p["batch"] == batch
            )
            if points:
                memory_ax.plot(
                    *zip(*points), style, marker="o", label=f"{GPU_METHODS[method].split(',')[0]}, batch {batch}"
                )
    memory_ax.set(
        title="peak device memory (eager)", xlabel="prompt tokens", ylabel="GiB", xscale="log", ylim=(0, None)
    )
    for method, label in GPU_METHODS.items():
        points = sorted((p["requests"], p["tokens_per_s"]) for p in spec["throughput"] if p["method"] == method)
        if points:
            rate_ax.plot(*zip(*points), marker="o", label=label)
    rate_ax.set(title="concurrent 4K-token requests", xlabel="requests", ylabel="tokens/s", ylim=(0, None))
    top = max(p["ms_per_token"] for p in spec["speed"])
    speed_ax.set_ylim(0, 1.6 * top)  # room for the legend above the lines
    for ax in (speed_ax, memory_ax, rate_ax):
        ax.grid(alpha=0.3)
    sizes = sorted({p["tokens"] for p in spec["speed"]})
    for ax in (speed_ax, memory_ax):
        ax.set_xticks(sizes, [f"{size // 1024}K" for size in sizes])
        ax.minorticks_off()
    speed_ax.legend(fontsize=6, ncol=2, loc="upper left")
    memory_ax.legend(fontsize=7, loc="upper left")
    rate_ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{spec['device']}: random-weight Llama-2-7B shape, bf16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def draw(name: str, spec: dict, path: Path) -> None:
    """One figure from its values in plots.json, by the project's plotting functions where they exist."""
    from evals import plots

    if spec["kind"] == "against_n":
        plots.against_n(spec["records"], spec["methods"], spec["metric"], spec["ylabel"], path)
    elif spec["kind"] == "against_budget":
        prefix = spec.get("dashed_prefix")
        plots.against_budget(
            spec["records"],
            spec["metric"],
            spec["ylabel"],
            path,
            dashed=(lambda method: method.startswith(prefix)) if prefix else (lambda method: False),
        )
    elif spec["kind"] == "gpu":
        _gpu_figure(spec, path)
    else:
        raise ValueError(f"{name}: unknown figure kind {spec['kind']!r}")


def write(out: Path = OUT, force: bool = False) -> list[Path]:
    """Writes every generated file into ``out``; a figure only where its values changed (or ``force``)."""
    out.mkdir(parents=True, exist_ok=True)
    files = build()
    old_path = out / "plots.json"
    old = json.loads(old_path.read_text()) if old_path.exists() else {}
    written = []
    for name, text in files.items():
        path = out / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    for name, spec in json.loads(files["plots.json"]).items():
        path = out / name
        if force or not path.exists() or old.get(name) != spec:
            draw(name, spec, path)
            written.append(path)
    if out == OUT:
        text = README.read_text(encoding="utf-8")
        if readme_with_headline(text) != text:
            README.write_text(readme_with_headline(text), encoding="utf-8")
            written.append(README)
    return written


def stale(out: Path = OUT) -> list[str]:
    """The generated files in ``out`` that differ from what the result files give now, or are missing."""
    files = build()
    names = [n for n, text in files.items() if not (out / n).exists() or (out / n).read_text(encoding="utf-8") != text]
    names += [n for n in json.loads(files["plots.json"]) if not (out / n).exists()]
    text = README.read_text(encoding="utf-8")
    if readme_with_headline(text) != text:
        names.append("../../README.md (its headline table)")
    return names


# --- the server's OpenAPI page (made at docs build time) -----------------------------------------


def _routes_from_sources() -> list[tuple[str, str, str]]:
    """(method, path, the handler's docstring) of every route, read from the route modules' source."""
    import ast

    found = []
    for module in sorted((ROOT / "snapkv_rag" / "server" / "routes").glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for decorator in node.decorator_list:
                call = decorator if isinstance(decorator, ast.Call) else None
                verb = getattr(getattr(call, "func", None), "attr", "")
                if verb in ("get", "post", "put", "delete") and call.args and isinstance(call.args[0], ast.Constant):
                    found.append((verb.upper(), call.args[0].value, ast.get_docstring(node) or ""))
    return found


def _first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split()) if text else ""


def write_openapi(out: Path) -> Path:
    """``out/routes.md`` (a table of the routes, included by the server page) and, where the app can
    be built without a model, ``out/openapi.json``: the schema of ``create_app``'s FastAPI app (which
    serves none itself). Falls back to the route modules' source, and says so, when it cannot."""
    out.mkdir(parents=True, exist_ok=True)
    schema_file = out / "openapi.json"
    try:
        from snapkv_rag.server.app import create_app
        from snapkv_rag.server.protocol import ServerSettings

        class _NoEngine:  # the schema needs the routes only, never an engine
            def stats(self):
                raise RuntimeError("no engine: the docs only read the routes")

        app = create_app(_NoEngine(), ServerSettings("SmolLM2-135M-Instruct"))
        schema = app.openapi()
        schema_file.write_text(json.dumps(schema, indent=1) + "\n", encoding="utf-8")
        docs = {
            (method, route.path): route.endpoint.__doc__ or ""
            for route in app.routes
            for method in getattr(route, "methods", ()) or ()
        }
        routes = [
            (method.upper(), path, docs.get((method.upper(), path), "") or op.get("summary", ""))
            for path, item in schema["paths"].items()
            for method, op in item.items()
        ]
        note = (
            "Read from the app that `snapkv_rag.server.app.create_app` builds (no model loaded); its "
            "OpenAPI schema: {download}`openapi.json </_openapi/openapi.json>`. Request bodies are parsed by the "
            "routes themselves, so the schema lists paths and methods; the fields are described above."
        )
    except Exception as error:  # the server extra missing, or the app cannot be built here
        schema_file.unlink(missing_ok=True)
        routes = _routes_from_sources()
        note = (
            f"The FastAPI app could not be built for this build ({type(error).__name__}), so the routes were "
            "read from `snapkv_rag/server/routes/`; install the `server` extra for the OpenAPI schema."
        )
    lines = ["| method | path | what it does |", "|---|---|---|"]
    lines += [f"| {m} | `{p}` | {_first_paragraph(d).replace('|', '/')} |" for m, p, d in routes]
    path = out / "routes.md"
    path.write_text(note + "\n\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    parser.add_argument("--force", action="store_true", help="draw every figure again")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.check:
        names = stale(args.out)
        for name in names:
            print(f"stale: {args.out.name}/{name}")
        if names:
            print(f"run: {COMMAND}")
        return 1 if names else 0
    for path in write(args.out, args.force):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
