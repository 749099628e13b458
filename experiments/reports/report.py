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
`gracecomm.experiments.training` writes its report through `ReportCallback` (configured in
train.yaml); with ``logger=wandb`` the table and plots also go to W&B, in the sweep's group.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.utils import get_class
from omegaconf import DictConfig

from gracecomm.experiments.reports.wandb_logger import WandbLogger
from gracecomm.experiments.reports.writer import log_to_wandb, write_report
from gracecomm.experiments.training.loggers import logged_group, sweep_group


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
