"""How ``gpu_decode.py`` turns finished cells into figures: speedups beside their ceilings, batch
throughput beside one request's, and the Markdown tables it prints.

A cell holds one entry per method: ``full`` and ``snapkv`` decode through the eager loop,
``full_compiled`` and ``snapkv_compiled`` through the graph step (``compile=True``).
"""

from __future__ import annotations

METHODS = ("full", "snapkv", "full_compiled", "snapkv_compiled")


def ok(cell: dict, method: str) -> bool:
    return cell.get(method, {}).get("status") == "ok"


def finish(cell: dict) -> None:
    """Speedups beside their ceilings: full / SnapKV at the floor is the most the hardware allows."""
    for suffix in ("", "_compiled"):
        full, snap = "full" + suffix, "snapkv" + suffix
        if ok(cell, full) and ok(cell, snap):
            speedup = cell[full]["decode_ms_per_token"] / cell[snap]["decode_ms_per_token"]
            ceiling = cell[full]["floor_ms_per_token"] / cell[snap]["floor_ms_per_token"]
            cell["speedup" + suffix] = speedup
            cell["ceiling" + suffix] = ceiling
            cell["fraction_of_ceiling" + suffix] = speedup / ceiling
    for method in ("full", "snapkv"):
        if ok(cell, method) and ok(cell, method + "_compiled"):
            cell[f"compile_gain_{method}"] = (
                cell[method]["decode_ms_per_token"] / cell[method + "_compiled"]["decode_ms_per_token"]
            )


def throughput(cells: list[dict]) -> None:
    """Tokens per second of each method at each concurrency, and as a multiple of one request's
    (``batch`` 1 at the same prompt length): the issue's target is 8x or more at 16 requests."""
    single = {c["size"]: c for c in cells if c["batch"] == 1}
    for cell in cells:
        for method in METHODS:
            if not ok(cell, method):
                continue
            entry = cell[method]
            entry["tokens_per_s"] = cell["batch"] * 1000 / entry["decode_ms_per_token"]
            one = single.get(cell["size"], {})
            if ok(one, method):
                entry["tokens_per_s_vs_one_request"] = entry["tokens_per_s"] / one[method]["tokens_per_s"]


def describe(outcome: dict) -> str:
    if outcome["status"] != "ok":
        return f"[{outcome['status']}] {outcome.get('reason') or outcome.get('error') or ''}"
    return (
        f"{outcome['decode_ms_per_token']:.2f} ms/token ({outcome['ratio_to_floor']:.2f}x floor), prefill "
        f"{outcome['prefill_s']:.2f} s, peak {outcome['peak_bytes'] / 2**30:.1f} GiB"
    )


def _show(cell: dict, method: str) -> str:
    c = cell.get(method, {"status": "-"})
    return f"{c['decode_ms_per_token']:.2f} ({c['ratio_to_floor']:.2f}x)" if c["status"] == "ok" else c["status"]


def _speed(cell: dict, suffix: str) -> str:
    key = "speedup" + suffix
    return f"{cell[key]:.2f}x / {cell['ceiling' + suffix]:.2f}x" if key in cell else "-"


def _peak(cell: dict, method: str) -> str:
    c = cell.get(method, {})
    return f"{c['peak_bytes'] / 2**30:.1f}" if c.get("status") == "ok" else "-"


def _times_one(cell: dict, method: str) -> str:
    value = cell.get(method, {}).get("tokens_per_s_vs_one_request")
    return f"{value:.1f}x" if value is not None else "-"


def table(report: dict) -> str:
    """One row per (model, prompt, batch or concurrent requests); then the longest prompts."""
    concurrent = report.get("concurrent", False)
    rows = "concurrent requests" if concurrent else "batch"
    extra = (
        " tokens/s vs one request: full eager / graph, SnapKV eager / graph |"
        if concurrent
        else " peak GiB full / SnapKV |"
    )
    lines = [
        f"| model | prompt | {rows} | full ms/token (x floor) | SnapKV (x floor) | speedup / ceiling | "
        f"full graph (x floor) | SnapKV graph (x floor) | speedup / ceiling graph |{extra}",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in report["models"].items():
        for cell in entry.get("cells", []):
            last = (
                " / ".join(_times_one(cell, m) for m in ("full", "full_compiled"))
                + ", "
                + " / ".join(_times_one(cell, m) for m in ("snapkv", "snapkv_compiled"))
                if concurrent
                else f"{_peak(cell, 'full')} / {_peak(cell, 'snapkv')}"
            )
            lines.append(
                f"| {name} | {cell['size']} | {cell['batch']} | {_show(cell, 'full')} | "
                f"{_show(cell, 'snapkv')} | {_speed(cell, '')} | {_show(cell, 'full_compiled')} | "
                f"{_show(cell, 'snapkv_compiled')} | {_speed(cell, '_compiled')} | {last} |"
            )
        for method, fit in entry.get("longest", {}).items():
            lines.append(
                f"| {name} | longest ({method}) | 1 | {fit.get('status')}: "
                f"{fit.get('verified_tokens', fit.get('estimate_tokens', '-'))} tokens | | | | | | |"
            )
    return "\n".join(lines)
