"""matplotlib figures for a run: answer and citation F1 against N, accuracy against gold position,
fidelity (attention hit rate) against N, and fidelity against the bytes each method keeps. One
line per method, 95% intervals as error bars."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only: runs headless in CI and over ssh
import matplotlib.pyplot as plt  # noqa: E402

from .ordering import method_order, position_key  # noqa: E402


def _errorbar(ax, xs, records: Sequence[dict], metric: str, label: str, offset: float) -> None:
    ys = [r.get(metric, float("nan")) for r in records]
    lo = [y - r.get(metric + "_lo", y) for y, r in zip(ys, records)]
    hi = [r.get(metric + "_hi", y) - y for y, r in zip(ys, records)]
    ax.errorbar([x + offset for x in xs], ys, yerr=[lo, hi], marker="o", capsize=3, label=label)


def _finish(fig, axes, ylabel: str, path: Path, legend_size: int = 8) -> None:
    """The y label on the first panel, the legend on the last, the figure written and closed."""
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def against_n(by_n: Sequence[dict], methods: Sequence[str], metric: str, ylabel: str, path: Path) -> None:
    datasets = sorted({r["dataset"] for r in by_n})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for i, method in enumerate(methods):
            records = sorted(
                (r for r in by_n if r["dataset"] == dataset and r["method"] == method), key=lambda r: r["num_docs"]
            )
            if records:
                _errorbar(ax, [r["num_docs"] for r in records], records, metric, method, 0.15 * (i - len(methods) / 2))
        ax.set_title(dataset)
        ax.set_xlabel("documents in the prompt (N)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    _finish(fig, axes, ylabel, path)


def against_position(cells: Sequence[dict], methods: Sequence[str], metric: str, ylabel: str, path: Path) -> bool:
    panels = sorted(
        {
            (r["dataset"], r["num_docs"])
            for r in cells  # positions set by the data are not a sweep
            if r["gold_position"] not in ("shuffled", "given") and depth_of(r["gold_position"]) is None
        }
    )
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, (dataset, n) in zip(axes[0], panels):
        positions = sorted(
            {r["gold_position"] for r in cells if r["dataset"] == dataset and r["num_docs"] == n}, key=position_key
        )
        for i, method in enumerate(methods):
            records = {
                r["gold_position"]: r
                for r in cells
                if r["dataset"] == dataset and r["num_docs"] == n and r["method"] == method
            }
            present = [p for p in positions if p in records]
            if present:
                _errorbar(
                    ax,
                    [positions.index(p) for p in present],
                    [records[p] for p in present],
                    metric,
                    method,
                    0.05 * (i - len(methods) / 2),
                )
        ax.set_xticks(range(len(positions)), positions, rotation=45 if len(positions) > 3 else 0)
        ax.set_title(f"{dataset}, N={n}")
        ax.set_xlabel("gold document position")
        ax.grid(alpha=0.3)
    _finish(fig, axes, ylabel, path)
    return True


def depth_of(position: str) -> int | None:
    """``d050`` (a synthetic test's needle / asked-line depth in percent) -> 50; other labels -> None."""
    return int(position[1:]) if len(position) == 4 and position[0] == "d" and position[1:].isdigit() else None


def depth_heatmaps(
    cells: Sequence[dict], methods: Sequence[str], metric: str, folder: Path, suffix: str = ""
) -> list[Path]:
    """The classic depth x length heatmap, one file per dataset with depth-labelled cells (needle,
    lines), one panel per method: mean ``metric`` of each (length, depth) cell, annotated."""
    written = []
    for dataset in sorted({r["dataset"] for r in cells if depth_of(r["gold_position"]) is not None}):
        mine = [r for r in cells if r["dataset"] == dataset and depth_of(r["gold_position"]) is not None]
        lengths = sorted({r["num_docs"] for r in mine})
        depths = sorted({depth_of(r["gold_position"]) for r in mine})
        shown = [m for m in methods if any(r["method"] == m for r in mine)]
        size = ((0.9 * len(lengths) + 2.2) * len(shown), 0.45 * len(depths) + 1.6)
        fig, axes = plt.subplots(1, len(shown), figsize=size, squeeze=False, sharey=True)
        for ax, method in zip(axes[0], shown):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for r in mine:
                if r["method"] == method and metric in r:
                    grid[depths.index(depth_of(r["gold_position"])), lengths.index(r["num_docs"])] = r[metric]
            ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="upper")
            for (i, j), value in np.ndenumerate(grid):
                if not np.isnan(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45)
            ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
            ax.set_title(method, fontsize=9)
            ax.set_xlabel("prompt tokens" if dataset == "needle" else "lines" if dataset == "lines" else "N")
        axes[0][0].set_ylabel("depth")
        fig.suptitle(f"{dataset}: {METRIC_LABELS.get(metric, metric)} by depth and length", fontsize=10)
        fig.tight_layout()
        path = folder / f"heatmap_{dataset}{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def share_of(method: str) -> tuple[str, float] | None:
    """``snapkv@25%`` (a method at a share of the prompt) -> ``("snapkv", 0.25)``; a method at a
    token budget, or without one, -> None."""
    name, _, budget = method.rpartition("@")
    if not name or not budget.endswith("%"):
        return None
    try:
        return name, float(budget[:-1]) / 100
    except ValueError:
        return None


def against_budget(records: Sequence[dict], metric: str, ylabel: str, path: Path, dashed=lambda method: False) -> bool:
    """Fidelity against the share of the prompt kept: one panel per ``record["panel"]``, one line per
    method (its ``name@share`` records; dashed where ``dashed(name)``), each ending at the full cache
    (share 1, fidelity 1 by definition). False, and no file, when no method ran at a share."""
    shown = [(r, share) for r in records if metric in r and (share := share_of(r["method"]))]
    if not shown:
        return False
    panels = list(dict.fromkeys(r["panel"] for r, _ in shown))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        families = list(dict.fromkeys(family for r, (family, _) in shown if r["panel"] == panel))
        colors = plt.get_cmap("tab10" if len(families) <= 10 else "tab20").colors
        for i, family in enumerate(families):
            points = sorted((share, r) for r, (name, share) in shown if r["panel"] == panel and name == family)
            xs = [100 * share for share, _ in points] + [100]
            ys = [r[metric] for _, r in points] + [1.0]
            lo = [y - r.get(metric + "_lo", y) for y, (_, r) in zip(ys, points)] + [0]
            hi = [r.get(metric + "_hi", y) - y for y, (_, r) in zip(ys, points)] + [0]
            ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                marker="o",
                capsize=3,
                label=family,
                color=colors[i % len(colors)],
                linestyle="--" if dashed(family) else "-",
            )
        ax.set_title(panel)
        ax.set_xlabel("share of the prompt kept (%)")
        ax.grid(alpha=0.3)
    _finish(fig, axes, ylabel, path, legend_size=7)
    return True


def against_bytes(records: Sequence[dict], metric: str, ylabel: str, path: Path) -> bool:
    """Fidelity against the kept cache's bytes as a share of the full cache's (``kv_ratio``: what the
    request's cache holds while it decodes), not against the budget's label, so that methods of any
    shape (ragged heads, per-layer budgets) and budgets in tokens or shares line up on one axis: one
    panel per ``record["panel"]``, one line per method (``KIND`` of ``KIND@BUDGET``), its points in
    order of bytes, each line ending at the full cache (100%, fidelity 1). False, and no file, when no
    compressed method has both figures."""
    shown = [r for r in records if r["method"] != "full" and metric in r and r.get("kv_ratio") is not None]
    if not shown:
        return False
    panels = list(dict.fromkeys(r["panel"] for r in shown))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        mine = [r for r in shown if r["panel"] == panel]
        families = list(dict.fromkeys(r["method"].partition("@")[0] for r in mine))
        colors = plt.get_cmap("tab10" if len(families) <= 10 else "tab20").colors
        for i, family in enumerate(families):
            points = sorted((r for r in mine if r["method"].partition("@")[0] == family), key=lambda r: r["kv_ratio"])
            xs = [100 * r["kv_ratio"] for r in points] + [100]
            ys = [r[metric] for r in points] + [1.0]
            lo = [y - r.get(metric + "_lo", y) for y, r in zip(ys, points)] + [0]
            hi = [r.get(metric + "_hi", y) - y for y, r in zip(ys, points)] + [0]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=family, color=colors[i % len(colors)])
        ax.set_title(panel)
        ax.set_xlabel("KV cache kept (% of the full cache's bytes)")
        ax.grid(alpha=0.3)
    _finish(fig, axes, ylabel, path, legend_size=7)
    return True


METRIC_LABELS = {
    "subspan_em": "accuracy (answer inside the output)",
    "identical_to_full": "fidelity (same answer as the full cache)",
}


def plot_all(rows: Sequence[dict], by_n: Sequence[dict], cells: Sequence[dict], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    methods = method_order(rows)
    written = []
    for metric, ylabel, name in (
        ("f1", "answer token F1", "answer_f1_vs_n.png"),
        ("cit_f1", "citation F1", "citation_f1_vs_n.png"),
        ("hit_rate", "attention hit rate vs full cache", "hit_rate_vs_n.png"),
        ("f1_vs_full", "answer F1 vs full-cache answer", "fidelity_f1_vs_n.png"),
    ):
        against_n(by_n, methods, metric, ylabel, folder / name)
        written.append(folder / name)
    panels = [{**r, "panel": f"{r['dataset']}, N={r['num_docs']}"} for r in by_n]
    if against_bytes(panels, "identical_to_full", METRIC_LABELS["identical_to_full"], folder / "fidelity_vs_bytes.png"):
        written.append(folder / "fidelity_vs_bytes.png")
    if against_position(
        cells, methods, "subspan_em", "accuracy (best-subspan EM)", folder / "accuracy_vs_position.png"
    ):
        written.append(folder / "accuracy_vs_position.png")
    return (
        written
        + depth_heatmaps(cells, methods, "subspan_em", folder)
        + depth_heatmaps(cells, [m for m in methods if m != "full"], "identical_to_full", folder, "_fidelity")
    )
