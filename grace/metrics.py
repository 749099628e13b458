"""Per-step statistics. Components add to one `Metrics` object that the pipeline shares with
them; the trainer pops one flat dict per step.

Keys written by the core:

- ``dense_bytes``: bytes of the gradients before compression (numel * element_size).
- ``wire_bytes``: bytes of the payload tensors, counted by the communicator.
- ``sent_bytes``: bytes handed to collectives, including size headers and padding.
- ``compress_s``, ``decompress_s``, ``memory_s``: seconds spent in each stage (decompression
  of an asynchronous exchange runs on its worker thread, overlapped with backward).
- ``comm_s``: seconds the training thread waited for communication; with the asynchronous
  DDP hook, from the return of the step's last bucket hook until its last collective
  completed (communication hidden behind backward is not counted).
- ``comm_async_s``: seconds the asynchronous exchange's worker waited for collectives.
- ``tensors``: number of tensors compressed this step.
- ``exchanges``: calls that exchanged payloads (one per DDP bucket, or one per `step_many`).
- ``coll_<kind>_calls``, ``coll_<kind>_bytes``: collectives issued and their message sizes,
  for the network cost model (`gracecomm.network`; kinds allreduce, allgather, broadcast,
  ps_push, ps_pull). With the two-level exchange (`gracecomm.hierarchy`) these are the
  collectives across nodes, and those inside a node are ``node_coll_<kind>_calls`` and
  ``node_coll_<kind>_bytes`` (the same kinds and message sizes, and ``reduce``: the bytes
  of the tensor reduced).
- ``intra_node_bytes``: bytes of this rank's tensors it sent into collectives inside its
  node (two-level exchange only; a reduce's destination and a broadcast's receivers send
  none).

Derived on `pop()`: ``cross_node_bytes`` = sent_bytes (what the communicator sent: across
nodes with the two-level exchange; the flat exchange does not know the nodes, so it counts
every byte as crossing) beside ``intra_node_bytes`` (0 where nothing was sent inside a node),
``compression_factor`` = dense_bytes / wire_bytes (not a compressor's
``ratio``, the fraction it keeps) and, where a sparsifier reported
``k_hat`` and ``k``, ``quality`` = k_hat / k (the estimation quality of threshold methods).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class Metrics:
    """Sums of per-step quantities plus per-tensor samples (for percentile bands). Safe to
    update from the exchange's worker thread while the training thread updates it too.

    Attributes:
        sync_cuda: Synchronise CUDA around timers (set by the pipeline for CUDA tensors).

    Example:
        >>> from gracecomm import Metrics
        >>> metrics = Metrics()
        >>> metrics.add("dense_bytes", 400); metrics.add("wire_bytes", 100)
        >>> metrics.pop()
        {'dense_bytes': 400.0, 'wire_bytes': 100.0, 'compression_factor': 4.0}
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._samples: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()
        self._by_thread = threading.local()
        self.sync_cuda = False

    def __deepcopy__(self, memo: dict[int, Any]) -> Metrics:
        """A copy (of a compressor, say) records into new, empty metrics."""
        fresh = type(self)()
        fresh.sync_cuda = self.sync_cuda
        return fresh

    def add(self, key: str, value: float) -> None:
        """Add to the step's running sum of a key.

        Args:
            key: The statistic (module docstring).
            value: What to add.
        """
        with self._lock:
            self._sums[key] += float(value)
        own = self._by_thread.__dict__
        own[key] = own.get(key, 0.0) + float(value)

    def get(self, key: str) -> float:
        """The step's running sum of a key so far.

        Args:
            key: The statistic.

        Returns:
            The sum (0 if nothing was added).
        """
        return self._sums.get(key, 0.0)

    def added_here(self, key: str) -> float:
        """Everything this thread has added to a key so far (all steps): the difference of
        two readings is what the thread added in between, whatever other threads add.

        Args:
            key: The statistic.

        Returns:
            The thread's total.
        """
        return self._by_thread.__dict__.get(key, 0.0)

    def observe(self, key: str, value: float) -> None:
        """Record one per-tensor sample; `pop` reports their mean, 5th and 95th percentiles.

        Args:
            key: The statistic.
            value: The sample.
        """
        with self._lock:
            self._samples[key].append(float(value))

    @contextmanager
    def timer(self, key: str) -> Iterator[None]:
        """A context manager adding the wall time of its block to a key (synchronising CUDA
        when in use).

        Args:
            key: The statistic (``compress_s``, ...).

        Returns:
            The context manager.
        """
        if self.sync_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync_cuda:
                torch.cuda.synchronize()
            self.add(key, time.perf_counter() - start)

    def pop(self) -> dict[str, float]:
        """This step's statistics; a new step starts.

        Returns:
            The sums, the derived ``cross_node_bytes``, ``intra_node_bytes``,
            ``compression_factor`` and ``quality`` (module docstring), and
            ``<key>_mean``, ``<key>_p5``, ``<key>_p95`` of each sampled key.
        """
        with self._lock:
            sums, samples = self._sums, self._samples
            self._sums, self._samples = defaultdict(float), defaultdict(list)
        out = dict(sums)
        if "sent_bytes" in out or "intra_node_bytes" in out:
            out["cross_node_bytes"] = out.get("sent_bytes", 0.0)
            out.setdefault("intra_node_bytes", 0.0)
        if out.get("wire_bytes", 0) > 0 and "dense_bytes" in out:
            out["compression_factor"] = out["dense_bytes"] / out["wire_bytes"]
        if out.get("k", 0) > 0 and "k_hat" in out:
            out["quality"] = out["k_hat"] / out["k"]
        for key, values in samples.items():
            t = torch.tensor(values, dtype=torch.float64)
            out[f"{key}_mean"] = float(t.mean())
            out[f"{key}_p5"] = float(torch.quantile(t, 0.05))
            out[f"{key}_p95"] = float(torch.quantile(t, 0.95))
        return out
