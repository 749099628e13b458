"""Per-step statistics. Components add to one `Metrics` object that the pipeline shares with
them; the trainer pops one flat dict per step.

Keys written by the core:

- ``dense_bytes``: bytes of the gradients before compression (numel * element_size).
- ``wire_bytes``: bytes of the payload tensors, counted by the communicator.
- ``sent_bytes``: bytes handed to collectives, including size headers and padding.
- ``compress_s``, ``decompress_s``, ``memory_s``, ``comm_s``: seconds spent in each stage.
- ``tensors``: number of tensors compressed this step.
- ``exchanges``: calls that exchanged payloads (one per DDP bucket, or one per `step_many`).
- ``coll_<kind>_calls``, ``coll_<kind>_bytes``: collectives issued and their message sizes,
  for the network cost model (`grace.network`; kinds allreduce, allgather, broadcast,
  ps_push, ps_pull).

Derived on `pop()`: ``compression_factor`` = dense_bytes / wire_bytes (not a compressor's
``ratio``, the fraction it keeps) and, where a sparsifier reported
``k_hat`` and ``k``, ``quality`` = k_hat / k (the estimation quality of threshold methods).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Metrics:
    """Sums of per-step quantities plus per-tensor samples (for percentile bands)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._samples: dict[str, list[float]] = defaultdict(list)
        self.sync_cuda = False

    def add(self, key: str, value: float) -> None:
        """Add `value` to the step's running sum for `key`."""
        self._sums[key] += float(value)

    def get(self, key: str) -> float:
        """The step's running sum for `key` so far (0 if nothing was added)."""
        return self._sums.get(key, 0.0)

    def observe(self, key: str, value: float) -> None:
        """Record one per-tensor sample; `pop()` reports its mean, 5th and 95th percentiles."""
        self._samples[key].append(float(value))

    @contextmanager
    def timer(self, key: str) -> Iterator[None]:
        """Add the wall time of the block to `key` (synchronising CUDA when in use)."""
        if self.sync_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync_cuda:
                torch.cuda.synchronize()
            self._sums[key] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """Return this step's statistics and start a new step."""
        out = dict(self._sums)
        if out.get("wire_bytes", 0) > 0 and "dense_bytes" in out:
            out["compression_factor"] = out["dense_bytes"] / out["wire_bytes"]
        if out.get("k", 0) > 0 and "k_hat" in out:
            out["quality"] = out["k_hat"] / out["k"]
        for key, values in self._samples.items():
            t = torch.tensor(values, dtype=torch.float64)
            out[f"{key}_mean"] = float(t.mean())
            out[f"{key}_p5"] = float(torch.quantile(t, 0.05))
            out[f"{key}_p95"] = float(torch.quantile(t, 0.95))
        self._sums = defaultdict(float)
        self._samples = defaultdict(list)
        return out
