"""Micro-benchmarks: ``gracecomm-bench [suite=NAME] [overrides]``.

A suite is a function that takes the Hydra config and returns a list of flat records; the
entry point writes them to ``bench.json`` in the run directory and prints a table. Every
time is the best of ``repeats`` runs, and every suite reports its times next to reference
operations timed in the same run (one read of the tensor, ``t.sum()``, and ``torch.topk``),
so the printed ratios survive a busy machine better than absolute times.

Peak extra memory (`PeakMemory`) is the high-water mark of the process's resident memory
above what was resident when the call started (Linux: ``VmHWM`` of /proc/self/status,
reset through /proc/self/clear_refs), measured after every timing of the run because it
first makes glibc map and unmap every allocation of 64 KiB or more, so that freed memory
leaves the resident set instead of being reused unseen. It counts torch, numpy and numba
allocations alike (tracemalloc sees none of torch's) and includes the call's outputs.
Buffers the library keeps for reuse (`gracecomm.buffers.release_recycled`) are released before
each measured call, so that it is charged for them as a first call would be.

Suites live in this package, one module each, registered with `@suite("name")`. A suite's
own options go under its name (``+quantizers.sizes=[...]``); a suite that reads top-level
options of ``bench.yaml`` besides the common ones names them (``options``), and the entry
point refuses an option given on the command line that the chosen suite would not read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gracecomm.buffers import release_recycled
from gracecomm.validation import ConfigError

Record = dict[str, Any]
SuiteFn = Callable[[DictConfig], list[Record]]
SUITES: dict[str, SuiteFn] = {}
COMMON_OPTIONS = ("suite", "repeats", "seed", "columns", "threads")
SUITE_OPTIONS: dict[str, tuple[str, ...]] = {}  # every option each suite reads
SUITE_COLUMNS: dict[str, tuple[str, ...] | None] = {}  # the table's columns without columns=
_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def suite(name: str, options: tuple[str, ...] = (),
          columns: tuple[str, ...] | None = None) -> Callable[[SuiteFn], SuiteFn]:
    """Register a benchmark suite under `name`, reading `options` of ``bench.yaml`` besides
    the common ones and its own ``<name>.*``; its table shows `columns` unless the command
    line names others (None: every key of its records)."""

    def decorator(fn: SuiteFn) -> SuiteFn:
        SUITES[name] = fn
        SUITE_OPTIONS[name] = (*COMMON_OPTIONS, *options, name)
        SUITE_COLUMNS[name] = columns
        return fn

    return decorator


def suite_options(cfg: DictConfig, name: str,
                  defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A suite's own options (``<name>.*`` of bench.yaml or the command line) as a dict,
    over `defaults`; with `defaults`, an option they do not list is refused."""
    given = cfg.get(name)
    options = OmegaConf.to_container(given, resolve=True) if given is not None else {}
    assert isinstance(options, dict)
    if defaults is None:
        return options
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ConfigError(f"bench: unknown option(s) {unknown} of suite '{name}'; allowed: "
                          f"{', '.join(defaults)}")
    return {**defaults, **options}


class PeakMemory:
    """Peak resident memory of a call above its start (see the module docstring)."""

    def __init__(self) -> None:
        self.available = _STATUS.exists() and _CLEAR.exists() and self._untrimmed_malloc()

    @staticmethod
    def _untrimmed_malloc() -> bool:
        """glibc: allocations from 64 KiB mapped on their own, freed memory returned."""
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(mallopt and mallopt(m_mmap_threshold, 1 << 16) and mallopt(m_trim_threshold, 0))

    @staticmethod
    def _status(key: str) -> int:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{_STATUS} has no {key}")

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Bytes of resident memory `fn` needed at its peak beyond the start (NaN where
        this cannot be measured)."""
        if not self.available:
            return float("nan")
        release_recycled()
        _CLEAR.write_text("5")  # reset the high-water mark to the current resident set
        start = self._status("VmRSS")
        fn()
        # the kernel updates the high-water mark lazily, so a call that frees memory it did
        # not allocate can read below its start: it needed no extra memory
        return float(max(0, self._status("VmHWM") - start))
