"""Fused passes over |x| for the sparsifiers (Top-k, threshold, SIDCo, DGC, RedSync,
GaussianKSGD).

Three operations, each about one read of the tensor:

- `moments(x, lo)`: the count of the exceedances |x| > lo and the sums of (|x| - lo) and
  (|x| - lo)^2 over them (float64 accumulation), optionally the sum of ln|x| as well. With
  lo = 0 these are the nonzeros; a NaN or Inf anywhere makes the sums non-finite, which is
  how callers detect bad input for free.
- `select(x, thr, expected)`: the flat indices of |x| >= thr in increasing order.
- `top_k(x, k)`: the flat indices of the k largest |x| in increasing order, exact: the kept
  magnitudes are those of ``torch.topk(|x|, k)`` (NaN above Inf, as torch orders them), and
  among equal magnitudes the lowest indices are kept, so every rank chooses the same
  elements from the same tensor. `top_k_of` does the same within a candidate set (the exact
  re-selection of DGC and SIDCo).

Selection compares *magnitude keys*: the bit pattern with the sign cleared, which orders
non-negative floats like their values, every NaN lowered to one key above Inf
(`KeyLayout`). Strict and inclusive comparisons are both expressed through `select`: |x| > t
is |x| >= `above(t)` and |x| >= t is |x| > `below(t)`, with thresholds first rounded to the
tensor's dtype, so that every backend compares the same numbers.

Backends (option ``backend`` of the sparsifiers):

- ``torch``: abs, compaction and reductions in torch; any device; full-size temporaries.
- ``numba``: CPU kernels over 64K-element chunks without full-size temporaries; `select`
  writes into per-chunk buffers sized from the expected count and rescans only the chunks
  that overflow them, so the result is exact whatever the estimate. `top_k` sets the
  threshold from a strided sample so that a little more than k elements reach it, collects
  them in one pass and picks the k largest among them (Sec. 3.1 of Lin et al., *Deep
  Gradient Compression*, samples a threshold the same way; here the result stays exact:
  a threshold that collects too few or too many is narrowed until one fits).
- ``auto``: numba for CPU tensors when numba is installed (for `moments` and `select` from
  `NUMBA_MIN_NUMEL` elements) and not switched off
  (`gracecomm.compressors.shared.stochastic.kernels_enabled`), torch otherwise.

Both give the same counts and indices; the sums agree to float64 rounding.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gracecomm.buffers import dense_empty
from gracecomm.compressors.shared.stochastic import kernels_enabled
from gracecomm.validation import check_choice, require_numba

BACKENDS = ("auto", "torch", "numba")
NUMBA_MIN_NUMEL = 1 << 17
CHUNK = 1 << 16  # elements per parallel work item of the numba kernels


@dataclass(frozen=True)
class KeyLayout:
    """Magnitude keys of a float dtype: its signed integer view with the sign bit cleared
    (`mask`); `inf` is the key of Inf and `top` = inf + 1 the key given to every NaN."""

    int_dtype: torch.dtype
    mask: int
    inf: int

    @property
    def top(self) -> int:
        return self.inf + 1


KEYS = {torch.float16: KeyLayout(torch.int16, 0x7FFF, 0x7C00),
        torch.bfloat16: KeyLayout(torch.int16, 0x7FFF, 0x7F80),
        torch.float32: KeyLayout(torch.int32, 0x7FFF_FFFF, 0x7F80_0000),
        torch.float64: KeyLayout(torch.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000)}


@dataclass(frozen=True)
class Moments:
    """Exceedances |x| > lo: their number, the sums of (|x| - lo) and (|x| - lo)^2, and the
    sum of ln|x| over them where it was asked for (the gamma fits of SIDCo; None otherwise)."""

    count: int
    s1: float
    s2: float
    log_sum: float | None = None

    @property
    def finite(self) -> bool:
        return bool(np.isfinite(self.s1) and np.isfinite(self.s2))


def check_backend(backend: str, owner: str) -> str:
    """Validate the option (``numba`` needs numba installed)."""
    check_choice(backend, BACKENDS, owner, "backend")
    if backend == "numba":
        require_numba(f"{owner}: option backend='numba'", "backend=auto/torch")
    return backend


def use_numba(backend: str, x: torch.Tensor) -> bool:
    if backend == "torch" or x.device.type != "cpu":
        return False
    if backend == "numba":
        return True
    return x.numel() >= NUMBA_MIN_NUMEL and kernels_enabled(x.device)


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


_LAUNCH = threading.Lock()  # one parallel launch of the numba kernels at a time


@contextlib.contextmanager
def threads(x: torch.Tensor) -> Iterator[bool | None]:
    """The kernels' ``parallel`` argument for `x`: True when they split it over threads
    (more than one chunk and more than one torch thread), else None (one thread runs the
    chunks in the calling thread: a parallel launch costs hundreds of microseconds on a busy
    machine). None rather than False gives the serial calls their own argument type, for
    which numba compiles no threaded kernel (`gracecomm.compressors.shared.exceedance_kernels`):
    a first run on small tensors compiles about half as much. While the kernels run on
    threads, the block holds the process's launch lock: numba's workqueue layer aborts the
    process when two Python threads launch parallel kernels at once (the exchange thread of
    `gracecomm.exchange` runs later rounds beside the training thread)."""
    if x.numel() <= CHUNK or torch.get_num_threads() == 1:
        yield None
        return
    with _LAUNCH:
        _kernels().use_torch_threads()
        yield True


def moments(x: torch.Tensor, lo: float, backend: str = "auto", logs: bool = False) -> Moments:
    """Count and first two sums of the exceedances |x| > lo of the working tensor `x`
    (NaN counts as an exceedance so that it reaches the sums), and with `logs` the sum of
    ln|x| over them, in the same pass and in float64 (non-finite with the sums)."""
    lo = rounded(lo, x.dtype)
    if use_numba(backend, x):
        with threads(x) as parallel:
            count, s1, s2, log_sum = _kernels().moments(x.numpy(), lo, parallel, logs)
        if not np.isfinite(s1):  # the kernel's logarithm assumes finite input
            log_sum = s1
        return Moments(int(count), float(s1), float(s2), float(log_sum) if logs else None)
    a = x.abs()
    over = ~(a <= lo)
    wide = a.double()
    excess = torch.where(over, wide - lo, 0.0)
    sums = [over.sum().double(), excess.sum(), excess.square().sum()]
    if logs:
        sums.append(torch.where(over, wide.log(), 0.0).sum())
    count, s1, s2, *log_sum = torch.stack(sums).tolist()  # one read by the host
    return Moments(int(count), s1, s2, log_sum[0] if logs else None)


def count_above(x: torch.Tensor, thr: float, backend: str = "auto") -> int:
    """Number of elements with |x| > thr."""
    return moments(x, thr, backend).count


def layout(x: torch.Tensor, name: str = "", owner: str = "magnitude selection") -> KeyLayout:
    """The key layout of `x`'s dtype; a TypeError naming the tensor for other dtypes."""
    if x.dtype not in KEYS:
        raise TypeError(f"tensor '{name}' has dtype {x.dtype}; {owner} takes float16, "
                        "bfloat16, float32 or float64 tensors")
    return KEYS[x.dtype]


def magnitude_keys(x: torch.Tensor) -> torch.Tensor:
    """The magnitude keys of `x` as a new tensor of its integer view dtype (torch backend)."""
    lay = layout(x)
    return (x.view(lay.int_dtype) & lay.mask).clamp_(max=lay.top)


_NUMPY_INT = {torch.float16: np.int16, torch.float32: np.int32, torch.float64: np.int64}
_NUMPY_FLOAT = {torch.float32: np.float32, torch.float64: np.float64}


def _key_view(x: torch.Tensor) -> np.ndarray:
    """The signed integer view the numba kernels read keys from (no copy)."""
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:  # numpy has no bfloat16
        return x.view(torch.int16).numpy()
    return x.numpy().view(_NUMPY_INT[x.dtype])


def threshold_key(thr: float, dtype: torch.dtype) -> int | None:
    """The smallest key of |x| >= thr, thr rounded to `dtype` as torch compares a tensor
    with a Python number; None when nothing compares >= thr (NaN)."""
    if thr != thr:
        return None
    if thr <= 0.0:
        return 0
    lay = KEYS[dtype]
    return int(torch.tensor(thr, dtype=dtype).view(lay.int_dtype)) & lay.mask


def select(x: torch.Tensor, thr: float, backend: str = "auto",
           expected: int | None = None) -> torch.Tensor:
    """Flat int64 indices of |x| >= thr, ascending. `expected` (the likely count) sizes the
    numba kernel's per-chunk buffers; a wrong guess costs time, never correctness."""
    if not use_numba(backend, x):
        return torch.nonzero(x.abs() >= thr).view(-1)
    return _collect(x, thr, expected)[0]


def _collect(x: torch.Tensor, thr: float, expected: int | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The numba kernels behind `select`: `_fill`, then every hit at its place."""
    slots = _fill(x, thr, expected)
    if slots is None:
        return torch.empty(0, dtype=torch.int64), x[:0]
    return slots.place()


@dataclass
class _Slots:
    """What `_fill` collected of tensor `x` (keys from a threshold's to Inf's, NaN's
    excluded): each chunk's hits (int32 offsets in the chunk and raw elements) in its slot
    of `offsets` and `raw` (chunk c's is bounds[c]:bounds[c + 1]) and their number in
    `counts`; `sums`, the hits' moments where they were asked for."""

    x: torch.Tensor
    offsets: np.ndarray
    raw: np.ndarray
    bounds: np.ndarray
    counts: np.ndarray
    sums: Moments | None = None

    def sums_spec(self, sums_over: float | None, sums: np.ndarray | None = None
                  ) -> tuple[np.ndarray, float, np.ndarray]:
        """The kernels' arguments for per-slot moments over `sums_over` (none when None):
        the slots' elements as floats (float32 or float64 tensors), the threshold, a row of
        sums per slot (`sums` where given, else new)."""
        if sums_over is None:
            return self.raw, 0.0, np.zeros((0, 3))
        return (self.raw.view(_NUMPY_FLOAT[self.x.dtype]), rounded(sums_over, self.x.dtype),
                np.zeros((self.counts.size, 3)) if sums is None else sums)

    def place(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ascending int64 positions, elements) of the hits (every one written)."""
        x, lay = self.x, layout(self.x)
        total = int(self.counts.sum())
        # the results on recycled buffers too (`_staging`): a 5% selection of a 26M-element
        # tensor took 2.8 reads of it on fresh arrays, 2.5 on these
        positions = dense_empty(total, torch.int64, "cpu").numpy()
        values = dense_empty(total, lay.int_dtype, "cpu").numpy()
        with threads(x) as parallel:
            _kernels().place(self.offsets, self.raw, self.bounds, self.counts, positions,
                             values, parallel)
        return torch.from_numpy(positions), torch.from_numpy(values).view(x.dtype)


def _fill(x: torch.Tensor, thr: float, expected: int | None,
          sums_over: float | None = None) -> _Slots | None:
    """Every hit of |x| >= thr into per-chunk slots sized from `expected` (twice each
    chunk's share) by `fill`, with their moments over `sums_over` where given; the chunks
    whose slot overflowed are collected again into slots of the sizes `fill` counted
    (`refill`), so that every hit is written. None when nothing compares >= thr (NaN)."""
    lo = threshold_key(thr, x.dtype)
    if lo is None:
        return None
    d, lay, kernels = x.numel(), layout(x), _kernels()
    chunks = -(-d // CHUNK)
    guess = d if expected is None else max(0, int(expected))
    cap = min(CHUNK, 2 * guess * CHUNK // max(1, d) + 16)
    bounds = kernels.slot_bounds(np.full(chunks, cap, np.int64))
    offsets, raw = _staging(int(bounds[-1]), lay.int_dtype)
    counts, written = np.zeros(chunks, np.int64), np.zeros(chunks, np.int64)
    slots = _Slots(x, offsets, raw, bounds, counts)
    values, sums_lo, sums = slots.sums_spec(sums_over)
    with threads(x) as parallel:
        kernels.fill(_key_view(x), lay.mask, lay.top, lo, lay.inf - lo, offsets, raw, bounds,
                     counts, written, parallel, values, sums_lo, sums)
        if (written < counts).any():
            bounds = kernels.slot_bounds(counts)
            new = _Slots(x, *_staging(int(bounds[-1]), lay.int_dtype), bounds, counts)
            values, _, _ = new.sums_spec(sums_over, sums)
            kernels.refill(_key_view(x), lay.mask, lay.top, lo, lay.inf - lo, slots.offsets,
                           slots.raw, slots.bounds, counts, written, new.offsets, new.raw,
                           new.bounds, parallel, values, sums_lo, sums)
            slots = new
    slots.sums = _summed(sums) if sums_over is not None else None
    return slots


def _summed(sums: np.ndarray) -> Moments:
    """The moments of a pool from the rows of per-slot sums the kernels wrote."""
    return Moments(int(sums[:, 0].sum()), float(sums[:, 1].sum()), float(sums[:, 2].sum()))


class Pool:
    """The elements of the working tensor `x` with |x| >= thr, for passes that read only
    them (the later stages of SIDCo). With the numba kernels they stay in the slots
    `_fill` wrote them to and are filtered there in place; their positions are written
    once, by `indices`. With torch they are positions and values. Collecting and
    filtering can take the `moments` of what they keep as they go (`sums_over`), while
    the elements are in cache, instead of in a pass of their own."""

    def __init__(self, x: torch.Tensor, slots: _Slots | None = None,
                 positions: torch.Tensor | None = None, values: torch.Tensor | None = None
                 ) -> None:
        self.x, self.slots, self.positions, self.values = x, slots, positions, values
        self.sums: Moments | None = None  # what `collect` summed, where it was asked to

    @classmethod
    def collect(cls, x: torch.Tensor, thr: float, backend: str = "auto",
                expected: int | None = None, sums_over: float | None = None) -> Pool | None:
        """The pool of |x| >= thr, with `sums` = moments(x, sums_over) where
        sums_over >= thr is given. `expected` (the likely count) sizes the numba kernels'
        per-chunk slots; the chunks that hold more than twice their share (hits clustered
        in a few layers of a model's gradients, or many more than expected) are collected
        again into slots of the sizes the first pass counted. None when nothing compares
        >= thr (NaN)."""
        if not use_numba(backend, x):
            positions = torch.nonzero(x.abs() >= thr).view(-1)
            pool = cls(x, positions=positions, values=x.index_select(0, positions))
            pool.sums = None if sums_over is None else moments(pool.values, sums_over, "torch")
            return pool
        slots = _fill(x, thr, expected, sums_over)
        if slots is None:
            return None
        pool = cls(x, slots=slots)
        pool.sums = slots.sums
        return pool

    @property
    def count(self) -> int:
        return int(self.slots.counts.sum()) if self.slots is not None else self.values.numel()

    def keep(self, thr: float, sums_over: float | None = None) -> Moments | None:
        """Drop the elements with |x| < thr (thr finite), in place; with `sums_over` >= thr,
        return moments(x, sums_over), taken from what stays."""
        if self.slots is None:
            kept = self.values.abs() >= thr
            self.positions, self.values = self.positions[kept], self.values[kept]
            return None if sums_over is None else moments(self.values, sums_over, "torch")
        slots, lay = self.slots, layout(self.x)
        lo = threshold_key(thr, self.x.dtype)
        values, sums_lo, sums = slots.sums_spec(sums_over)
        with threads(self.x) as parallel:
            _kernels().keep(slots.offsets, slots.raw, slots.bounds, slots.counts, lay.mask,
                            lay.top, lo, lay.inf - lo, parallel, values, sums_lo, sums)
        return None if sums_over is None else _summed(sums)

    def indices(self) -> torch.Tensor:
        """Flat int64 positions of the pooled elements in x, ascending."""
        return self.positions if self.slots is None else self.slots.place()[0]


def _staging(size: int, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """`collect`'s per-chunk buffers (int32 offsets and raw elements, `size` each), from
    `gracecomm.buffers.dense_empty`, which recycles large ones. Buffers the kernel allocated
    itself made a selection of a quarter of a tensor cost 27 reads of it (8 with numpy's),
    and fresh buffers page-fault: a selection of a few percent cost about twice what it does
    on reused ones."""
    return (dense_empty(size, torch.int32, "cpu").numpy(),
            dense_empty(size, dtype, "cpu").numpy())


def may_hold_infinite(x: torch.Tensor) -> bool:
    """Whether the float tensor `x` may hold +-Inf, in one read of it (False: it holds none).

    Numba counts the Infs of a CPU tensor of `CHUNK` elements or more; a smaller one (or one
    on another device) takes torch's minimum and maximum, as fast there, where a NaN also
    answers True. So a run whose only use of numba would be this check on small tensors
    (fp16 on a small model) never pays numba's first dispatch, about 0.2 s of one core."""
    if x.numel() >= CHUNK and use_numba_top_k("auto", x):
        lay = layout(x)
        return bool(_kernels().count_key(_key_view(x), lay.mask, lay.inf))
    low, high = torch.aminmax(x)
    return not (math.isfinite(low) and math.isfinite(high))


def use_numba_top_k(backend: str, x: torch.Tensor) -> bool:
    """`top_k` runs the numba kernels on CPU tensors of any size (one serial call below
    `CHUNK` elements)."""
    return backend != "torch" and x.device.type == "cpu" and (
        backend == "numba" or kernels_enabled(x.device))


def sample_size(k: int, d: int) -> int:
    """Sample of `top_k`'s threshold, (16 k d)^(1/3) keys (at least 256, at most d): it
    balances the sample against the candidates beyond k that its error lets through."""
    return min(d, max(256, round((16.0 * k * d) ** (1.0 / 3.0))))


def top_k(x: torch.Tensor, k: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values): the flat int64 indices of the k elements of largest magnitude of
    the 1-D float tensor `x`, ascending, and x at them; exact, ties to the lowest indices
    (see the module docstring)."""
    d = x.numel()
    if k >= d:
        return torch.arange(d, device=x.device), x.clone()
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=x.device), x[:0]
    lay = layout(x)
    if use_numba_top_k(backend, x):
        with threads(x) as parallel:
            positions, raw = _kernels().top_k(_key_view(x), k, lay.mask, lay.top,
                                              sample_size(k, d), parallel)
        return torch.from_numpy(positions), torch.from_numpy(raw).view(x.dtype)
    indices = _kept(magnitude_keys(x), k)
    return indices, x.index_select(0, indices)


def top_k_of(x: torch.Tensor, indices: torch.Tensor, k: int,
             backend: str = "auto") -> torch.Tensor:
    """The k of `indices` (flat positions in `x`) where |x| is largest, in their given
    order, ties to the earliest: the exact re-selection among threshold candidates."""
    if k >= indices.numel():
        return indices
    values = x.index_select(0, indices)
    if use_numba_top_k(backend, x):
        lay = layout(x)
        chosen, _ = _kernels().pick(indices.numpy(), _key_view(values), k, lay.mask, lay.top)
        return torch.from_numpy(chosen)
    return indices.index_select(0, _kept(magnitude_keys(values), k))


def _kept(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the k largest `keys` (0 < k < numel), ties to the
    earliest. The host reads nothing: with v the k-th largest key, the keys above v and the
    first k - #above equal to it are exactly k, so `torch.nonzero_static` (no sync on CUDA,
    where `nonzero` waits for the count) returns them."""
    v = torch.kthvalue(keys, keys.numel() - k + 1).values
    above = keys > v
    equal = keys == v
    need = k - above.sum()
    mask = above | (equal & (equal.cumsum(0) <= need))
    return torch.nonzero_static(mask, size=k).view(-1)


@functools.cache
def _kernels() -> Any:
    """The numba CPU kernels (compiled on first use, then loaded from numba's cache)."""
    require_numba("the numba backend", "backend=torch")
    from gracecomm.compressors.shared import exceedance_kernels

    return exceedance_kernels
