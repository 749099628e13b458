"""Timing for benchmarks: best-of-n CPU time of the process with warm-up (wall time,
synchronising CUDA, when the work runs there). CPU time, unlike wall time, does not count
the time other processes hold the cores, so a busy machine changes it little. Benchmarks
report ratios of times measured in the same run; tests never assert on times."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def best_of(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
            cuda: bool = False) -> float:
    """Smallest time in seconds of `repeats` calls of `fn` after `warmup` calls: process
    CPU time (all threads), or wall time with `cuda`."""
    return best_of_each([fn], repeats, warmup, cuda)[0]


def best_of_each(fns: Sequence[Callable[[], Any]], repeats: int = 5, warmup: int = 1,
                 cuda: bool = False) -> list[float]:
    """`best_of` for several functions timed in turn within every repeat, so that a change
    of load or clock during the run reaches all of them alike."""
    clock = time.perf_counter if cuda else time.process_time
    for _ in range(warmup):
        for fn in fns:
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            fn()
            if cuda:
                torch.cuda.synchronize()
            best[i] = min(best[i], clock() - start)
    return best
