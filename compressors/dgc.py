"""Deep Gradient Compression's sparsifier (Lin et al., "Deep Gradient Compression", ICLR 2018,
Sec. 3 and App.): the threshold is the k-th largest magnitude of a
small random sample, and when that selects too many elements a second, small top-k re-selects
exactly k among them (hierarchical selection).

Pair it with `gracecomm.memories.dgc.DGCMemory` (momentum correction, momentum factor
masking, local gradient clipping; the default) or with residual memory; the density warm-up
of DGC's Sec. 3.4 is `warmup_epochs` (`gracecomm.compressors.shared.schedule.RatioSchedule`;
on in the ``dgc_reference`` preset).
"""

from __future__ import annotations

import math

import torch

from gracecomm.compressors.shared.estimation import (
    Selection,
    ThresholdSparsifier,
    empty_selection,
    exact_topk,
)
from gracecomm.compressors.shared.exceedance import above, below, count_above, select, top_k_of
from gracecomm.registry import COMPRESSORS
from gracecomm.rng import SharedStreams
from gracecomm.sparse import DEFAULT_RATIO
from gracecomm.validation import check_choice, check_range


@COMPRESSORS.register("dgc")
class DGC(ThresholdSparsifier):
    """Sampled threshold plus hierarchical re-selection::

        n_s = max(ceil(sample_ratio d), ceil(2/ratio)) magnitudes sampled (random or strided)
        thr = the ceil(ratio n_s)-th largest of the sample;  idx = {i : |v_i| >= thr}
        while |idx| < relax_below k (at most relax_iters times): thr *= relax_factor
        if |idx| > reselect_above k: idx = the exact top k of idx

    Tensors with d <= ceil(2/ratio), and every tensor when sample_ratio >= 1, use exact
    Top-k. With the default reselect_above = 1, k_hat <= k always. A zero threshold (more
    than 1 - ratio of the sample is zero) selects only nonzeros; an all-zero tensor sends
    nothing. Sampling draws from a stream seeded per tensor and call (`seed`), so runs repeat.
    Non-finite input is detected where it can be seen without an extra pass: NaN or Inf in the
    sample, Inf in the selection (NaN fails every comparison and is never selected); the
    pipeline's ``check_finite`` (on by default) rejects such gradients before compression."""

    default_memory = "dgc"
    child_attrs = ("streams",)

    def __init__(self, ratio: float = DEFAULT_RATIO, sample_ratio: float = 0.01,
                 sampling: str = "random", reselect_above: float = 1.0,
                 relax_below: float = 0.8, relax_factor: float = 0.8, relax_iters: int = 0,
                 seed: int = 0, nonfinite: str = "raise", backend: str = "auto",
                 warmup_epochs: int = 0, warmup_ratios: list[float] | None = None) -> None:
        super().__init__(ratio, backend=backend, nonfinite=nonfinite,
                         warmup_epochs=warmup_epochs, warmup_ratios=warmup_ratios)
        label = self.label
        self.sample_ratio = float(check_range(sample_ratio, label, "sample_ratio", 0.0,
                                              low_open=True))
        self.sampling = check_choice(sampling, ("random", "strided"), label, "sampling")
        self.reselect_above = float(check_range(reselect_above, label, "reselect_above", 1.0))
        self.relax_below = float(check_range(relax_below, label, "relax_below", 0.0, 1.0))
        self.relax_factor = float(check_range(relax_factor, label, "relax_factor", 0.0, 1.0,
                                              low_open=True, high_open=True))
        self.relax_iters = check_range(relax_iters, label, "relax_iters", 0, integer=True)
        self.streams = SharedStreams(seed)

    def sample(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Magnitudes of about n_s elements drawn at random, or every stride-th from a random
        offset."""
        d = x.numel()
        n_s = max(math.ceil(self.sample_ratio * d), math.ceil(2.0 / self.ratio))
        gen = self.streams.generator(name)
        if self.sampling == "strided":
            stride = max(1, d // n_s)
            offset = int(torch.randint(0, stride, (1,), generator=gen))
            return x[offset::stride].abs()
        idx = torch.randint(0, d, (n_s,), generator=gen).to(x.device)
        return x.index_select(0, idx).abs()

    def estimate(self, x: torch.Tensor, k: int, name: str) -> Selection:
        d = x.numel()
        if d <= math.ceil(2.0 / self.ratio) or self.sample_ratio >= 1.0:
            return exact_topk(x, k, backend=self.backend)
        sample = self.sample(x, name)
        thr = float(torch.topk(sample, math.ceil(self.ratio * sample.numel()), sorted=False)
                    .values.min())
        if not math.isfinite(thr):
            return self.nonfinite_input(x, name)
        if thr <= 0.0:  # mostly zeros: keep only nonzeros (an all-zero tensor sends nothing)
            indices = select(x, above(0.0, x.dtype), self.backend, expected=k)
            return Selection(indices, 0.0) if indices.numel() else empty_selection(x)
        for _ in range(self.relax_iters):
            if count_above(x, below(thr, x.dtype), self.backend) >= self.relax_below * k:
                break
            thr *= self.relax_factor
        indices = select(x, thr, self.backend, expected=k)
        if not bool(torch.isfinite(x.index_select(0, indices)).all()):  # Inf passes any thr
            return self.nonfinite_input(x, name)
        if indices.numel() > self.reselect_above * k:  # hierarchical re-selection
            indices = top_k_of(x, indices, k, self.backend)
        return Selection(indices, thr)


DGCReference = COMPRESSORS.preset(
    "dgc_reference", DGC, __name__, "DGCReference",
    """DGC as its reference implementation runs it (this library's preset ``dgc_reference``):
    strided sampling, re-selection above 1.3 k, up to 10 relaxations by 0.8 while fewer than
    0.8 k are selected, and the 4-epoch density warm-up.""",
    sampling="strided", reselect_above=1.3, relax_iters=10, warmup_epochs=4)
# an experiment may shorten the warm-up (experiment.dgc_warmup_epochs) so that short runs
# reach the target density at all (`gracecomm.configstore`)
DGCReference.run_keys = {"warmup_epochs": "experiment.dgc_warmup_epochs"}
