"""The report's plots (matplotlib, optional: ``pip install 'gracecomm[plots]'``): metric
against bytes sent with the Pareto front, compression overhead per method, projected speedup
against bandwidth, training loss and test metric over steps, and the estimation quality of
threshold sparsifiers; `save_figure` writes every PNG of the experiments."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gracecomm.experiments.reports.tables import (
    Run,
    Table,
    flatten,
    option_text,
    varies_among,
    varying_options,
)


def pyplot() -> Any | None:
    try:
        import matplotlib
    except ImportError:
        print("report: plots skipped, matplotlib is not installed: pip install "
              "'gracecomm[plots]'", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def pareto_front(points: Sequence[tuple[float, float]], higher_is_better: bool) -> list[int]:
    """Indices of the points no other point beats on both bytes (fewer) and metric, by bytes."""
    sign = 1.0 if higher_is_better else -1.0
    front, best = [], -math.inf
    for i in sorted(range(len(points)), key=lambda j: (points[j][0], -sign * points[j][1])):
        if sign * points[i][1] > best:
            front.append(i)
            best = sign * points[i][1]
    return front


def _many_lines(plt: Any, *axes: Any) -> None:
    """Up to 40 distinguishable lines: the 20 colours of tab20, solid then dashed."""
    from cycler import cycler
    colors = [plt.get_cmap("tab20")(i) for i in range(20)]
    style = cycler(linestyle=["-", "--"]) * cycler(color=colors)
    for ax in axes:
        ax.set_prop_cycle(style)


def _legend(ax: Any) -> None:
    """A legend beside the axes when it would cover the lines (more than 8 entries)."""
    if len(ax.get_legend_handles_labels()[1]) > 8:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=7)


def plot_labels(runs: Sequence[Run]) -> list[str]:
    """Short legend labels: the compressor's name, its options that differ among the runs of
    that compressor, and the other varying options where a run departs from the most common
    value (a sweep's one small step size shows; the step size every run shares does not)."""
    flats = [flatten(r.config) for r in runs]
    names = [r.summary.get("compressor", "?") for r in runs]
    common = {}
    for key in varying_options(flats):
        values = [repr(f.get(key)) for f in flats]
        common[key] = max(set(values), key=values.count)
    labels = []
    for name, flat in zip(names, flats):
        peers = [f for n, f in zip(names, flats) if n == name]
        shown = [option_text(k[len("compressor."):], v) for k, v in flat.items()
                 if k.startswith("compressor.") and varies_among(k, peers)]
        shown += [option_text(k, flat.get(k)) for k, mode in common.items()
                  if repr(flat.get(k)) != mode]
        labels.append(f"{name}({', '.join(shown)})" if shown else name)
    return labels


def save_figure(fig: Any, path: Path | str) -> None:
    """Write a matplotlib figure as the reports' PNGs are written (120 dpi, tight) and
    close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_all(plt: Any, runs: Sequence[Run], table: Table, out: Path) -> list[Path]:
    """Write every plot that the runs have data for; return their paths."""
    labels = plot_labels(runs)
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({row['run']})" for label, row in zip(labels, table.rows)]
    paths = []

    def save(fig: Any, name: str) -> None:
        paths.append(out / f"{name}.png")
        save_figure(fig, paths[-1])

    metric = table.metrics[0]
    for plot in (plot_pareto, plot_overhead, plot_speedup, plot_loss, plot_quality):
        plot(plt, runs, table, labels, metric, save)
    return paths


def plot_pareto(plt: Any, runs: Sequence[Run], table: Table, labels: Sequence[str],
                metric: str, save: Callable[[Any, str], None]) -> None:
    """The test metric against payload bytes per step, with the Pareto front."""
    scored = [(i, r) for i, r in enumerate(runs) if r.summary.get(metric) is not None
              and r.summary.get("wire_bytes_per_step")]
    if not scored:
        return
    higher = bool(scored[0][1].summary.get("higher_is_better", True))
    points = [(r.summary["wire_bytes_per_step"], r.summary[metric]) for _, r in scored]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    # neighbours along the x axis get labels at staggered heights
    order = sorted(range(len(points)), key=lambda j: points[j][0])
    for rank, j in enumerate(order):
        ax.annotate(labels[scored[j][0]], points[j], fontsize=6, rotation=20,
                    xytext=(3, 3 + 9 * (rank % 3)), textcoords="offset points")
    front = pareto_front(points, higher)
    ax.step([points[i][0] for i in front], [points[i][1] for i in front], where="post",
            color="tab:red", label="Pareto front")
    ax.set(xscale="log", xlabel="payload bytes per rank per step",
           ylabel=f"{metric} ({'higher' if higher else 'lower'} is better)",
           title=f"{metric} against bytes sent")
    ax.legend()
    save(fig, "pareto")


def plot_overhead(plt: Any, runs: Sequence[Run], table: Table, labels: Sequence[str],
                  metric: str, save: Callable[[Any, str], None]) -> None:
    """Compression overhead per step: compress, decompress and memory, stacked."""
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(runs) + 1.5))
    left = [0.0] * len(runs)
    for key in ("compress_s", "decompress_s", "memory_s"):
        widths = [1e3 * r.summary.get(f"{key}_per_step", 0.0) for r in runs]
        ax.barh(labels, widths, left=left, label=key[:-2])
        left = [a + b for a, b in zip(left, widths)]
    ax.set(xlabel="ms per step", title="compression overhead per step")
    ax.invert_yaxis()
    ax.legend()
    save(fig, "overhead")


def plot_speedup(plt: Any, runs: Sequence[Run], table: Table, labels: Sequence[str],
                 metric: str, save: Callable[[Any, str], None]) -> None:
    """Projected speedup over dense allreduce against bandwidth (`gracecomm.network`)."""
    if not table.networks:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _many_lines(plt, ax)
    gbps = [float(n.removesuffix("Gbps")) for n in table.networks]
    for label, row in zip(labels, table.rows):
        ax.plot(gbps, [row.get(f"speedup@{n}") or math.nan for n in table.networks],
                marker="o", label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="bandwidth (Gbps)", ylabel="speedup over dense allreduce",
           title="projected speedup (gracecomm.network)")
    _legend(ax)
    save(fig, "speedup")


def plot_loss(plt: Any, runs: Sequence[Run], table: Table, labels: Sequence[str],
              metric: str, save: Callable[[Any, str], None]) -> None:
    """Training loss (moving average) and the test metric over steps, side by side."""
    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained")
    _many_lines(plt, ax_loss, ax_metric)
    for label, run in zip(labels, runs):
        loss = [s["loss"] for s in run.steps]
        ax_loss.plot([s["step"] for s in run.steps], _smooth(loss, max(1, len(loss) // 50)),
                     label=label)
        ax_metric.plot([e["step"] for e in run.evals], [e.get(metric) for e in run.evals],
                       marker=".", label=label)
    ax_loss.set(xlabel="step", ylabel="training loss (moving average)", title="training loss")
    ax_metric.set(xlabel="step", ylabel=metric, title=f"{metric} over training")
    _legend(ax_metric)
    save(fig, "loss")


def plot_quality(plt: Any, runs: Sequence[Run], table: Table, labels: Sequence[str],
                 metric: str, save: Callable[[Any, str], None]) -> None:
    """The estimation quality k_hat/k over steps of the runs whose sparsifier logged it."""
    with_quality = [(label, run) for label, run in zip(labels, runs)
                    if any("quality" in s for s in run.steps)]
    if not with_quality:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _many_lines(plt, ax)
    for label, run in with_quality:
        ax.plot([s["step"] for s in run.steps if "quality" in s],
                [s["quality"] for s in run.steps if "quality" in s], label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="step", ylabel="achieved k / target k",
           title="estimation quality of threshold sparsifiers")
    _legend(ax)
    save(fig, "quality")
