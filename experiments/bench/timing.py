"""Timing for benchmarks: best-of-n CPU time of the process with warm-up, or, when the work
runs on a GPU, its device time between CUDA events. CPU time, unlike wall time, does not
count the time other processes hold the cores, so a busy machine changes it little.
Benchmarks report ratios of times measured in the same run; tests never assert on times."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def best_of(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
            cuda: bool = False) -> float:
    """Smallest time in seconds of `repeats` calls of `fn` after `warmup` calls: process
    CPU time (all threads), or with `cuda` the time on the current CUDA stream."""
    return best_of_each([fn], repeats, warmup, cuda)[0]


def best_of_each(fns: Sequence[Callable[[], Any]], repeats: int = 5, warmup: int = 1,
                 cuda: bool = False) -> list[float]:
    """`best_of` for several functions timed in turn within every repeat, so that a change
    of load or clock during the run reaches all of them alike. With `cuda` a call's time is
    the elapsed time between CUDA events recorded on the current stream before and after
    it (what it queued and any host work that held the queue back); the warm-up calls are
    not timed."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], _cuda_seconds(fn) if cuda else _cpu_seconds(fn))
    return best


def _cpu_seconds(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _cuda_seconds(fn: Callable[[], Any]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
