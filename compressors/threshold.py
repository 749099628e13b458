"""Threshold sparsification (Strom 2015; GRACE's `threshold`): send every element whose
magnitude reaches a fixed absolute threshold tau. The number sent varies per step and may be 0."""

from __future__ import annotations

import torch

from grace.registry import COMPRESSORS
from grace.sparse import Sparsifier
from grace.validation import check_range


@COMPRESSORS.register("threshold")
class Threshold(Sparsifier):
    """Select |g_i| >= threshold."""

    has_target = False

    def __init__(self, threshold: float = 0.01) -> None:
        super().__init__(None)
        self.threshold = float(check_range(threshold, self.label, "threshold", 0.0, low_open=True))

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return flat.abs().ge(self.threshold).nonzero().view(-1)
