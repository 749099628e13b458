"""Timing for benchmarks: best-of-n wall time with warm-up, synchronising CUDA when the
work runs there. Benchmarks report ratios of times measured in the same run; tests never
assert on times."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def best_of(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
            cuda: bool = False) -> float:
    """Smallest wall time in seconds of `repeats` calls of `fn` after `warmup` calls."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best
