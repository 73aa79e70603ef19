"""The load benchmark's ratios (against the issue's targets) and its JSON + markdown output."""

from __future__ import annotations

import json
import os
from pathlib import Path


def fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _level(report: dict, system: str, key: str) -> dict | None:
    level = report["systems"].get(system, {}).get("levels", {}).get(key)
    return level if level and "tokens_per_s" in level else None


def _ideal(report: dict, key: str) -> float | None:
    return report.get("inprocess", {}).get("ideal", {}).get(key, {}).get("tokens_per_s")


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def ratios(report: dict, args) -> list[dict]:
    """The issue's comparisons at ``--ratio-clients`` clients, each with its target and whether it is met."""
    out = []
    clients = args.ratio_clients

    def add(name: str, value, target: float, above: bool = True) -> None:
        met = None if value is None else (value >= target if above else value < target)
        out.append({"name": name, "value": value, "target": (">= " if above else "< ") + str(target), "met": met})

    lengths = [(args.new_tokens, 1.4)] + (
        [(args.long_tokens, 2.5)] if args.long_tokens and clients in args.long_levels else []
    )
    for new_tokens, target in lengths:
        key = f"{new_tokens}x{clients}"
        ours, alone = _level(report, "batched", key), _level(report, "one_at_a_time", key)
        tserve = _level(report, "transformers_serve", key)
        tps = ours and ours["tokens_per_s"]
        add(f"batched / one-at-a-time tokens/s, {key}", _ratio(tps, alone and alone["tokens_per_s"]), target)
        add(f"batched fraction of the ideal, {key}", _ratio(tps, _ideal(report, key)), 0.8)
        add(f"batched / transformers serve tokens/s, {key}", _ratio(tps, tserve and tserve["tokens_per_s"]), 1.0)
        padded = [
            v["tokens_per_s"]
            for v in report.get("inprocess", {}).get("padded_generate", {}).values()
            if v["new_tokens"] == new_tokens
        ]
        add(f"batched / best padded-batch generate tokens/s, {key}", _ratio(tps, max(padded, default=None)), 1.0)
        add(
            f"p95 TTFT batched / one-at-a-time, {key}",
            _ratio(ours and ours["ttft_p95_s"], alone and alone["ttft_p95_s"]),
            1.0,
            above=False,
        )
    one, many = (_level(report, "batched", f"{args.new_tokens}x{c}") for c in (1, clients))
    if one is not None and clients != 1:  # how the batching server scales from one client
        add(
            f"batched tokens/s, {args.new_tokens}x{clients} / {args.new_tokens}x1",
            _ratio(many and many["tokens_per_s"], one["tokens_per_s"]),
            2.0,
        )
    failed = [
        lv.get("failed", 0)
        for s in ("batched", "one_at_a_time")
        for lv in report["systems"].get(s, {}).get("levels", {}).values()
        if "failed" in lv
    ]
    add("failed requests on our server (all levels)", sum(failed) if failed else None, 1, above=False)
    prompts = {
        s: [lv["prompt_tokens"] for lv in e.get("levels", {}).values() if "prompt_tokens" in lv]
        for s, e in report["systems"].items()
    }
    if (
        "batched" in prompts
        and "transformers_serve" in prompts
        and prompts["batched"]
        and prompts["transformers_serve"]
    ):
        same = prompts["batched"] == prompts["transformers_serve"]
        out.append(
            {
                "name": "same prompt tokens (usage) on ours and transformers serve",
                "value": same,
                "target": "True",
                "met": same,
            }
        )
    return out


def markdown(report: dict) -> str:
    lines = [
        f"Model: {report.get('model')}; command: `{report['command']}`",
        "",
        "| system | answer tokens | clients | requests | tokens/s | of ideal | latency p50 / p95 s | "
        "TTFT p50 / p95 s | failed | wrong length | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, entry in report["systems"].items():
        if "error" in entry:
            lines.append(f"| {system} | failed to run: {entry['error'][:120]!r} |||||||||")
        for key, level in entry.get("levels", {}).items():
            new_tokens, clients = key.split("x")
            if "skipped" in level:
                lines.append(f"| {system} | {new_tokens} | {clients} | skipped: {level['skipped']} ||||||||")
                continue
            ideal = _ideal(report, key)
            lines.append(
                f"| {system} | {new_tokens} | {clients} | {level['requests']} | {level['tokens_per_s']:.2f} | "
                f"{fmt(_ratio(level['tokens_per_s'], ideal))} | {fmt(level['latency_p50_s'])} / "
                f"{fmt(level['latency_p95_s'])} | {fmt(level['ttft_p50_s'])} / {fmt(level['ttft_p95_s'])} | "
                f"{level['failed']} | {level['wrong_length']} | {level['peak_rss_mib']:.0f} |"
            )
    inprocess = report.get("inprocess", {})
    for key, ideal in inprocess.get("ideal", {}).items():
        new_tokens, clients = key.split("x")
        lines.append(
            f"| ideal (lone prefills + batch-{ideal.get('batch', clients)} decode steps) | {new_tokens} | {clients} | | "
            f"{ideal['tokens_per_s']:.2f} | 1.00 | | | | | |"
        )
    for padded in inprocess.get("padded_generate", {}).values():
        ideal = _ideal(report, f"{padded['new_tokens']}x{padded['batch']}")
        lines.append(
            f"| transformers generate, padded batch {padded['batch']} | {padded['new_tokens']} | - | "
            f"{padded['requests']} | {padded['tokens_per_s']:.2f} | {fmt(_ratio(padded['tokens_per_s'], ideal))} "
            "| | | | | |"
        )
    if report.get("ratios"):
        lines += ["", "| comparison | value | target | met |", "|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['value']} | {r['target']} | {r['met']} |" for r in report["ratios"]]
    return "\n".join(lines)


def write(folder: Path, report: dict) -> None:
    """``load.json`` and ``load.md``, each written whole (a temporary file renamed into place)."""
    for name, text in (("load.json", json.dumps(report, indent=1)), ("load.md", markdown(report) + "\n")):
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, folder / name)
