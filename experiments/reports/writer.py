"""A report written (`write_report`: report.md, report.csv and the plots of the runs under a
directory) and logged to Weights & Biases (`log_report` into a run, `log_to_wandb` as a run
of its own)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gracecomm.experiments.reports.plots import plot_all, pyplot
from gracecomm.experiments.reports.tables import (
    Table,
    build_table,
    cell_text,
    load_runs,
    markdown,
    table_columns,
    write_csv,
)
from gracecomm.experiments.training.loggers import import_wandb, wandb_mode


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
    plt = pyplot() if plots else None
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
    columns = table_columns(report.table)
    table = wandb.Table(columns=columns,
                        data=[[cell_text(c, row.get(c)) for c in columns]
                              for row in report.table.rows])
    run.log({"report/table": table,
             **{f"report/{p.stem}": wandb.Image(str(p)) for p in report.plots}})

