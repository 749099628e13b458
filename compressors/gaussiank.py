"""GaussianKSGD's threshold (Shi et al., "Understanding Top-k sparsification in distributed
deep learning", 2019), a baseline of the SIDCo paper (MLSys 2021, Secs. 1.2 and 4): the
threshold of a Gaussian fitted to the signed gradient, then a few multiplicative corrections.

    thr = mu + sigma Phi^-1(1 - ratio/2)      (signed mean and standard deviation of g)
    repeat up to `iterations` times:
        n = #{|g| > thr}
        if n < 2k/3: thr = thr / 2  elif n > 4k/3: thr = 1.5 thr  else: stop
    send the last counted set {|g| > thr_counted}

As in the authors' code the selection is the set of the last count, so the correction made
after the final count is not used. The authors use 3 iterations with error feedback and 5
without it.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from gracecomm.compressors.shared.estimation import Selection, ThresholdSparsifier, empty_selection
from gracecomm.compressors.shared.exceedance import above, count_above, moments, select
from gracecomm.registry import COMPRESSORS
from gracecomm.sparse import DEFAULT_RATIO
from gracecomm.validation import check_range


@COMPRESSORS.register("gaussiank")
class GaussianK(ThresholdSparsifier):
    sensitivities = (("compressor.ratio: the Gaussian quantile overshoots the threshold of "
                      "the heavy-tailed error-compensated gradients, sending far fewer than k "
                      "elements at small ratios (docs/sparsifiers.md)"),)

    def __init__(self, ratio: float = DEFAULT_RATIO, iterations: int = 3, nonfinite: str = "raise",
                 backend: str = "auto", warmup_epochs: int = 0,
                 warmup_ratios: list[float] | None = None) -> None:
        super().__init__(ratio, backend=backend, nonfinite=nonfinite,
                         warmup_epochs=warmup_epochs, warmup_ratios=warmup_ratios)
        self.iterations = check_range(iterations, self.label, "iterations", 1, integer=True)

    def estimate(self, x: torch.Tensor, k: int, name: str) -> Selection:
        squares = moments(x, 0.0, self.backend)  # its s2 is the sum of x^2
        mean = float(x.sum()) / x.numel()
        if not (squares.finite and math.isfinite(mean)):
            return self.nonfinite_input(x, name)
        std = math.sqrt(max(0.0, squares.s2 / x.numel() - mean * mean))
        thr = mean + std * NormalDist().inv_cdf(1.0 - self.ratio / 2.0)
        counted = thr
        for _ in range(self.iterations):
            counted = thr
            n = count_above(x, counted, self.backend)
            if n < 2 * k / 3:
                thr = thr / 2
            elif n > 4 * k / 3:
                thr = thr * 1.5
            else:
                break
        indices = select(x, above(counted, x.dtype), self.backend, expected=k)
        if indices.numel() == 0 and counted <= 0.0:  # thr <= 0 selects every nonzero
            return empty_selection(x)
        return Selection(indices, counted)
