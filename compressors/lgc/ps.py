"""LGC_PS: learned gradient compression in the parameter-server pattern (Abrahamyan et al.,
TNNLS, Sec. IV-A, Algorithm 1, Figs. 6 and 8).

Every worker sends its top-k indices (DEFLATE) and, in phase 3, only the innovation of its
top-k vector; one fixed *leader* adds the encoded common part. With ``indices: leader`` every
worker instead takes its values at the leader's top-k indices, which the leader broadcasts,
so slot j of every worker's vector holds the same parameter (not in the paper: docs/lgc.md,
"Slot alignment"). The master (the parameter server's rank, a worker too) holds one decoder
per worker, which fuses the leader's latent with that worker's innovation; it trains the
encoder and all decoders in phase 2 with a reconstruction plus similarity loss and sends the
encoder to the leader when phase 2 ends.

Joint payloads (always the same tensors on every rank; the latent is empty except on the
leader, and with ``indices: leader`` Idx(I) is empty on every rank):

- phase 1: (gradient,)
- phase 2: (F, top-k values of M and Lambda, Idx(I))
- phase 3: (F, latent, innovation values, Lambda values, scale, Idx(I), Idx(P))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gracecomm.compressor import Payload, TensorInfo
from gracecomm.compressors.lgc.autoencoder import LATENT_CHANNELS, pad, padded_length
from gracecomm.compressors.lgc.base import LGC, LGCCtx, expect_dense, options
from gracecomm.compressors.lgc.layout import Plan
from gracecomm.registry import COMPRESSORS
from gracecomm.rng import stable_hash
from gracecomm.sparse import DEFAULT_RATIO
from gracecomm.validation import ConfigError, PayloadError, check_choice, check_range
from gracecomm.wire import payload_nbytes

PARTS = {2: ("dense", "values", "index"),
         3: ("dense", "latent", "innovation", "values", "scalars", "index", "index")}
VALUE_PARTS = ("latent", "innovation", "values")  # what the paper's values-only ratio counts


def similarity_loss(z: torch.Tensor) -> torch.Tensor:
    """L_sim = sum over ordered pairs k != m of |z_k - z_m|^2 (Eq. 4), for a batch of codes."""
    flat = z.flatten(1)
    return (flat[:, None] - flat[None]).pow(2).sum()


@dataclass(frozen=True, eq=False)
class PsCtx(LGCCtx):
    """With ``indices: leader``: the leader's selection, which every rank received, and the
    length of the index stream the leader broadcast. In phase 3, `own`: this rank's top-k
    vector g~ (rank-local; the master checks its own reconstruction against it)."""

    indices: list[torch.Tensor] | None = None
    index_bytes: int = 0
    own: torch.Tensor | None = None


@dataclass
class WorkerPart:
    """One rank's phase 2/3 payload, parsed at the master."""

    dense: torch.Tensor
    indices: list[torch.Tensor]
    topk_m: torch.Tensor | None      # phase 2: the top-k vector g~ (mu)
    values_l: torch.Tensor           # the kappa Lambda values
    latent: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # phase 3: innovation positions in [0, mu)
    innovation: torch.Tensor | None = None
    scale: torch.Tensor | None = None


@COMPRESSORS.register("lgc_ps")
class LGCPS(LGC):
    """`leader_rank`: the worker that sends the latent in phase 3 (-1: the last rank).
    `indices`: ``own`` (every worker its own top-k, Algorithm 1) or ``leader`` (every worker
    its values at the leader's top-k indices, broadcast by the leader).
    `innovation`: ``mode`` fraction_of_topk (m_l = max(1, ceil(beta k_l)), Algorithm 1) or
    fraction_of_tensor (m_l = max(1, ceil(gamma n_l)), the text's 0.001%). `ae.lambda1`,
    `ae.lambda2`: weights of the reconstruction and similarity losses (Eq. 5)."""

    communicators = ("parameter_server",)
    default_communicator = "parameter_server"
    decoder_innovation = True
    AE_DEFAULTS: ClassVar[dict[str, Any]] = {**LGC.AE_DEFAULTS, "lambda2": 0.5}
    INNOVATION_DEFAULTS: ClassVar[dict[str, Any]] = {"mode": "fraction_of_topk", "beta": 0.1,
                                                      "gamma": 1e-5}

    def __init__(self, ratio: float = DEFAULT_RATIO, warmup_iters: int = 200,
                 ae_train_iters: int = 300, first_layer: Any = "auto",
                 last_layer: Any = "auto", seed: int = 0,
                 leader_rank: int = -1, indices: str = "own",
                 innovation: Mapping[str, Any] | None = None,
                 index_coding: Mapping[str, Any] | None = None,
                 ae: Mapping[str, Any] | None = None) -> None:
        super().__init__(ratio, warmup_iters, ae_train_iters, first_layer, last_layer, seed,
                         index_coding, ae)
        self.leader_rank = check_range(leader_rank, self.label, "leader_rank", -1, integer=True)
        self.indices = check_choice(indices, ("own", "leader"), self.label, "indices")
        inn = options(self.label, "innovation", innovation, self.INNOVATION_DEFAULTS)
        check_choice(inn["mode"], ("fraction_of_topk", "fraction_of_tensor"), self.label,
                     "innovation.mode")
        key = "beta" if inn["mode"] == "fraction_of_topk" else "gamma"
        check_range(inn[key], self.label, f"innovation.{key}", 0.0, 1.0, low_open=True)
        self.innovation_rule = (inn["mode"], float(inn[key]))

    # -- roles -------------------------------------------------------------------------------
    @property
    def master(self) -> int:
        return int(getattr(self.comm, "master_rank", 0))

    @property
    def leader(self) -> int:
        k = self.world_size
        leader = k - 1 if self.leader_rank == -1 else self.leader_rank
        if leader >= k:
            raise ConfigError(f"{self.label}: option 'leader_rank' is {leader} but the world has "
                              f"{k} ranks; use -1 (the last rank) or a rank below {k}")
        return leader

    def decoder_count(self) -> int:
        return self.world_size

    def sync_source(self) -> tuple[int, list[nn.Module]]:
        return self.master, [self.encoder]  # the master sends E to the leader

    # -- worker side ---------------------------------------------------------------------------
    def compress_sparse(self, plan: Plan, tensors: Sequence[torch.Tensor], info: TensorInfo,
                        phase: int) -> tuple[list[tuple[Payload, Any]], Payload, PsCtx]:
        if self.indices == "leader":
            indices, index_bytes = self.leader_indices(plan, tensors, self.leader)
            idx = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
            broadcast: dict[str, Any] = {"indices": indices, "index_bytes": index_bytes}
        else:
            indices = plan.topk(tensors)
            with self.metrics.timer("deflate_s"):
                idx = plan.encode_indices(indices, self.index_coding)
            index_bytes, broadcast = idx.numel(), {}
        topk_m, values_l = plan.values(tensors, indices)
        dense = plan.dense_part(tensors)
        self.log_topk_baseline(plan, dense, index_bytes)
        ctx = PsCtx(info, plan, phase, self.step, **broadcast,
                    own=topk_m if phase == 3 else None)
        if phase == 2:
            payload: Payload = (dense, torch.cat([topk_m, values_l]), idx)
        else:
            scale = self.scale(topk_m)
            positions = plan.innovation(topk_m)
            latent = topk_m.new_zeros(0, dtype=torch.float32)
            if self.rank == self.leader and plan.mu:
                with torch.no_grad(), self.metrics.timer("ae_s"):
                    latent = self.encode((topk_m / scale).unsqueeze(0), plan).reshape(-1)
            with self.metrics.timer("deflate_s"):
                stream = plan.encode_positions(positions, self.index_coding)
            payload = (dense, latent, topk_m[positions], values_l,
                       scale.reshape(1).to(topk_m.dtype), idx, stream)
        self.log_parts(PARTS[phase], payload)
        return plan.views(tensors, indices), payload, ctx

    # -- master side ---------------------------------------------------------------------------
    def aggregate(self, payloads: Sequence[Payload], ctx: LGCCtx) -> torch.Tensor:
        """The master's mean over workers (Sec. V-B1); in phase 2 it also takes one
        autoencoder step on the workers' top-k vectors."""
        sizes = [payload_nbytes(p) for p in payloads]
        if isinstance(ctx, PsCtx) and ctx.indices is not None:  # the leader's index broadcast
            sizes[self.leader] += ctx.index_bytes
        self.log_senders("bytes", sizes)
        if ctx.phase > 1:
            self.log_senders("values", [sum(t.numel() for part, t in zip(PARTS[ctx.phase], p)
                                            if part in VALUE_PARTS) for p in payloads])
        if ctx.phase == 1:
            for rank, payload in enumerate(payloads):
                expect_dense(payload, ctx.info, f"lgc_ps phase-1 payload of rank {rank}")
            return torch.stack([p[0] for p in payloads]).mean(0).view(ctx.info.shape)
        parts = [self.parse(p, ctx, rank) for rank, p in enumerate(payloads)]
        if ctx.phase == 2:
            self.train(parts, ctx)
            return self.average(parts, ctx)
        return self.average(parts, ctx, latent=parts[self.leader].latent)

    def log_senders(self, what: str, per_rank: Sequence[float]) -> None:
        """``lgc_leader_<what>`` and ``lgc_others_<what>`` (the mean over the other workers)
        of a per-rank quantity the master received (Tables IV and VI report the leader and
        the others apart)."""
        if len(per_rank) > 1:
            leader = self.leader
            self.metrics.add(f"lgc_leader_{what}", per_rank[leader])
            self.metrics.add(f"lgc_others_{what}",
                             (sum(per_rank) - per_rank[leader]) / (len(per_rank) - 1))

    def decode(self, payload: Payload, ctx: LGCCtx) -> torch.Tensor:
        """A single payload on its own (a world of one); in phase 3 it must carry the latent."""
        if ctx.phase == 1:
            expect_dense(payload, ctx.info, "lgc_ps phase-1 payload")
            return payload[0].view(ctx.info.shape)
        part = self.parse(payload, ctx, self.rank)
        if ctx.phase == 3 and ctx.plan.mu and not part.latent.numel():
            raise PayloadError("an lgc_ps payload decodes on its own only when it carries the "
                               "latent (the leader's)")
        return self.average([part], ctx, latent=part.latent)

    def parse(self, payload: Payload, ctx: PsCtx, rank: int) -> WorkerPart:
        plan = ctx.plan
        try:
            if ctx.phase == 2:
                dense, values, idx = payload
                if values.numel() != plan.mu + plan.kappa or dense.numel() != plan.n_dense:
                    raise PayloadError(f"{values.numel()} top-k values and {dense.numel()} dense "
                                       f"values, expected {plan.mu + plan.kappa} and "
                                       f"{plan.n_dense}")
                return WorkerPart(dense, self.worker_indices(idx, ctx), values[:plan.mu],
                                  values[plan.mu:])
            dense, latent, innovation, values_l, scale, idx, pos = payload
            if (innovation.numel() != plan.nu or values_l.numel() != plan.kappa
                    or scale.numel() != 1 or dense.numel() != plan.n_dense):
                raise PayloadError(f"sizes (dense {dense.numel()}, innovation "
                                   f"{innovation.numel()}, Lambda {values_l.numel()}, scale "
                                   f"{scale.numel()}) differ from the plan's ({plan.n_dense}, "
                                   f"{plan.nu}, {plan.kappa}, 1)")
            if latent.numel() not in (0, padded_length(plan.mu) // 4):
                raise PayloadError(f"latent of {latent.numel()} values, expected "
                                   f"{padded_length(plan.mu) // 4}")
            return WorkerPart(dense, self.worker_indices(idx, ctx), None, values_l,
                              latent, plan.decode_positions(pos, self.index_coding), innovation,
                              scale.float())
        except PayloadError as err:
            raise PayloadError(f"rank {rank}: {err}") from None

    def worker_indices(self, idx: torch.Tensor, ctx: PsCtx) -> list[torch.Tensor]:
        """A worker's per-layer top-k indices: its own DEFLATE stream, or with ``indices:
        leader`` the leader's broadcast selection (the payload's stream is then empty)."""
        if ctx.indices is None:
            return ctx.plan.decode_indices(idx, self.index_coding)
        if idx.numel():
            raise PayloadError(f"an index stream of {idx.numel()} bytes, but with indices: "
                               f"leader every worker uses the leader's broadcast indices")
        return ctx.indices

    @staticmethod
    def innovation_vector(plan: Plan, positions: torch.Tensor, values: torch.Tensor,
                          scale: torch.Tensor | float = 1.0) -> torch.Tensor:
        """u = the innovation values / s at their positions, zeros elsewhere: (1, 1, mu_pad)."""
        u = torch.zeros(plan.mu, device=values.device)
        u[positions] = values.float() / scale
        return pad(u.unsqueeze(0), padded_length(plan.mu))

    def average(self, parts: Sequence[WorkerPart], ctx: LGCCtx,
                latent: torch.Tensor | None = None) -> torch.Tensor:
        """Mean over workers: F dense, M from the top-k values (phase 2) or worker k's decoder
        applied to the latent and its innovation (phase 3), Lambda from its top-k values."""
        plan, device = ctx.plan, parts[0].values_l.device
        out = torch.zeros(plan.n, dtype=ctx.info.dtype, device=device)
        out[plan.dense_positions(device)] = torch.stack([p.dense for p in parts]).sum(0)
        if ctx.phase == 3 and plan.mu:
            z = latent.view(1, LATENT_CHANNELS, -1)
        for k, part in enumerate(parts):
            flat_m, flat_l = plan.flat_positions(part.indices)
            if ctx.phase == 2:
                values_m = part.topk_m
            elif plan.mu:
                with torch.no_grad(), self.metrics.timer("ae_s"):
                    u = self.innovation_vector(plan, part.positions, part.innovation, part.scale)
                    y = self.decoders[k](z, u)[0, 0, :plan.mu]
                if k == self.rank and isinstance(ctx, PsCtx) and ctx.own is not None:
                    self.log_rho(y, u[0, 0, :plan.mu], ctx.own.float() / part.scale)
                values_m = self.check_reconstruction(y * part.scale).to(out.dtype)
            else:
                values_m = out[:0]
            out.index_add_(0, flat_m, values_m)
            out.index_add_(0, flat_l, part.values_l)
        return out.div_(len(parts))

    def train(self, parts: Sequence[WorkerPart], ctx: LGCCtx) -> None:
        """One step of Eq. 5 over the K workers' vectors x_k = g~_k / s_k: every x_k is
        encoded, a random worker r's code is decoded by every D^k with u_k, and
        lambda1 * sum_k |D^k(z_r, u_k) - x_k|^2 + lambda2 * sum_{k != m} |z_k - z_m|^2 is
        minimised over E and all D^k."""
        plan = ctx.plan
        if not plan.mu:
            return
        topk = torch.stack([p.topk_m for p in parts]).float()
        x = topk / self.scale(topk)
        u = torch.cat([self.innovation_vector(plan, pos, row[pos])
                       for row in x for pos in (plan.innovation(row),)])
        r = stable_hash(self.seed, "lgc_ps_r", ctx.step) % len(parts)
        length = padded_length(plan.mu)
        lam1, lam2 = float(self.ae["lambda1"]), float(self.ae["lambda2"])
        if len(parts) > 1:
            self.log_worker_similarity(plan, parts, x)

        def loss() -> torch.Tensor:
            z = self.encoder(pad(x, length))
            rec = torch.cat([d(z[r:r + 1], u[k:k + 1]) for k, d in enumerate(self.decoders)])
            l_rec = (rec[:, 0, :plan.mu] - x).pow(2).sum()
            l_sim = similarity_loss(z)
            self.metrics.add("lgc_recon_loss", l_rec.item())
            self.metrics.add("lgc_sim_loss", l_sim.item())
            self.log_rho(rec[:, 0, :plan.mu].detach(), u[:, 0, :plan.mu], x)
            return lam1 * l_rec + lam2 * l_sim

        self.train_step(loss)

    def log_rho(self, decoded: torch.Tensor, innovation: torch.Tensor,
                target: torch.Tensor) -> None:
        """``lgc_rho`` = |x_hat - x|^2 / |x|^2 and ``lgc_rho_innov`` = |u - x|^2 / |x|^2 (the
        innovation alone) on RMS-scaled vectors (this library's diagnostic of Eq. (4)). Phase
        2: over the K vectors the step trains on. Phase 3: the master's own vector, decoded from the
        leader's latent and its innovation as every worker's is; a decoder that only passes
        its innovation through gives rho = rho_innov."""
        norm = max(float(target.pow(2).sum()), 1e-30)
        self.metrics.add("lgc_rho", float((decoded - target).pow(2).sum()) / norm)
        self.metrics.add("lgc_rho_innov", float((innovation - target).pow(2).sum()) / norm)

    def log_worker_similarity(self, plan: Plan, parts: Sequence[WorkerPart],
                              x: torch.Tensor) -> None:
        """How much a code of x_r can tell about x_k, as means over ordered worker pairs:
        ``lgc_worker_cos``, the slot-wise cosine of x_k and x_m, and ``lgc_index_overlap``,
        the share of k's M indices that m selected too (1 with ``indices: leader``)."""
        pairs = len(parts) * (len(parts) - 1)
        unit = nn.functional.normalize(x, dim=1)
        cos = unit @ unit.T
        self.metrics.add("lgc_worker_cos", float((cos.sum() - cos.trace()) / pairs))
        flat = [plan.flat_positions(p.indices)[0] for p in parts]
        shared = sum(torch.isin(a, b).sum().item() for i, a in enumerate(flat)
                     for j, b in enumerate(flat) if i != j)
        self.metrics.add("lgc_index_overlap", shared / (pairs * plan.mu))
