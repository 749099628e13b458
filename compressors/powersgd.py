"""PowerSGD (Vogels, Karimireddy, Jaggi: *PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization*, NeurIPS 2019, Algorithm 1) with rank r.

Each gradient of two or more dimensions is viewed as an n x m matrix M (n = first dimension)
and approximated by P Q^T in one step of subspace iteration, warm-started with the previous
step's Q:

    P = M Q;  allreduce P (summed);  P <- orthonormalise(P)
    Q = M^T P;  allreduce Q (the payload, summed by the allreduce communicator);  out = P Q^T / W

Every exchange (one DDP bucket) sends the P of all its matrices in one allreduce, launched
from `compress_rounds` through the exchange's link (so it runs asynchronously too), then the
Q of all its matrices together with the tensors sent uncompressed in the communicator's
allreduce: two collectives per bucket, r (n + m) floats per matrix. A matrix is compressed
only if r (n + m) * `min_compression_rate` < n m; other tensors (biases) are sent whole. The
first `start_iter` steps of each tensor are sent whole (a dense warm-up that bypasses error
feedback, `feeds_back`).

Error feedback is the memory's: ``residual`` keeps M - P Q_local^T, Algorithm 1's local error;
``residual`` with ``reference: mean`` keeps M - (mean over ranks), the choice of PyTorch's
``powerSGD_hook``. With that hook's settings (``start_iter``, ``min_compression_rate``,
``warm_start``, ``seed``, ``batch_same_shape``, ``reference: mean`` or no memory) training
gives its bits exactly, at ranks up to 2 (tests/test_powersgd_parity.py; above rank 2 the
hook orthogonalises with a QR factorisation instead of Gram-Schmidt, which rounds
differently): Q is orthonormalised before P = M Q, the products are batched matrix products,
the initial Q of an exchange is drawn after seeding torch with
``numpy.random.RandomState(seed).randint(10**9)``, in the order of the exchange's matrices
grouped by shape (`batch_same_shape` multiplies each group in one batched product).

Warm start: the Q that `decompress` reconstructs from is kept per tensor; the pipeline calls
the communicator's `decompress` (with the sum over ranks, identical on every rank) after the
memory's, so the kept Q is the aggregate.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gracecomm.buffers import dense_empty
from gracecomm.compressor import Compressor, Payload, TensorInfo
from gracecomm.exchange import Link, Works
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import PayloadError, check_range

SEED_RANGE = 1_000_000_000  # PyTorch's hook seeds torch with randint(SEED_RANGE)


@dataclass(frozen=True)
class PowerSGDCtx:
    info: TensorInfo
    name: str
    p: torch.Tensor | None  # orthonormal n x r factor, identical on all ranks; None: dense
    warmup: bool = False    # sent whole during the dense warm-up


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of `p` (..., n, r), a batch of matrices at once
    (Algorithm 1's orthogonalisation, in the order PyTorch's hook runs it: normalise a column,
    then remove it from the columns after it). A column left with less than 1000 machine
    epsilons of its norm (a dependent column, or a zero gradient) becomes zero instead of
    normalised rounding noise."""
    return orthonormalize_(p.clone())


def orthonormalize_(p: torch.Tensor) -> torch.Tensor:
    """`orthonormalize` in place; returns `p`. A dropped column is divided by infinity (a
    column holding NaN stays NaN; the pipeline never hands one over)."""
    tol = 1000 * torch.finfo(p.dtype).eps * torch.linalg.vector_norm(p, dim=-2, keepdim=True)
    for i in range(p.shape[-1]):
        col = p[..., i:i + 1]
        norm = torch.linalg.vector_norm(col, dim=-2, keepdim=True)
        col.div_(torch.where(norm > tol[..., i:i + 1], norm, math.inf))
        if i + 1 < p.shape[-1]:
            rest = p[..., i + 1:]
            rest -= torch.sum(col * rest, dim=-2, keepdim=True) * col
    return p


def same_shape_runs(shapes: Sequence[Any]) -> list[int]:
    """Lengths of the runs of equal consecutive `shapes`."""
    runs: list[int] = []
    for i, shape in enumerate(shapes):
        if i and shape == shapes[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def batched(fn: Any, *lists: Sequence[torch.Tensor],
            runs: Sequence[int] | None = None) -> list[torch.Tensor]:
    """`fn` applied to each run of same-shaped tensors of `lists` (or to `runs` of given
    lengths), stacked: one call per run instead of one per tensor; the results unstacked,
    in order. A run of one is passed as a view of its tensor (``fn`` may then write into
    it). (Batched products are what PyTorch's hook computes, to the last bit.)"""
    out: list[torch.Tensor] = []
    for count in runs if runs is not None else same_shape_runs([t.shape for t in lists[0]]):
        start = len(out)
        if count == 1:
            out.append(fn(*(ts[start].unsqueeze(0) for ts in lists))[0])
        else:
            out.extend(fn(*(torch.stack(list(ts[start:start + count])) for ts in lists))
                       .unbind(0))
    return out


def next_value(rounds: Generator[Works, None, Any]) -> Any:
    """The value of rounds that launch no collective (a world of one)."""
    try:
        next(rounds)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("a world of one launched a collective")


@COMPRESSORS.register("powersgd")
class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD (module docstring for every option)."""

    summable = True
    fixed_size = True
    default_communicator = "allreduce"
    default_memory = "residual"
    communicators = ("allreduce",)
    run_keys = {"seed": "seed"}  # the run's seed (`gracecomm.configstore`)
    state_attrs = ("q", "steps")  # and the RNG's state, below

    def __init__(self, rank: int = 2, warm_start: bool = True, seed: int = 0,
                 start_iter: int = 0, min_compression_rate: float = 1.0,
                 batch_same_shape: bool = False) -> None:
        super().__init__()
        self.rank = check_range(rank, self.label, "rank", 1, integer=True)
        self.warm_start = bool(warm_start)
        self.seed = check_range(seed, self.label, "seed", 0, integer=True)
        self.start_iter = check_range(start_iter, self.label, "start_iter", 0, integer=True)
        self.min_compression_rate = float(check_range(
            min_compression_rate, self.label, "min_compression_rate", 1.0))
        self.batch_same_shape = bool(batch_same_shape)
        self.rng = np.random.RandomState(self.seed)
        self.q: dict[str, torch.Tensor] = {}
        self.steps: dict[str, int] = {}  # exchanges of each tensor so far

    def layout_phase(self, ctx: PowerSGDCtx) -> bool:
        """The dense warm-up sends whole tensors, then P and Q: two layouts, each fixed by
        the shapes, switched at the same step on every rank."""
        return ctx.warmup

    def matrix(self, shape: torch.Size) -> tuple[int, int] | None:
        """(n, m) of the matrix view, or None when the tensor is sent uncompressed."""
        if len(shape) < 2 or shape.numel() == 0:
            return None
        n = shape[0]
        m = shape.numel() // n
        return (n, m) if self.rank * (n + m) * self.min_compression_rate < n * m else None

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        """One tensor on its own (its P allreduced on this thread, if bound)."""
        if self.comm is None:
            return next_value(self.compress_rounds([(name, tensor)], None))[0]
        return self.comm.run_now(self.compress_rounds([(name, tensor)], self.comm.link()))[0]

    def compress_rounds(self, named: Sequence[tuple[str, torch.Tensor]], link: Link | None
                        ) -> Generator[Works, None, list[tuple[Payload, Any]]]:
        out: list[tuple[Payload, Any] | None] = [None] * len(named)
        groups: dict[tuple[int, int], list[tuple[int, str, torch.Tensor]]] = {}
        for i, (name, tensor) in enumerate(named):
            info = TensorInfo.of(tensor)
            step = self.steps.get(name, 0)
            self.steps[name] = step + 1
            dims = self.matrix(info.shape)
            warmup = step < self.start_iter
            if dims is None or warmup:
                out[i] = ((tensor.detach().reshape(-1),), PowerSGDCtx(info, name, None, warmup))
                continue
            work = tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32
            groups.setdefault(dims, []).append((i, name, tensor.detach().reshape(dims).to(work)))
        if not groups:
            return out
        entries = [e for group in groups.values() for e in group]  # grouped by shape
        qs = self.initial_qs(entries)
        ps = self.products([m for _, _, m in entries], qs, transpose=False)
        flat = torch.cat([p.reshape(-1) for p in ps])
        if link is not None:  # counted as payload, as a world of one would send it too
            link.comm.count(flat.numel() * flat.element_size())
            if link.comm.world_size > 1:
                yield (link.all_reduce(flat),)
        ps = batched(orthonormalize_, self.split(flat, ps))  # flat is this call's own
        for (i, name, _), p, q in zip(entries, ps, self.products(
                [m for _, _, m in entries], ps, transpose=True)):
            out[i] = ((q,), PowerSGDCtx(TensorInfo.of(named[i][1]), name, p))
        return out

    def initial_qs(self, entries: Sequence[tuple[int, str, torch.Tensor]]) -> list[torch.Tensor]:
        """The Q each matrix starts from: last step's (orthonormalised) with warm start,
        else fresh Gaussian draws from the shared seed (module docstring)."""
        if self.warm_start and all(self.q.get(name) is not None
                                   and self.q[name].shape == (m.shape[1], self.rank)
                                   for _, name, m in entries):
            return batched(orthonormalize, [self.q[name].to(m.dtype) for _, name, m in entries])
        shapes = [(m.shape[1], self.rank) for _, _, m in entries]
        counts = (same_shape_runs(shapes) if self.batch_same_shape else [1] * len(shapes))
        qs: list[torch.Tensor] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(self.rng.randint(SEED_RANGE)))
            for count in counts:  # one draw per batch, as the hook draws them
                shape = shapes[len(qs)]
                qs.extend(torch.randn(count, *shape, dtype=entries[0][2].dtype).unbind(0))
        return [q.to(m.device) for q, (_, _, m) in zip(batched(orthonormalize_, qs), entries)]

    def products(self, matrices: Sequence[torch.Tensor], factors: Sequence[torch.Tensor], *,
                 transpose: bool) -> list[torch.Tensor]:
        """M F (or M^T F) for each matrix, batched by shape with `batch_same_shape`."""
        if not self.batch_same_shape:  # one product each (the same bits, fewer calls)
            return [torch.bmm((m.t() if transpose else m).unsqueeze(0), f.unsqueeze(0))[0]
                    for m, f in zip(matrices, factors)]
        return batched(lambda m, f: torch.bmm(m.transpose(1, 2) if transpose else m, f),
                       matrices, factors)

    @staticmethod
    def split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in like]), like)]

    def feeds_back(self, ctx: PowerSGDCtx) -> bool:
        return not ctx.warmup

    def checked(self, payload: Payload, ctx: PowerSGDCtx) -> torch.Tensor:
        """The payload's one tensor, the whole gradient or the factor Q (m x rank), after
        checking its shape and dtype against ``ctx``; `PayloadError` names what differs."""
        if len(payload) != 1:
            raise PayloadError(f"{self.label} payload has {len(payload)} tensors, expected 1")
        (q,) = payload
        if ctx.p is None:
            if q.numel() != ctx.info.numel or q.dtype != ctx.info.dtype:
                raise PayloadError(f"dense PowerSGD payload holds {q.numel()} {q.dtype} values, "
                                   f"expected {ctx.info.numel} {ctx.info.dtype}")
            return q
        m = ctx.info.numel // ctx.p.shape[0]
        if q.shape != (m, self.rank) or q.dtype != ctx.p.dtype:
            raise PayloadError(f"PowerSGD factor Q has shape {tuple(q.shape)} and dtype {q.dtype}, "
                               f"expected {(m, self.rank)} and {ctx.p.dtype}")
        return q

    def decompress(self, payload: Payload, ctx: PowerSGDCtx) -> torch.Tensor:
        q = self.checked(payload, ctx)
        if ctx.p is None:
            return q.view(ctx.info.shape)
        self.q[ctx.name] = q.detach().clone()  # the last one decoded is the aggregate
        return self.approximation(q, ctx).to(ctx.info.dtype).view(ctx.info.shape)

    def approximation(self, q: torch.Tensor, ctx: PowerSGDCtx) -> torch.Tensor:
        """P Q^T as a new n x m tensor (a recycled buffer when large)."""
        out = dense_empty(ctx.info.numel, q.dtype, q.device).view(1, -1, q.shape[0])
        return torch.bmm(ctx.p.unsqueeze(0), q.unsqueeze(0).transpose(1, 2), out=out)[0]

    def subtract_decompressed(self, t: torch.Tensor, payload: Payload, ctx: PowerSGDCtx,
                              in_place: bool = False) -> torch.Tensor:
        """Error feedback's t - P Q_local^T (Algorithm 1's local error), written into the
        approximation's buffer, without keeping Q_local as the warm start (`decompress` of
        the aggregate does); zero for a tensor sent whole. The bits of `difference`."""
        q = self.checked(payload, ctx)
        if ctx.p is None:
            return torch.zeros_like(t)
        approx = self.approximation(q, ctx)
        if approx.dtype != t.dtype:
            return t - approx.to(t.dtype).view(t.shape)
        return torch.sub(t, approx.view(t.shape), out=approx.view(t.shape))

    def state_dict(self) -> dict[str, Any]:
        """With numpy's RNG state as tensors and numbers (``weights_only`` checkpoints)."""
        kind, keys, pos, has_gauss, cached = self.rng.get_state()
        return {**super().state_dict(),
                "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached": float(cached)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        rng = state["rng"]
        self.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"],
                            rng["has_gauss"], rng["cached"]))
