"""Quantization's fidelity, paired: eval runs of the same prompts with quantized weights or an
8-bit kept cache (``python -m evals ... --quantize int8`` / ``--kv-dtype int8``), each against the
unquantized run, prompt by prompt and method by method (the full cache against the full cache,
SnapKV against SnapKV at the same budget). Per pair: the share of answers identical to the
unquantized ones and the answer-F1 change, each with a 95% bootstrap interval over prompts.

    python -m evals.quantized evals/results/quantized/fp32 evals/results/quantized/int8-weights \\
        evals/results/quantized/int8-kv --out evals/results/quantized/summary.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .report import bootstrap_ci, read_rows
from .runner import ROWS, SETTINGS


def label(folder: Path) -> str:
    """What a run changed, from its settings: ``int8 weights``, ``int8 KV``, both, a dtype the model
    loaded in (``bfloat16``), or ``unquantized``."""
    settings = json.loads((folder / SETTINGS).read_text()) if (folder / SETTINGS).exists() else {}
    parts = [str(settings["dtype"])] if settings.get("dtype") else []
    parts += [f"{settings['quantize']} weights"] if settings.get("quantize") else []
    parts += [f"{settings['kv_dtype']} KV"] if settings.get("kv_dtype") else []
    return " + ".join(parts) or "unquantized"


def paired(base: list[dict], other: list[dict]) -> list[dict]:
    """One record per method: the prompts both runs answered, identical share and F1 change."""
    reference = {(r["example_id"], r["method"]): r for r in base}
    by_method: dict[str, list[tuple[dict, dict]]] = {}
    for row in other:
        ref = reference.get((row["example_id"], row["method"]))
        if ref is not None:
            by_method.setdefault(row["method"], []).append((ref, row))
    records = []
    for method, pairs in sorted(by_method.items()):
        same = [float(a["text"] == b["text"]) for a, b in pairs]
        delta = [b["f1"] - a["f1"] for a, b in pairs]
        records.append(
            {
                "method": method,
                "prompts": len(pairs),
                "identical": sum(same) / len(same),
                "identical_ci": bootstrap_ci(same),
                "f1_change": sum(delta) / len(delta),
                "f1_change_ci": bootstrap_ci(delta),
                "kv_ratio": sum(b["kv_bytes_kept"] / a["kv_bytes_kept"] for a, b in pairs) / len(pairs),
            }
        )
    return records


def table(base: Path, others: list[Path]) -> tuple[str, list[dict]]:
    base_rows = read_rows(base / ROWS)
    lines = [
        f"Against the unquantized run ({base.name}), prompt by prompt; 95% bootstrap intervals over prompts.",
        "",
        "| run | method | prompts | identical answers | answer-F1 change | kept-cache bytes |",
        "|---|---|---:|---:|---:|---:|",
    ]
    everything = []
    for folder in others:
        for r in paired(base_rows, read_rows(folder / ROWS)):
            r["run"] = label(folder)
            everything.append(r)
            low, high = r["identical_ci"]
            f_low, f_high = r["f1_change_ci"]
            lines.append(
                f"| {r['run']} | {r['method']} | {r['prompts']} | {r['identical']:.1%} [{low:.1%}, {high:.1%}] "
                f"| {r['f1_change']:+.3f} [{f_low:+.3f}, {f_high:+.3f}] | {r['kv_ratio']:.2f}x |"
            )
    return "\n".join(lines) + "\n", everything


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="the unquantized run's --out folder")
    parser.add_argument("others", type=Path, nargs="+", help="quantized runs' --out folders (same prompts)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file (default: print only)")
    args = parser.parse_args()
    text, records = table(args.base, args.others)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
