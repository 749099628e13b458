"""The command line of the framework scripts: ``SCRIPT OUT NAME...`` runs each scenario."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist


def main(run: Callable[[Path, str], None]) -> None:
    """Run every scenario named after the output folder, in turn, then destroy the process
    group, as a script under torchrun should: a process that exits with a Gloo group alive
    sometimes aborts in the interpreter's teardown ("terminate called without an active
    exception", SIGABRT or SIGSEGV), gracecomm or not (seen with plain DDP and PyTorch's
    fp16 hook under Accelerate)."""
    folder = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        run(folder, scenario)
    if dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while a peer still uses them
        dist.destroy_process_group()
