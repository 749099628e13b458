"""The runs of training sweeps as compact records, for the pages to quote: per run its
command-line overrides, the test metric at every evaluation and at the end, the mean
estimation quality, the collapse verdict, and optionally per-step series of step records.

    python results/runs.py multirun/results/signsgd_lr > results/training_defaults/signsgd_lr.json
    python results/runs.py OUT/a OUT/b --series quality      # also every step's `quality`

Each record: ``run`` (the run directory's name), every override of the run as its own key
(``compressor``, ``trainer.lr``, ``seed``, ...; ``+`` dropped), ``metric`` (its name),
``final``, ``chance`` (a model that ignores its input), ``peak`` and ``peak_epoch``
(1-based) of the test metric, ``evals`` (the test
metric at every evaluation, in order), ``k_hat/k`` (the mean of the steps' ``quality``,
null without one), ``collapse`` (the summary's message, null unless the run collapsed),
``steps``, and with ``--series KEY`` the list ``KEY`` of every step's value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from gracecomm.experiments.reports.tables import Run, load_runs


def overrides(run: Path) -> dict[str, Any]:
    """The run's command-line overrides (``.hydra/overrides.yaml``), values as YAML reads
    them, without Hydra's and the trainer's display options."""
    path = run / ".hydra" / "overrides.yaml"
    out: dict[str, Any] = {}
    for item in yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else []:
        key, _, value = item.lstrip("+~").partition("=")
        if not key.startswith(("hydra.", "trainer.progress")):
            out[key] = yaml.safe_load(value)
    return out


def record(run: Run, series: list[str]) -> dict[str, Any]:
    metric = run.summary.get("metric", "test_acc")
    evals = [e[metric] for e in run.evals if metric in e]
    best = max if run.summary.get("higher_is_better", True) else min
    peak = best(evals) if evals else None
    collapse = run.summary.get("collapse")
    out = {"run": run.path.name, **overrides(run.path), "metric": metric,
           "final": run.summary.get(metric), "chance": run.summary.get("chance"), "peak": peak,
           "peak_epoch": evals.index(peak) + 1 if evals else None, "evals": evals,
           "k_hat/k": run.step_mean("quality"),
           "collapse": collapse["message"] if collapse else None,
           "steps": run.summary.get("steps")}
    for key in series:
        out[key] = [s.get(key) for s in run.steps]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path,
                        help="run or multirun directories of gracecomm-train")
    parser.add_argument("--series", nargs="*", default=[], metavar="KEY",
                        help="step-record keys to keep for every step")
    args = parser.parse_args()
    runs = load_runs(*args.dirs)
    if not runs:
        raise SystemExit(f"runs: no finished run under {', '.join(map(str, args.dirs))}")
    print(json.dumps([record(r, args.series) for r in runs], indent=1))


if __name__ == "__main__":
    main()
