"""How ``gpu_decode.py`` and ``gpu_transformers.py`` turn finished cells into figures: speedups beside
their ceilings, batch throughput beside one request's, the Markdown tables they print, and the
issue's targets that ``gpu_check.py`` records as booleans.

A cell holds one entry per method: ``full`` and ``snapkv`` decode through the eager loop,
``full_compiled`` and ``snapkv_compiled`` through the graph step (``compile=True``);
``gpu_transformers.json`` holds one row per prompt length for transformers' own path.
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


def describe_kernels(outcome: dict) -> str:
    if outcome.get("status") != "ok":
        return f"[{outcome.get('status')}] {outcome.get('reason') or outcome.get('error') or ''}"
    return (
        f"{outcome['kernels_per_layer']:.1f} ({outcome['kernels_per_step']:.0f} per step, "
        f"{outcome['copies_per_step']:.1f} copies; {outcome['counted']})"
    )


def describe_longest(search: dict) -> str:
    tried = ", ".join(f"{a['tokens']}: {a.get('status')}" for a in search["attempts"])
    return f"{search['status']}: {search['longest_tokens']} tokens fit, {search['first_miss_tokens']} not ({tried})"


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
        longest = entry.get("longest", {})
        for method in ("full", "snapkv"):
            if method in longest:
                fit = longest[method]
                if "longest_tokens" in fit:
                    label = f"{method}, capped"
                    found = f"{fit['status']}: {fit['longest_tokens']} tokens (not {fit['first_miss_tokens']})"
                else:  # a run from before the search was measured: an estimate from three prompt sizes
                    label, found = method, f"{fit['status']}: {fit.get('estimate_tokens')} tokens"
                lines.append(f"| {name} | longest ({label}) | 1 | {found} | | | | | | |")
        if longest.get("ratio"):
            lines.append(f"| {name} | longest SnapKV / full | 1 | {longest['ratio']:.2f}x | | | | | | |")
    return "\n".join(lines)


def transformers_table(report: dict) -> str:
    """transformers' static cache + compiled decode, one row per prompt length."""
    lines = [
        "| model | prompt | transformers ms/token (x floor) | prefill s | warm-up (compile) s |",
        "|---|---|---|---|---|",
    ]
    for name, entry in report["models"].items():
        for row in entry.get("rows", []):
            figure = (
                f"{row['decode_ms_per_token']:.2f} ({row['ratio_to_floor']:.2f}x)"
                if row["status"] == "ok"
                else f"{row['status']} {row.get('reason') or row.get('error') or ''}"
            )
            prefill = f"{row['prefill_s']:.2f}" if "prefill_s" in row else "-"
            warm = f"{row['warm_up_s']:.1f}" if "warm_up_s" in row else "-"
            lines.append(f"| {name} | {row['size']} | {figure} | {prefill} | {warm} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the targets
FLOOR_TARGET = 1.3  # batch 1, each method's ms/token at most this times the measured floor
CEILING_TARGET = 0.85  # the full/SnapKV speedup at least this share of the floors' ratio
CONCURRENT_TARGET = 12.0  # 16 concurrent requests: tokens/s at least this times one request's
CONCURRENT_REQUESTS = 16
KERNELS_TARGET = 15  # kernels per layer of one compiled decode step
PAPER_LONGEST_RATIO = 8.2


def _met(checks: list[bool | None]) -> bool | None:
    """False if any measured check fails; None if one is missing (not measured); else True."""
    if any(c is False for c in checks):
        return False
    if not checks or any(c is None for c in checks):
        return None
    return True


def _primary(report: dict | None) -> tuple[str | None, dict]:
    for name, entry in (report or {}).get("models", {}).items():
        return name, entry
    return None, {}


def _graph_or_eager(cell: dict, method: str) -> str:
    return method + "_compiled" if method + "_compiled" in cell else method


def targets(decode: dict | None, transformers: dict | None, concurrent: dict | None) -> dict:
    """The issue's targets on the first (primary) model, each ``met``: True, False or None (not
    measured), with the figures it was judged on. Our figures are the graph step's (``compile=True``)
    where the run has them."""
    name, grid = _primary(decode)
    ones = [c for c in grid.get("cells", []) if c["batch"] == 1]
    out: dict = {"model": name}

    values, checks = {}, []
    for cell in ones:
        row = {}
        for method in ("full", "snapkv"):
            m = _graph_or_eager(cell, method)
            ratio = cell[m].get("ratio_to_floor") if ok(cell, m) else None
            row[m] = ratio
            checks.append(None if ratio is None else ratio <= FLOOR_TARGET)
        values[cell["size"]] = row
    out["floor"] = {
        "target": f"batch 1, every length: SnapKV and full each <= {FLOOR_TARGET}x the measured floor",
        "met": _met(checks),
        "ratio_to_floor": values,
    }

    values, checks = {}, []
    for cell in ones:
        suffix = "_compiled" if "full_compiled" in cell else ""
        fraction = cell.get("fraction_of_ceiling" + suffix)
        values[cell["size"]] = {
            "speedup": cell.get("speedup" + suffix),
            "ceiling": cell.get("ceiling" + suffix),
            "fraction": fraction,
        }
        checks.append(None if fraction is None else fraction >= CEILING_TARGET)
    out["speedup_vs_ceiling"] = {
        "target": f"full/SnapKV speedup >= {CEILING_TARGET} of the floor-ratio ceiling (batch 1, every length)",
        "met": _met(checks),
        "values": values,
    }

    rows = {r["size"]: r for r in (transformers or {}).get("models", {}).get(name, {}).get("rows", [])}
    values, checks = {}, []
    for cell in ones:
        hf = rows.get(cell["size"], {})
        theirs = hf.get("decode_ms_per_token") if hf.get("status") == "ok" else None
        row = {"transformers_ms": theirs}
        for method in ("full", "snapkv"):
            m = _graph_or_eager(cell, method)
            ours = cell[m]["decode_ms_per_token"] if ok(cell, m) else None
            row[m + "_ms"] = ours
            row[m + "_over_transformers"] = ours / theirs if ours and theirs else None
            if ours is None or theirs is None:
                checks.append(None)
            else:
                checks.append(ours <= theirs if method == "full" else ours < theirs)
        values[cell["size"]] = row
    out["vs_transformers"] = {
        "target": "our full cache no slower than transformers' static cache + compiled decode at every length, "
        "and SnapKV faster",
        "met": _met(checks),
        "values": values,
    }

    _, entry = _primary(concurrent)
    cells = {c["batch"]: c for c in entry.get("cells", [])}
    most = CONCURRENT_REQUESTS if CONCURRENT_REQUESTS in cells else max(cells, default=None)
    values, checks = {}, []
    if most is not None:
        for method in ("full", "snapkv"):
            m = _graph_or_eager(cells[most], method)
            times = cells[most].get(m, {}).get("tokens_per_s_vs_one_request")
            values[m] = times
            checks.append(None if times is None else times >= CONCURRENT_TARGET)
    out["concurrency"] = {
        "target": f"{CONCURRENT_REQUESTS} concurrent 4K requests >= {CONCURRENT_TARGET}x one request's tokens/s",
        "met": _met(checks if most == CONCURRENT_REQUESTS else [None]),
        "requests": most,
        "tokens_per_s_vs_one_request": values,
    }

    kernels = grid.get("kernels", {})
    ours = {k: v.get("kernels_per_layer") for k, v in kernels.items() if v.get("status") == "ok"}
    step = ours.get("graph") if ours.get("graph") else ours.get("eager")  # a graph's kernels unseen: the eager step's
    theirs = (transformers or {}).get("models", {}).get(name, {}).get("kernels", {})
    out["kernels_per_layer"] = {
        "target": f"<= {KERNELS_TARGET} kernels per layer in one decode step of our compiled engine",
        "met": None if step is None else step <= KERNELS_TARGET,
        "ours": ours,
        "judged_on": "graph" if ours.get("graph") else "eager" if step is not None else None,
        "transformers": theirs.get("kernels_per_layer") if theirs.get("status") == "ok" else None,
    }

    longest = grid.get("longest", {})
    ratio = longest.get("ratio")
    out["longest_prompt"] = {
        "target": "the longest prompt SnapKV fits over the full cache's, measured under a memory cap "
        f"(paper: {PAPER_LONGEST_RATIO}x)",
        "met": longest.get("status") == "measured" if longest else None,
        "full_tokens": longest.get("full", {}).get("longest_tokens"),
        "snapkv_tokens": longest.get("snapkv", {}).get("longest_tokens"),
        "ratio": ratio,
        "reaches_paper_ratio": None if ratio is None else ratio >= PAPER_LONGEST_RATIO,
        "cap": longest.get("cap"),
    }
    out["all_met"] = _met([v["met"] for v in out.values() if isinstance(v, dict) and "met" in v])
    return out


def targets_text(found: dict) -> str:
    """One line per target: MET, NOT MET or NOT MEASURED, with its figures."""

    def word(met) -> str:
        return {True: "MET", False: "NOT MET", None: "NOT MEASURED"}[met]

    def num(value, unit="") -> str:
        return "-" if value is None else f"{value:.2f}{unit}"

    lines = [f"targets ({found.get('model')}): {word(found['all_met'])} overall"]
    floor = found["floor"]
    lines.append(
        f"  [{word(floor['met'])}] {floor['target']}: "
        + "; ".join(
            f"{size}: " + ", ".join(f"{m} {num(r, 'x')}" for m, r in row.items())
            for size, row in floor["ratio_to_floor"].items()
        )
    )
    ceiling = found["speedup_vs_ceiling"]
    lines.append(
        f"  [{word(ceiling['met'])}] {ceiling['target']}: "
        + "; ".join(
            f"{size}: {num(v['speedup'], 'x')} of {num(v['ceiling'], 'x')} ({num(v['fraction'])})"
            for size, v in ceiling["values"].items()
        )
    )
    versus = found["vs_transformers"]
    lines.append(
        f"  [{word(versus['met'])}] {versus['target']}: "
        + "; ".join(
            f"{size}: transformers {num(v['transformers_ms'])} ms, "
            + ", ".join(
                f"{k.removesuffix('_ms')} {num(x)} ms" for k, x in v.items() if k.endswith("_ms") and k[0] != "t"
            )
            for size, v in versus["values"].items()
        )
    )
    conc = found["concurrency"]
    lines.append(
        f"  [{word(conc['met'])}] {conc['target']}: at {conc['requests']}: "
        + ", ".join(f"{m} {num(x, 'x')}" for m, x in conc["tokens_per_s_vs_one_request"].items())
    )
    kern = found["kernels_per_layer"]
    lines.append(
        f"  [{word(kern['met'])}] {kern['target']}: ours "
        + ", ".join(f"{k} {num(v)}" for k, v in kern["ours"].items())
        + f"; transformers {num(kern['transformers'])}"
    )
    longest = found["longest_prompt"]
    lines.append(
        f"  [{word(longest['met'])}] {longest['target']}: full {longest['full_tokens']}, SnapKV "
        f"{longest['snapkv_tokens']} tokens: {num(longest['ratio'], 'x')}"
    )
    return "\n".join(lines)
