"""The command line of the framework scripts: ``SCRIPT OUT NAME...`` runs each scenario."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from gracecomm.experiments.training.launch import exit_now, finish_process_group


def main(run: Callable[[Path, str], None]) -> None:
    """Run every scenario named after the output folder, in turn, then meet the other ranks
    (`finish_process_group`) and end without the interpreter's teardown (`exit_now`), as the
    library's own launcher does. A process that exits with a Gloo group alive sometimes
    aborts in that teardown ("terminate called without an active exception"), gracecomm or
    not: 2 of 8 runs of plain DDP and PyTorch's fp16 hook under Accelerate did. Destroying
    the group first (`accelerator.end_training()`, what docs/integrations.md tells users)
    avoids it on torch 2.13, but on torch 2.6, the declared floor, the destruction sometimes
    never returned (experiments/training/launch.py)."""
    folder = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        run(folder, scenario)
    finish_process_group()  # every rank's results are written
    exit_now()
