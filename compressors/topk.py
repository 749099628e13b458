"""Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018): send the k = ratio * d
elements of largest magnitude with their indices."""

from __future__ import annotations

import torch

from gracecomm.compressor import Payload
from gracecomm.compressors.shared.exceedance import check_backend, layout, top_k
from gracecomm.registry import COMPRESSORS
from gracecomm.sparse import DEFAULT_RATIO, Sparsifier, index_dtype


@COMPRESSORS.register("topk")
class TopK(Sparsifier):
    """Exact per-tensor Top-k; k_hat = k always, so its payload sizes are fixed by the
    shape (no size exchange). Pair with residual memory.

    The kept magnitudes are exactly those of ``torch.topk(|g|, k)``; among equal magnitudes
    the lowest indices are kept, so the choice is the same on every rank and every backend.
    ``backend``: ``auto`` (numba on CPU: a sampled threshold, one fused pass collecting the
    candidates and an exact pick among them, `gracecomm.compressors.shared.exceedance.top_k`),
    ``numba`` or ``torch`` (any device)."""

    fixed_size = True

    def __init__(self, ratio: float = DEFAULT_RATIO, backend: str = "auto") -> None:
        super().__init__(ratio)
        self.backend = check_backend(backend, self.label)

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return self.sparse_payload(flat, name)[1]

    def sparse_payload(self, flat: torch.Tensor, name: str) -> Payload:
        layout(flat, name, self.label)
        indices, values = top_k(flat, self.target_k(flat.numel()), self.backend)
        return values, indices.to(index_dtype(flat.numel()))
