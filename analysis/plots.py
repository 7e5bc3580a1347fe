"""PNG plots for a report: speed-up bars (method x task) and the per-request accepted-length histogram."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: Path) -> Path:
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speedup_bars(speedup: pa.Table, path: Path) -> Path | None:
    """Grouped bars: one group per task, one bar per method (mean of per-request ratios); ar's 1.0 is the line."""
    rows = [r for r in speedup.to_pylist() if r["method"] != "ar"]
    if not rows:
        return None
    plt = _pyplot()
    tasks = sorted({r["task"] for r in rows})
    methods = sorted({r["method"] for r in rows})
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(tasks) * max(1, len(methods) / 2)), 4))
    for i, method in enumerate(methods):
        values = {r["task"]: r["mean_of_ratios"] for r in rows if r["method"] == method}
        xs = [t + i * width - 0.4 + width / 2 for t in range(len(tasks))]
        ax.bar(xs, [values.get(task, 0.0) for task in tasks], width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("speed-up over ar (mean of per-request ratios)")
    return _save(plt, fig, ax, path)


def accepted_length_histogram(lengths_by_method: dict[str, list[float]], path: Path) -> Path | None:
    lengths_by_method = {m: v for m, v in lengths_by_method.items() if m != "ar" and v}
    if not lengths_by_method:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max(max(v) for v in lengths_by_method.values())
    bins = [1 + 0.25 * i for i in range(int((top - 1) / 0.25) + 2)]
    for method, values in sorted(lengths_by_method.items()):
        ax.hist(values, bins=bins, alpha=0.5, label=method)
    ax.set_xlabel("mean accepted length per request (tokens per target forward)")
    ax.set_ylabel("requests")
    ax.yaxis.get_major_locator().set_params(integer=True)
    return _save(plt, fig, ax, path)
