"""RedSync's threshold search (Fang et al., "RedSync: Reducing synchronization bandwidth for
distributed deep learning training system", JPDC 2019), a baseline of the SIDCo paper
(Abdelmoniem et al., MLSys 2021, Secs. 1.2 and 4): a coarse binary search for a threshold
between the mean and the maximum magnitude.

    mu = mean|g|, mx = max|g|, lo, hi = 0, 1
    while hi - lo > 0.2:                     # at most three probes
        t = (lo + hi) / 2; thr = mu + t (mx - mu); n = #{|g| > thr}
        if k < n < 2k: break
        if n < k/2: hi = t  else: lo = t     # strict_band: if n <= k: hi = t  else: lo = t
    send |g| > thr

Inside the dead band k/2 <= n <= k the published rule still raises the threshold; together with
the three-probe limit this explains its poor estimation quality. ``strict_band: true`` lowers
the threshold whenever n <= k.
"""

from __future__ import annotations

import torch

from gracecomm.compressors.shared.estimation import Selection, ThresholdSparsifier, empty_selection
from gracecomm.compressors.shared.exceedance import above, count_above, moments, select
from gracecomm.registry import COMPRESSORS
from gracecomm.sparse import DEFAULT_RATIO


@COMPRESSORS.register("redsync")
class RedSync(ThresholdSparsifier):
    def __init__(self, ratio: float = DEFAULT_RATIO, strict_band: bool = False,
                 nonfinite: str = "raise", backend: str = "auto",
                 warmup_epochs: int = 0, warmup_ratios: list[float] | None = None) -> None:
        super().__init__(ratio, backend=backend, nonfinite=nonfinite,
                         warmup_epochs=warmup_epochs, warmup_ratios=warmup_ratios)
        self.strict_band = bool(strict_band)

    def estimate(self, x: torch.Tensor, k: int, name: str) -> Selection:
        total = moments(x, 0.0, self.backend)
        if not total.finite:
            return self.nonfinite_input(x, name)
        if total.count == 0:
            return empty_selection(x)
        mean = total.s1 / x.numel()
        lo_max, hi_max = torch.aminmax(x)
        peak = max(-float(lo_max), float(hi_max))
        lo, hi, thr = 0.0, 1.0, peak
        while hi - lo > 0.2:
            t = (lo + hi) / 2
            thr = mean + t * (peak - mean)
            n = count_above(x, thr, self.backend)
            if k < n < 2 * k:
                break
            too_few = n <= k if self.strict_band else n < k / 2
            if too_few:
                hi = t
            else:
                lo = t
        return Selection(select(x, above(thr, x.dtype), self.backend, expected=k), thr)
