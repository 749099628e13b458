"""Numba CPU kernels behind `grace.exceedance` (imported only when the numba backend is
used). Work is split into chunks of `CHUNK` elements run in parallel; the float64 sums
use reassociation only (no nnan/ninf), so NaN and Inf propagate into them.

Unless the user chose a threading layer (NUMBA_THREADING_LAYER), the kernels use numba's
``workqueue`` layer: OpenMP worker threads keep spinning after each parallel region and, next
to torch's own pool on a few cores, slowed the surrounding work by up to 10x. It must not be
called from several Python threads at once; choose ``omp`` or ``tbb`` for that.
"""

import os

import numba
import numpy as np
import torch

from grace.exceedance import BLOCK, CHUNK

if numba.config.THREADING_LAYER == "default" and "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"


def use_torch_threads() -> None:
    """Run the kernels on as many threads as torch may use (launchers set that per rank)."""
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))

_FAST = {"reassoc", "contract", "nsz"}


@numba.njit(fastmath=_FAST, cache=True)
def _chunk_moments(y, lo):  # pragma: no cover - compiled
    count = 0
    s1 = 0.0
    s2 = 0.0
    for i in range(y.size):
        e = np.float64(abs(y[i])) - lo
        hit = not e <= 0.0  # true for NaN
        e = e if hit else 0.0
        count += hit
        s1 += e
        s2 += e * e
    return count, s1, s2


@numba.njit(parallel=True, cache=True)
def moments(x, lo):  # pragma: no cover - compiled
    """(count, sum, sum of squares) of |x| - lo over the elements with |x| > lo."""
    n = x.size
    chunks = (n + CHUNK - 1) // CHUNK
    out = np.zeros((chunks, 3))
    for c in numba.prange(chunks):
        count, s1, s2 = _chunk_moments(x[c * CHUNK:min(n, (c + 1) * CHUNK)], lo)
        out[c, 0] = count
        out[c, 1] = s1
        out[c, 2] = s2
    return int(out[:, 0].sum()), out[:, 1].sum(), out[:, 2].sum()


@numba.njit(fastmath=_FAST, cache=True)
def _chunk_select(y, thr, out):  # pragma: no cover - compiled
    # Blocks of BLOCK elements are tested with a vectorised count; only blocks with a hit
    # are scanned, writing branch-free while the buffer has room and only counting after.
    n = 0
    room = out.size - BLOCK
    for b in range(0, y.size, BLOCK):
        z = y[b:b + BLOCK]
        hits = 0
        for i in range(z.size):
            hits += abs(z[i]) >= thr
        if hits == 0:
            continue
        if n <= room:
            for i in range(z.size):
                out[n] = b + i
                n += abs(z[i]) >= thr
        else:
            n += hits
    return n


@numba.njit(cache=True)
def _chunk_select_exact(y, thr, out, base):  # pragma: no cover - compiled
    j = 0
    for i in range(y.size):
        if abs(y[i]) >= thr:
            out[j] = base + i
            j += 1


@numba.njit(parallel=True, cache=True)
def select(x, thr, cap):  # pragma: no cover - compiled
    """Ascending int64 indices of |x| >= thr; `cap` is the per-chunk buffer size."""
    n = x.size
    chunks = (n + CHUNK - 1) // CHUNK
    width = cap + BLOCK
    buf = np.empty(chunks * width, np.int64)
    counts = np.zeros(chunks, np.int64)
    for c in numba.prange(chunks):
        counts[c] = _chunk_select(x[c * CHUNK:min(n, (c + 1) * CHUNK)], thr,
                                  buf[c * width:(c + 1) * width])
    offsets = np.zeros(chunks + 1, np.int64)
    for c in range(chunks):
        offsets[c + 1] = offsets[c] + counts[c]
    result = np.empty(offsets[chunks], np.int64)
    for c in numba.prange(chunks):
        m, o, start = counts[c], offsets[c], c * CHUNK
        if m <= cap:
            for j in range(m):
                result[o + j] = buf[c * width + j] + start
        else:  # the buffer overflowed: rescan this chunk into its exact slot
            _chunk_select_exact(x[start:min(n, start + CHUNK)], thr, result[o:o + m], start)
    return result
