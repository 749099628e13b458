"""Base of the sparsifiers that estimate a threshold instead of sorting (DGC, SIDCo,
RedSync, GaussianKSGD: the threshold estimators compared by Abdelmoniem et al., MLSys 2021,
Secs. 1.2 and 4).

What they share:

- `estimate(x, k, name)` returns a `Selection` for the working 1-D float32/float64 tensor x
  (fp16/bf16 are upcast; the payload's values keep the tensor's dtype).
- **Estimation quality** q = k_hat / k: the metrics get the sums ``k`` and ``k_hat`` (so
  ``quality`` = sum k_hat / sum k per step) and one per-tensor sample ``quality`` (so
  ``quality_mean``, ``quality_p5`` and ``quality_p95`` per step: the 5th-95th band).
- An all-zero tensor is **excluded**: empty payload, no quality sample, counted in
  ``excluded``. Tensors handled by a guard (exact Top-k on tiny tensors, ...) are counted in
  ``fallbacks``.
- ``nonfinite``: ``raise`` (NonFiniteError naming the tensor) or ``dense`` (send every
  element, e.g. so that a loss scaler sees the overflow). The pipeline's own check
  (``check_finite``) normally stops such tensors before they get here.
- A warm-up of the density (`gracecomm.compressors.shared.schedule.RatioSchedule`):
  ``warmup_epochs`` or an explicit ``warmup_ratios`` list.
- ``sink``: an optional callable (set from Python) that receives one record per call:
  ``{name, step, d, k, k_hat, threshold, stages, fallback, excluded}``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gracecomm.compressor import Payload, TensorInfo
from gracecomm.compressors.shared.exceedance import check_backend, top_k, working
from gracecomm.compressors.shared.schedule import RatioSchedule
from gracecomm.sparse import Sparsifier, sparsify
from gracecomm.validation import check_choice, nonfinite_error


@dataclass
class Selection:
    """Indices chosen for one tensor and how they were found."""

    indices: torch.Tensor
    threshold: float | None = None
    stages: int | None = None  # SIDCo: the stages fitted
    fallback: str | None = None  # the guard that decided, if any
    excluded: bool = False  # all-zero tensor: no quality sample


def exact_topk(x: torch.Tensor, k: int, fallback: str = "topk", backend: str = "auto"
               ) -> Selection:
    """Exact Top-k of |x| (the guards' fallback,
    `gracecomm.compressors.shared.exceedance.top_k`); the threshold recorded is the k-th
    magnitude."""
    indices, values = top_k(x, k, backend)
    thr = float(values.abs().min()) if k else None
    return Selection(indices, threshold=thr, fallback=fallback)


def empty_selection(x: torch.Tensor) -> Selection:
    return Selection(torch.empty(0, dtype=torch.int64, device=x.device), threshold=0.0,
                     fallback="zeros", excluded=True)


class ThresholdSparsifier(Sparsifier):
    """Sparsifier whose k_hat varies around k: payload sizes differ between ranks, so
    ``fixed_size`` is False and the allgather communicator exchanges sizes first."""

    fixed_size = False
    state_attrs = ("ratio", "calls")

    def __init__(self, ratio: float, *, backend: str = "auto", nonfinite: str = "raise",
                 warmup_epochs: int = 0, warmup_ratios: Sequence[float] | None = None) -> None:
        super().__init__(ratio)
        self.schedule = RatioSchedule(self.ratio, warmup_epochs, warmup_ratios, self.label)
        self.ratio = self.schedule(0)
        self.backend = check_backend(backend, self.label)
        self.nonfinite = check_choice(nonfinite, ("raise", "dense"), self.label, "nonfinite")
        self.sink: Callable[[dict[str, Any]], None] | None = None
        self.calls: dict[str, int] = {}

    @abstractmethod
    def estimate(self, x: torch.Tensor, k: int, name: str) -> Selection:
        """Choose the elements of the working tensor `x` (1-D, 0 < k < d) to send."""

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return self.estimate(working(flat), self.target_k(flat.numel()), name).indices

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        k = self.target_k(flat.numel())
        x = working(flat)
        if not flat.numel():
            sel = empty_selection(x)
        elif k >= flat.numel():  # ratio 1: dense pass-through
            sel = Selection(torch.arange(k, device=x.device), fallback="all")
        else:
            sel = self.estimate(x, k, name)
        self.record(name, flat.numel(), k, sel)
        return sparsify(flat, sel.indices), TensorInfo.of(tensor)

    def record(self, name: str, d: int, k: int, sel: Selection) -> None:
        """Metrics and sink record of one call."""
        k_hat = sel.indices.numel()
        step = self.calls.get(name, 0)
        self.calls[name] = step + 1
        self.metrics.add("k_hat", k_hat)
        if sel.excluded:
            self.metrics.add("excluded", 1)
        else:
            self.metrics.add("k", k)
            self.metrics.observe("quality", k_hat / k)
        if sel.fallback is not None and not sel.excluded:
            self.metrics.add("fallbacks", 1)
        if self.sink is not None:
            self.sink({"name": name, "step": step, "d": d, "k": k, "k_hat": k_hat,
                       "threshold": sel.threshold, "stages": sel.stages,
                       "fallback": sel.fallback, "excluded": sel.excluded})

    def nonfinite_input(self, x: torch.Tensor, name: str) -> Selection:
        """Guard G1: raise, or send every element with ``nonfinite: dense``."""
        if self.nonfinite == "dense":
            return Selection(torch.arange(x.numel(), device=x.device), fallback="dense")
        raise nonfinite_error(x, name, f"{self.label} cannot estimate a threshold from it",
                              "option nonfinite=dense sends such tensors uncompressed")

    def set_epoch(self, epoch: int) -> None:
        ratio = self.schedule(epoch)
        if ratio != self.ratio:
            self.ratio = ratio
            self.ratio_changed()

    def ratio_changed(self) -> None:
        """Hook: the warm-up schedule changed the density (SIDCo resets its adaptation)."""

