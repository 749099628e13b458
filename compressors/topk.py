"""Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018): send the k = ratio * d
elements of largest magnitude with their indices."""

from __future__ import annotations

import torch

from grace.registry import COMPRESSORS
from grace.sparse import DEFAULT_RATIO, Sparsifier


@COMPRESSORS.register("topk")
class TopK(Sparsifier):
    """Exact per-tensor Top-k; k_hat = k always. Pair with residual memory."""

    def __init__(self, ratio: float = DEFAULT_RATIO) -> None:
        super().__init__(ratio)

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        k = self.target_k(flat.numel())
        return torch.topk(flat.abs(), k, sorted=False).indices
