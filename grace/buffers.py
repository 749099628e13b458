"""Output buffers the compressors and memories share: large CPU tensors lent again once
dropped, so that a step's decompressed outputs and replaced state do not fault in fresh pages
every step."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque

import numpy as np
import torch

HUGE_PAGE_MIN = 1 << 22  # bytes: numpy advises huge pages for buffers from 4 MiB
RECYCLED_KEPT = 1 << 29  # bytes of dropped output buffers kept for reuse (per process)


class _Recycler:
    """Large CPU output buffers, lent again once every tensor on them is gone.

    A buffer of at least `HUGE_PAGE_MIN` bytes comes from numpy, which asks the kernel for
    transparent huge pages (madvise), so a fresh one faults once per 2 MiB instead of once
    per 4 KiB page; but each fault still has the kernel clear the page, and such sizes go
    back to the system when freed. Decompressing and aggregating allocate outputs of the
    same sizes every step, and memories replace their state, so the buffers of dropped
    tensors are kept (up to `RECYCLED_KEPT` bytes, the least recently dropped given back to
    the system first) and lent again. `bash results/reproduce.sh bench_buffers` times
    decompression at 26M elements into recycled buffers and into fresh ones
    (`results/fresh_buffers.py`: the bench with `RECYCLED_KEPT = 0`), stored in
    `results/bench_buffers/` and shown in docs/benchmarks.md.

    A buffer counts as dropped when the numpy view lent for it is collected: torch's tensor
    on it (and every tensor viewing that tensor) holds that view, and nothing else gets
    a reference to it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: OrderedDict[int, np.ndarray] = OrderedDict()  # by id, oldest drop first
        self.kept = 0
        self.returned: deque[np.ndarray] = deque()  # appended by finalizers, any thread

    def take(self, nbytes: int, zeroed: bool) -> np.ndarray:
        """A uint8 buffer of `nbytes` bytes, zero-filled when `zeroed`."""
        with self.lock:
            while self.returned:
                base = self.returned.popleft()
                self.free[id(base)] = base
                self.kept += base.nbytes
            while self.kept > RECYCLED_KEPT:
                self.kept -= self.free.popitem(last=False)[1].nbytes
            base = next((b for b in reversed(self.free.values()) if b.nbytes == nbytes), None)
            if base is not None:
                del self.free[id(base)]
                self.kept -= nbytes
        if base is None:
            base = np.zeros(nbytes, np.uint8) if zeroed else np.empty(nbytes, np.uint8)
        elif zeroed:
            base.fill(0)
        lent = base[:]
        weakref.finalize(lent, self.returned.append, base)
        return lent

    def release(self) -> None:
        """Drop every kept buffer (buffers lent now are kept again once dropped)."""
        with self.lock:
            self.returned.clear()
            self.free, self.kept = OrderedDict(), 0


_RECYCLER = _Recycler()


def release_recycled() -> None:
    """Give the buffers kept for reuse back to the system (a memory measurement then
    charges a call for fresh outputs)."""
    _RECYCLER.release()


def _numpy_backed(numel: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and numel * dtype.itemsize >= HUGE_PAGE_MIN


def recycled(t: torch.Tensor) -> bool:
    """Whether `dense_empty_like(t)` lends a recycled buffer (a CPU tensor from 4 MiB)."""
    return _numpy_backed(t.numel(), t.dtype, t.device)


def dense_empty(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised 1-D tensor for a decompressed output; on the CPU, from 4 MiB, a
    numpy buffer lent by `_Recycler` (a fresh 26M-element float32 ``torch.empty``, which
    faults once per 4 KiB page, cost about 16 reads of the tensor by the time it was
    filled on the project's test machine)."""
    if not _numpy_backed(numel, dtype, device):
        return torch.empty(numel, dtype=dtype, device=device)
    return torch.from_numpy(_RECYCLER.take(numel * dtype.itemsize, False)).view(dtype)


def dense_empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`dense_empty` shaped like `t` (of `dtype`, by default t's): for state that every step
    replaces with a new tensor (residuals, momentum), which would otherwise fault in fresh
    pages every step."""
    return dense_empty(t.numel(), dtype or t.dtype, t.device).view(t.shape)


def difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a - b as a new tensor, on a recycled buffer when large (`dense_empty`)."""
    return torch.sub(a, b, out=dense_empty_like(a, torch.result_type(a, b)))


def dense_zeros(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero 1-D tensor for a decompressed output, from the same buffers as `dense_empty`:
    a fresh one zeroed by the kernel (calloc), a recycled one by memset."""
    if not _numpy_backed(numel, dtype, device):
        return torch.zeros(numel, dtype=dtype, device=device)
    return torch.from_numpy(_RECYCLER.take(numel * dtype.itemsize, True)).view(dtype)
