"""The command line of the framework scripts: ``SCRIPT OUT NAME...`` runs each scenario."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def main(run: Callable[[Path, str], None]) -> None:
    """Run every scenario named after the output folder, in turn."""
    folder = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        run(folder, scenario)
