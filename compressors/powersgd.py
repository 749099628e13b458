"""PowerSGD (Vogels, Karimireddy, Jaggi: *PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization*, NeurIPS 2019, Algorithm 1) with rank r.

Each gradient of two or more dimensions is viewed as an n x m matrix M (n = first dimension)
and approximated by P Q^T in one step of subspace iteration, warm-started with the previous
step's Q:

    P = M Q;  allreduce P (summed: the scale does not matter);  P <- orthonormalise(P)
    Q = M^T P;  allreduce Q (the payload, summed by the allreduce communicator);  out = P Q^T / W

Error feedback (the memory, here ``residual``) keeps M - P Q_local^T, Algorithm 1's local
error. P's round goes through the pipeline's accounted allreduce (`Compressor.comm`), so the
bytes per step are r (n + m) floats per matrix. One-dimensional tensors (biases) and matrices
where r (n + m) >= n m are sent uncompressed (their numel floats; summable as well).

Warm start: the Q that `decompress` reconstructs from is kept per tensor; the pipeline calls
the communicator's `decompress` (with the sum over ranks, identical on every rank) after the
memory's, so the kept Q is the aggregate, as in Algorithm 1. The initial Q is drawn from a
seed shared by all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grace.compressor import Compressor, Payload, TensorInfo
from grace.registry import COMPRESSORS
from grace.rng import SharedStreams
from grace.validation import PayloadError, check_range


@dataclass(frozen=True)
class PowerSGDCtx:
    info: TensorInfo
    name: str
    p: torch.Tensor | None  # orthonormal n x r factor, identical on all ranks; None: dense


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of `p` (Algorithm 1's orthogonalisation). A column left
    with less than 1000 machine epsilons of its norm after the projections (a dependent
    column, or a zero gradient) becomes zero instead of normalised rounding noise."""
    tol = 1000 * torch.finfo(p.dtype).eps
    cols: list[torch.Tensor] = []
    for i in range(p.shape[1]):
        col = p[:, i]
        before = torch.linalg.vector_norm(col)
        for prev in cols:
            col = col - (prev @ col) * prev
        norm = torch.linalg.vector_norm(col)
        keep = norm > tol * before
        cols.append(torch.where(keep, col / torch.where(keep, norm, 1.0), 0.0))
    return torch.stack(cols, dim=1)


@COMPRESSORS.register("powersgd")
class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with warm start (`warm_start`) and shared-seed initial Q."""

    summable = True
    fixed_size = True
    default_communicator = "allreduce"
    default_memory = "residual"
    communicators = ("allreduce",)

    def __init__(self, rank: int = 2, warm_start: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.rank = check_range(rank, self.label, "rank", 1, integer=True)
        self.warm_start = bool(warm_start)
        self.streams = SharedStreams(check_range(seed, self.label, "seed", 0, integer=True))
        self.q: dict[str, torch.Tensor] = {}

    def matrix(self, shape: torch.Size) -> tuple[int, int] | None:
        """(n, m) of the matrix view, or None when the tensor is sent uncompressed."""
        if len(shape) < 2 or shape.numel() == 0:
            return None
        n = shape[0]
        m = shape.numel() // n
        return (n, m) if self.rank * (n + m) < n * m else None

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        info = TensorInfo.of(tensor)
        dims = self.matrix(info.shape)
        if dims is None:
            return (tensor.detach().reshape(-1),), PowerSGDCtx(info, name, None)
        n, m = dims
        work = tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32
        matrix = tensor.detach().reshape(n, m).to(work)
        q = self.q.get(name)
        if q is None or q.shape != (m, self.rank) or not self.warm_start:
            gen = self.streams.generator(name)
            q = torch.randn(m, self.rank, generator=gen, dtype=work).to(matrix.device)
        p = matrix @ q.to(work)
        if self.comm is not None:
            self.comm.all_reduce(p)
        p = orthonormalize(p)
        return (matrix.t() @ p,), PowerSGDCtx(info, name, p)

    def decompress(self, payload: Payload, ctx: PowerSGDCtx) -> torch.Tensor:
        if len(payload) != 1:
            raise PayloadError(f"{self.label} payload has {len(payload)} tensors, expected 1")
        (q,) = payload
        if ctx.p is None:
            if q.numel() != ctx.info.numel or q.dtype != ctx.info.dtype:
                raise PayloadError(f"dense PowerSGD payload holds {q.numel()} {q.dtype} values, "
                                   f"expected {ctx.info.numel} {ctx.info.dtype}")
            return q.view(ctx.info.shape)
        m = ctx.info.numel // ctx.p.shape[0]
        if q.shape != (m, self.rank) or q.dtype != ctx.p.dtype:
            raise PayloadError(f"PowerSGD factor Q has shape {tuple(q.shape)} and dtype {q.dtype}, "
                               f"expected {(m, self.rank)} and {ctx.p.dtype}")
        self.q[ctx.name] = q.detach().clone()  # the last one decoded is the aggregate
        return (ctx.p @ q.t()).to(ctx.info.dtype).view(ctx.info.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"q": dict(self.q), "streams": self.streams.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q = dict(state["q"])
        self.streams.load_state_dict(state["streams"])
