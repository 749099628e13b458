"""Fused passes over |x| for the threshold sparsifiers (SIDCo, DGC, RedSync, GaussianKSGD).

Two operations, each one read of the tensor:

- `moments(x, lo)`: the count of the exceedances |x| > lo and the sums of (|x| - lo) and
  (|x| - lo)^2 over them (float64 accumulation). With lo = 0 these are the nonzeros; a NaN or
  Inf anywhere makes the sums non-finite, which is how callers detect bad input for free.
- `select(x, thr, expected)`: the flat indices of |x| >= thr in increasing order.

Strict and inclusive comparisons are both expressed through these two: |x| > t is
|x| >= `above(t)` and |x| >= t is |x| > `below(t)`, with thresholds first rounded to the
tensor's dtype, so that every backend compares the same numbers.

Backends (option ``backend`` of the sparsifiers):

- ``torch``: abs, compaction and reductions in torch; any device; full-size temporaries.
- ``numba``: parallel CPU kernels over 64K-element chunks without full-size temporaries;
  `select` writes into per-chunk buffers sized from the expected count and rescans only the
  chunks that overflow them, so the result is exact whatever the estimate.
- ``auto``: numba for CPU tensors of at least `NUMBA_MIN_NUMEL` elements when numba is
  installed (the ``fast`` extra), torch otherwise.

Both give the same counts and indices; the sums agree to float64 rounding.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from grace.validation import MissingDependency

BACKENDS = ("auto", "torch", "numba")
NUMBA_MIN_NUMEL = 1 << 17
CHUNK = 1 << 16  # elements per parallel work item of the numba kernels
BLOCK = 32  # elements tested together before the scalar scan in `select`


@dataclass(frozen=True)
class Moments:
    """Exceedances |x| > lo: their number and the sums of (|x| - lo) and (|x| - lo)^2."""

    count: int
    s1: float
    s2: float

    @property
    def finite(self) -> bool:
        return bool(np.isfinite(self.s1) and np.isfinite(self.s2))


@functools.cache
def numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def check_backend(backend: str, owner: str) -> str:
    """Validate the option (``numba`` needs numba installed)."""
    from grace.validation import check_choice

    check_choice(backend, BACKENDS, owner, "backend")
    if backend == "numba" and not numba_installed():
        raise MissingDependency(f"{owner}: option backend='numba' needs numba; install it "
                                "with `pip install 'numba>=0.59'` or use backend=auto/torch")
    return backend


def use_numba(backend: str, x: torch.Tensor) -> bool:
    if backend == "torch" or x.device.type != "cpu":
        return False
    if backend == "numba":
        return True
    return x.numel() >= NUMBA_MIN_NUMEL and numba_installed()


def working(flat: torch.Tensor) -> torch.Tensor:
    """The 1-D tensor the passes read: float32/float64 as they are, fp16/bf16 upcast to float32."""
    flat = flat.detach()
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    return flat.contiguous()


def rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (thresholds are compared in the tensor's precision)."""
    return float(np.float32(value)) if dtype == torch.float32 else float(value)


def above(value: float, dtype: torch.dtype) -> float:
    """The smallest `dtype` number greater than `value` rounded: |x| > value <=> |x| >= above."""
    np_type = np.float32 if dtype == torch.float32 else np.float64
    return float(np.nextafter(np_type(value), np_type(np.inf)))


def below(value: float, dtype: torch.dtype) -> float:
    """The largest `dtype` number less than `value` rounded: |x| >= value <=> |x| > below."""
    np_type = np.float32 if dtype == torch.float32 else np.float64
    return float(np.nextafter(np_type(value), np_type(-np.inf)))


def moments(x: torch.Tensor, lo: float, backend: str = "auto") -> Moments:
    """Count and first two sums of the exceedances |x| > lo of the working tensor `x`
    (NaN counts as an exceedance so that it reaches the sums)."""
    lo = rounded(lo, x.dtype)
    if use_numba(backend, x):
        kernels = _kernels()
        kernels.use_torch_threads()
        count, s1, s2 = kernels.moments(x.numpy(), lo)
        return Moments(int(count), float(s1), float(s2))
    a = x.abs()
    excess = a[~(a <= lo)].double() - lo
    return Moments(excess.numel(), float(excess.sum()), float(excess.square().sum()))


def count_above(x: torch.Tensor, thr: float, backend: str = "auto") -> int:
    """Number of elements with |x| > thr."""
    return moments(x, thr, backend).count


def select(x: torch.Tensor, thr: float, backend: str = "auto",
           expected: int | None = None) -> torch.Tensor:
    """Flat int64 indices of |x| >= thr, ascending. `expected` (the likely count) sizes the
    numba kernel's per-chunk buffers; a wrong guess costs time, never correctness."""
    thr = rounded(thr, x.dtype)
    if use_numba(backend, x):
        d = x.numel()
        guess = d if expected is None else max(0, int(expected))
        cap = min(CHUNK, 2 * guess * CHUNK // max(1, d) + 16)
        arr = x.numpy()
        kernels = _kernels()
        kernels.use_torch_threads()
        return torch.from_numpy(kernels.select(arr, arr.dtype.type(thr), cap))
    return torch.nonzero(x.abs() >= thr).view(-1)


@functools.cache
def _kernels() -> Any:
    """The numba CPU kernels (compiled on first use, then loaded from numba's cache)."""
    try:
        from grace import _exceedance_numba
    except ImportError as err:  # pragma: no cover - guarded by use_numba/check_backend
        raise MissingDependency("the numba backend needs numba: "
                                "pip install 'numba>=0.59'") from err
    return _exceedance_numba
