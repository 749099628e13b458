"""Warm-up schedule of the fraction of elements kept (DGC, Lin et al. 2018, Sec. 3.4; its
four-epoch schedule, generalised here to any target and length), usable by any compressor
with a ``ratio``.

During the first W epochs the density falls geometrically to its target:
delta_e = max(delta, c^(e+1)) with c = delta^(1/(W+1)) for the 0-based epoch e < W, and
delta afterwards. With delta = 0.001 and W = 4 that is 25.1%, 6.3%, 1.58%, 0.40%, then 0.1%
(sparsity 75% -> 93.7% -> 98.4% -> 99.6% -> 99.9%). An explicit list of densities for the
first epochs may be given instead.

A compressor keeps one schedule and, in ``set_epoch(e)``, sets ``self.ratio = schedule(e)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from gracecomm.validation import ConfigError, check_range, check_ratio


class RatioSchedule:
    """Density per epoch: `ratios[e]` for an explicit list, else the geometric warm-up over
    `warmup_epochs` epochs (0 = no warm-up), then `ratio`."""

    def __init__(self, ratio: float, warmup_epochs: int = 0,
                 ratios: Sequence[float] | None = None, owner: str = "compressor") -> None:
        self.ratio = check_ratio(ratio, owner)
        self.warmup_epochs = check_range(warmup_epochs, owner, "warmup_epochs", 0, integer=True)
        if ratios is not None and self.warmup_epochs:
            raise ConfigError(f"{owner}: give either 'warmup_epochs' ({warmup_epochs}) or an "
                              f"explicit 'warmup_ratios' list ({list(ratios)}), not both")
        self.ratios = [check_ratio(r, owner, f"warmup_ratios[{i}]")
                       for i, r in enumerate(ratios or [])]

    def __call__(self, epoch: int) -> float:
        if epoch < len(self.ratios):
            return self.ratios[epoch]
        if epoch < self.warmup_epochs:
            base = self.ratio ** (1.0 / (self.warmup_epochs + 1))
            return max(self.ratio, base ** (epoch + 1))
        return self.ratio

    def __repr__(self) -> str:
        return (f"RatioSchedule(ratio={self.ratio}, warmup_epochs={self.warmup_epochs}, "
                f"ratios={self.ratios})")
