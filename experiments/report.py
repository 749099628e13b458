"""Sweep reports: tables and plots from the ``metrics.jsonl`` of every run under a directory.

    gracecomm-report multirun/2026-11-21/23-50-35          # a sweep
    gracecomm-report outputs/2026-11-21/23-50-35_topk      # one run
    gracecomm-report multirun/... --out report/ --wandb    # also to W&B

Writes ``report.md`` and ``report.csv`` (one row per run: method = compressor with the
options that vary across the runs, memory, communicator, the task's test metric, bytes per
step (for a parameter server also the downlink every rank receives), the compression factor
dense / sent, compression overhead, measured communication and the projected speedup over
dense ring allreduce at each modelled bandwidth, see `gracecomm.network`; per-step figures are
the run summary's, over steady-state steps, with the start-up step's time apart) and PNG
plots: metric against bytes sent with the Pareto front, overhead per method, projected
speedup against bandwidth, training loss and test metric over steps, and the estimation
quality k_hat/k over steps where a sparsifier logged it. Every Hydra multirun of
`gracecomm.experiments.train` writes its report through `ReportCallback` (configured in train.yaml);
with ``logger=wandb`` the table and plots also go to W&B, in the sweep's group.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from gracecomm.configstore import generated
from gracecomm.experiments.loggers import (
    WandbLogger,
    import_wandb,
    logged_group,
    sweep_group,
    wandb_mode,
)
from gracecomm.experiments.train import CONFIG_DIR, format_bytes

# method_defaults.*: the trainer options a run took from its compressor (the trainer options
# themselves are shown)
HIDDEN_OPTIONS = re.compile(
    r"^(logger|hydra|method_defaults|trainer\.(progress|timeout_s|collective_timeout_s))\b")
STANDARD_BYTES = {"dense_bytes", "wire_bytes", "sent_bytes", "downlink_bytes"}
ALWAYS_SHOWN = ("ratio", "fpr")  # the fraction kept by a sparsifier; a Bloom filter's rate


@dataclass
class Run:
    """One training run as its JSONL tells it (the last attempt, if the file was reused)."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    def step_mean(self, key: str) -> float | None:
        values = [s[key] for s in self.steps if isinstance(s.get(key), (int, float))]
        return sum(values) / len(values) if values else None


def _natural(path: Path) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(path))]


def read_run(run_dir: Path) -> Run | None:
    """The run whose ``metrics.jsonl`` is in `run_dir`, as its last attempt tells it (an
    attempt that reuses the file starts again at its config record); None if that attempt
    wrote no summary (it did not finish). The one reader of run files."""
    config: dict[str, Any] = {}
    summary: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        kind = record.get("type")
        if kind == "config":
            config, summary, steps, evals = record["config"], None, [], []
        elif kind == "step":
            steps.append(record)
        elif kind == "eval":
            evals.append(record)
        elif kind == "summary":
            summary = record
    return None if summary is None else Run(Path(run_dir), config, summary, steps, evals)


def load_runs(*roots: Path) -> list[Run]:
    """Every finished run under `roots` (runs without a summary record are skipped with a
    note on stderr), in natural order of their directories."""
    runs = []
    paths = {p for root in roots for p in Path(root).rglob("metrics.jsonl")}
    for path in sorted(paths, key=_natural):
        run = read_run(path.parent)
        if run is None:
            print(f"report: skipping {path.parent} (no summary: the run did not finish)",
                  file=sys.stderr)
            continue
        runs.append(run)
    return runs


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(node, list) and any(isinstance(v, dict) for v in node):  # a list of parts
        return _flatten({str(i): v for i, v in enumerate(node)}, prefix)
    return {prefix: tuple(node) if isinstance(node, list) else node}


PARTS = ("compressor", "memory", "communicator")


def _varies(key: str, flats: Sequence[dict[str, Any]]) -> bool:
    return len({repr(f.get(key)) for f in flats}) > 1


def _varies_among(key: str, flats: Sequence[dict[str, Any]]) -> bool:
    """Whether `key` differs among the runs that have it (a nested part's options count only
    among the runs that use that part)."""
    return _varies(key, [f for f in flats if key in f])


def _varying_options(flats: Sequence[dict[str, Any]]) -> list[str]:
    """The config keys outside the compressor, memory and communicator that differ across the
    runs (logging and timeouts left out)."""
    keys = dict.fromkeys(k for f in flats for k in f)
    return [k for k in keys if not k.startswith(tuple(f"{p}." for p in PARTS))
            and not HIDDEN_OPTIONS.match(k) and _varies(k, flats)]


def _option(key: str, value: Any) -> str:
    if key.endswith("_target_"):  # a nested part: show its class
        return f"{key.rsplit('.', 1)[0] or key}={str(value).rsplit('.', 1)[-1]}"
    return f"{key}={value}"


def _yaml_options(part: str, name: str) -> dict[str, Any]:
    """The literal options of config group entry PART=NAME (what the user gets by
    default): ``configs/PART/NAME.yaml``, else the entry generated from the class."""
    path = CONFIG_DIR / part / f"{name}.yaml"
    if path.exists():
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    else:
        node = generated(part, name) or {}
    node.pop("defaults", None)
    return {k: v for k, v in _flatten(node).items() if not (isinstance(v, str) and "${" in v)}


def describe(runs: Sequence[Run]) -> list[dict[str, str]]:
    """For each run: its compressor, memory and communicator, each with its key options
    (``ratio``, the classes of nested parts, options that differ from the part's YAML file or
    vary among runs of the same name), and the other config options that vary across the
    runs (logging and timeouts left out)."""
    flats = [_flatten(r.config) for r in runs]
    rest = _varying_options(flats)
    out = []
    for run, flat in zip(runs, flats):
        row: dict[str, str] = {}
        for part in PARTS:
            name = run.summary.get(part, "?")
            peers = [f for r, f in zip(runs, flats) if r.summary.get(part) == name]
            defaults = _yaml_options(part, name)
            shown = []
            for key, value in flat.items():
                option = key[len(part) + 1:]
                if not key.startswith(f"{part}.") or option == "_target_":
                    continue
                if (option.rsplit(".", 1)[-1] in ALWAYS_SHOWN or option.endswith("._target_")
                        or defaults.get(option, value) != value or _varies_among(key, peers)):
                    shown.append(_option(option, value))
            row[part] = f"{name}({', '.join(shown)})" if shown else name
        row["options"] = ", ".join(_option(k, flat.get(k)) for k in rest)
        out.append(row)
    return out


@dataclass
class Table:
    """Rows of the report, with the metric columns and network labels they hold."""

    rows: list[dict[str, Any]]
    metrics: list[str]
    networks: list[str]


def build_table(runs: Sequence[Run]) -> Table:
    """One row per run (numbers unformatted)."""
    metrics = list(dict.fromkeys(r.summary.get("metric", "test_acc") for r in runs))
    networks = list(dict.fromkeys(k.split("@", 1)[1] for r in runs for k in r.summary
                                  if k.startswith("speedup@")))
    extras = list(dict.fromkeys(
        k for r in runs for s in r.steps for k in s
        if (k.endswith("_bytes") and k not in STANDARD_BYTES and not k.startswith("coll_"))
        or k == "quality"))
    rows = []
    for run, names in zip(runs, describe(runs)):
        s = run.summary
        row: dict[str, Any] = {"run": str(run.path.name), **names}
        for metric in metrics:
            row[metric] = s.get(metric) if s.get("metric", "test_acc") == metric else None
        row.update({"steps": s.get("steps"), "wire_bytes/step": s.get("wire_bytes_per_step"),
                    "compression_factor": s.get("compression_factor")})
        if s.get("downlink_bytes_per_step"):  # a parameter server: both directions
            row.update({"downlink_bytes/step": s["downlink_bytes_per_step"],
                        "compression_factor_down": s.get("compression_factor_down")})
        row.update({"overhead_ms/step": 1e3 * s.get("overhead_s_per_step", math.nan),
                    "comm_ms/step": 1e3 * s.get("comm_s_per_step", math.nan),
                    "startup_s": s.get("startup_step_s")})
        for extra in extras:
            row[f"{extra}/step" if extra != "quality" else "k_hat/k"] = run.step_mean(extra)
        for net in networks:
            row[f"speedup@{net}"] = s.get(f"speedup@{net}")
        rows.append(row)
    return Table(rows, metrics, networks)


def _cell(key: str, value: Any) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if key.endswith("bytes/step"):
            return format_bytes(value)
        if key.startswith(("speedup@", "compression_factor")):
            return f"{value:.2f}x"
        return f"{value:.4g}"
    return str(value)


def _columns(table: Table) -> list[str]:
    columns = list(dict.fromkeys(k for row in table.rows for k in row))
    if not any(row.get("options") for row in table.rows):
        columns.remove("options")
    return columns


def markdown(table: Table, source: Path, plots: Sequence[Path]) -> str:
    columns = _columns(table)
    lines = [f"# Report: {source}", "",
             f"{len(table.rows)} runs. Bytes are per rank per step (payload; with a parameter "
             "server wire_bytes is the uplink and downlink_bytes what every rank receives); "
             "compression_factor is dense bytes / bytes sent; overhead is compress + "
             "decompress + memory time per step; speedup@B is the projected step time with "
             "dense gradients on ring allreduce over the projected step time of the run, on a "
             "modelled network of bandwidth B (gracecomm.network). Per-step figures are means over "
             "the steady-state steps (all but each process's first); startup_s is that first "
             "step's time (kernels loading, buffers being built). Times depend on the CPU and "
             "its load; accuracies on the seeded data and training.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(c, row.get(c)) for c in columns) + " |"
              for row in table.rows]
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_csv(table: Table, path: Path) -> None:
    columns = _columns(table)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table.rows)


# -- plots -----------------------------------------------------------------------------------

def _pyplot() -> Any | None:
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
    flats = [_flatten(r.config) for r in runs]
    names = [r.summary.get("compressor", "?") for r in runs]
    common = {}
    for key in _varying_options(flats):
        values = [repr(f.get(key)) for f in flats]
        common[key] = max(set(values), key=values.count)
    labels = []
    for name, flat in zip(names, flats):
        peers = [f for n, f in zip(names, flats) if n == name]
        shown = [_option(k[len("compressor."):], v) for k, v in flat.items()
                 if k.startswith("compressor.") and _varies_among(k, peers)]
        shown += [_option(k, flat.get(k)) for k, mode in common.items()
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
    scored = [(i, r) for i, r in enumerate(runs) if r.summary.get(metric) is not None
              and r.summary.get("wire_bytes_per_step")]
    if scored:
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

    if table.networks:
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

    with_quality = [(label, run) for label, run in zip(labels, runs)
                    if any("quality" in s for s in run.steps)]
    if with_quality:
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
    return paths


# -- entry points ----------------------------------------------------------------------------

@dataclass
class Report:
    source: Path
    table: Table
    markdown: Path
    csv: Path
    plots: list[Path]


def write_report(source: Path, out: Path | None = None, plots: bool = True) -> Report:
    """Read every run under `source`; write report.md, report.csv and the plots into `out`
    (default: `source`)."""
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"report: {source} is not a directory of runs")
    runs = load_runs(source)
    if not runs:
        raise FileNotFoundError(f"report: no finished run (metrics.jsonl with a summary) "
                                f"under {source}")
    out = Path(out or source)
    out.mkdir(parents=True, exist_ok=True)
    table = build_table(runs)
    plt = _pyplot() if plots else None
    images = plot_all(plt, runs, table, out) if plt is not None else []
    report = Report(source, table, out / "report.md", out / "report.csv", images)
    report.markdown.write_text(markdown(table, source, images), encoding="utf-8")
    write_csv(table, report.csv)
    return report


def log_to_wandb(report: Report, project: str = "gracecomm", entity: str | None = None,
                 mode: str = "auto", group: str | None = None) -> None:
    """Send the report's table and plots to W&B as one ``report`` run in `group` (the sweep's
    group, so it sits next to the sweep's runs)."""
    wandb = import_wandb()
    run = wandb.init(project=project, entity=entity, group=group, job_type="report",
                     name=f"report-{group}" if group else "report", dir=str(report.markdown.parent),
                     mode=wandb_mode(mode), reinit="finish_previous")
    log_report(run, report)
    run.finish()


def log_report(run: Any, report: Report) -> None:
    """Log the report's table and plots into the W&B `run` (a sweep's report run, or a
    training run's own report)."""
    wandb = import_wandb()
    columns = _columns(report.table)
    table = wandb.Table(columns=columns,
                        data=[[_cell(c, row.get(c)) for c in columns] for row in report.table.rows])
    run.log({"report/table": table,
             **{f"report/{p.stem}": wandb.Image(str(p)) for p in report.plots}})


class ReportCallback(Callback):
    """Hydra callback: at the end of a multirun, write the sweep's report into its directory
    (and to W&B when the sweep logged there)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        report = write_report(sweep)
        print(f"report: {report.markdown}", flush=True)
        logger = config.get("logger")
        if logger is not None and issubclass(get_class(logger._target_), WandbLogger):
            log_to_wandb(report, project=logger.get("project", "gracecomm"),
                         entity=logger.get("entity"), mode=logger.get("mode", "auto"),
                         group=sweep_group(config.hydra))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gracecomm-report",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a run directory or a multirun directory")
    parser.add_argument("--out", type=Path, help="where to write (default: SOURCE)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--wandb", action="store_true", help="also log the table and plots to W&B")
    parser.add_argument("--wandb-project", default="gracecomm")
    parser.add_argument("--wandb-entity")
    parser.add_argument("--wandb-mode", default="auto", help="auto | online | offline | disabled")
    args = parser.parse_args(argv)
    report = write_report(args.source, args.out, plots=not args.no_plots)
    if args.wandb:
        log_to_wandb(report, args.wandb_project, args.wandb_entity, args.wandb_mode,
                     group=logged_group(args.source) or args.source.resolve().name)
    print(report.markdown.read_text(encoding="utf-8"))
    print(f"written: {report.markdown}, {report.csv}"
          + "".join(f", {p}" for p in report.plots))


if __name__ == "__main__":
    main()
