"""Micro-benchmarks: ``gracecomm-bench [suite=NAME] [overrides]``.

A suite is a function that takes the Hydra config and returns a list of flat records; the
entry point writes them to ``bench.json`` in the run directory and prints a table. Every
time is the best of ``repeats`` runs, and every suite reports its times next to reference
operations timed in the same run (one read of the tensor, ``t.sum()``, and ``torch.topk``),
so the printed ratios survive a busy machine better than absolute times.

Suites live in this package, one module each, registered with `@suite("name")`. A suite's
own options go under its name (``+quantizers.sizes=[...]``); a suite that reads top-level
options of ``bench.yaml`` besides the common ones names them (``options``), and the entry
point refuses an option given on the command line that the chosen suite would not read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

Record = dict[str, Any]
SuiteFn = Callable[[DictConfig], list[Record]]
SUITES: dict[str, SuiteFn] = {}
COMMON_OPTIONS = ("suite", "repeats", "seed", "columns")
SUITE_OPTIONS: dict[str, tuple[str, ...]] = {}  # every option each suite reads


def suite(name: str, options: tuple[str, ...] = ()) -> Callable[[SuiteFn], SuiteFn]:
    """Register a benchmark suite under `name`, reading `options` of ``bench.yaml`` besides
    the common ones and its own ``<name>.*``."""

    def decorator(fn: SuiteFn) -> SuiteFn:
        SUITES[name] = fn
        SUITE_OPTIONS[name] = (*COMMON_OPTIONS, *options, name)
        return fn

    return decorator
