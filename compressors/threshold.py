"""Threshold sparsification (Strom 2015; GRACE's `threshold`): send every element whose
magnitude reaches a fixed absolute threshold tau. The number sent varies per step and may be 0."""

from __future__ import annotations

import torch

from gracecomm.compressors.shared.exceedance import check_backend, layout, select
from gracecomm.registry import COMPRESSORS
from gracecomm.sparse import Sparsifier
from gracecomm.validation import check_range


@COMPRESSORS.register("threshold")
class Threshold(Sparsifier):
    """Select |g_i| >= threshold, compared in the tensor's dtype, in one fused pass
    (`gracecomm.compressors.shared.exceedance.select`; ``backend`` auto | numba | torch)."""

    has_target = False

    def __init__(self, threshold: float = 0.01, backend: str = "auto") -> None:
        super().__init__(None)
        self.threshold = float(check_range(threshold, self.label, "threshold", 0.0, low_open=True))
        self.backend = check_backend(backend, self.label)

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        layout(flat, name, self.label)
        return select(flat.detach(), self.threshold, self.backend)
