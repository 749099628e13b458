"""LGC_RAR: learned gradient compression in the ring-allreduce pattern (Abrahamyan et al.,
TNNLS, Sec. IV-B, Algorithm 2, Fig. 5(b), Fig. 7).

Each step a leader rank, drawn from a seed every rank shares, broadcasts its per-layer top-k
indices (DEFLATE); every rank takes its own values at those indices. In phase 2 the values
are all-gathered (the trainer rank needs every rank's vector to train the autoencoder on the
mean); in phase 3 every rank encodes its vector, the latents are averaged by the allreduce
communicator together with F and the Lambda values, and every rank decodes the mean latent,
so all ranks end with bit-identical aggregates. The trainer broadcasts the encoder and decoder
once when phase 2 ends.

Joint payloads (averaged over ranks by the allreduce communicator):

- phase 1: (gradient,)
- phase 2: (F,)  -- the top-k values travel in the compressor's own allgather
- phase 3: (F, latent, Lambda values)
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gracecomm.compressor import Payload, TensorInfo
from gracecomm.compressors.lgc.autoencoder import LATENT_CHANNELS, pad, padded_length
from gracecomm.compressors.lgc.base import LGC, SCALE_EPS, LGCCtx, expect_dense
from gracecomm.compressors.lgc.layout import Plan
from gracecomm.registry import COMPRESSORS
from gracecomm.sparse import DEFAULT_RATIO
from gracecomm.validation import ConfigError, check_choice, check_range

PARTS = {2: ("dense",), 3: ("dense", "latent", "values")}


@dataclass(frozen=True, eq=False)
class RarCtx(LGCCtx):
    """Adds the leader's selection (flat positions in M and Lambda), and per phase the mean
    over ranks of the all-gathered values (2) or the shared input scale s (3)."""

    flat_m: torch.Tensor | None = None
    flat_l: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    scale: torch.Tensor | None = None


@COMPRESSORS.register("lgc_rar")
class LGCRar(LGC):
    """`leader`: ``random`` (leader of step t = random.Random(seed * 1_000_003 + t)
    .randrange(K)) or ``cyclic`` (t mod K). `trainer_rank`: the rank that trains the
    autoencoder. `ae.lambda1` weights the reconstruction loss |D(mean_k E(x_k)) - mean_k x_k|^2."""

    summable = True  # the allreduce communicator averages F, the latents and the Lambda values
    communicators = ("allreduce",)
    default_communicator = "allreduce"

    def __init__(self, ratio: float = DEFAULT_RATIO, warmup_iters: int = 200,
                 ae_train_iters: int = 300, first_layer: Any = "auto",
                 last_layer: Any = "auto", seed: int = 0,
                 leader: str = "random", trainer_rank: int = 0,
                 index_coding: Mapping[str, Any] | None = None,
                 ae: Mapping[str, Any] | None = None) -> None:
        super().__init__(ratio, warmup_iters, ae_train_iters, first_layer, last_layer, seed,
                         index_coding, ae)
        self.leader = check_choice(leader, ("random", "cyclic"), self.label, "leader")
        self.trainer_rank = check_range(trainer_rank, self.label, "trainer_rank", 0,
                                        integer=True)

    def leader_at(self, step: int) -> int:
        """The leader of `step`, computed identically on every rank without communication."""
        k = self.world_size
        if self.leader == "cyclic":
            return step % k
        return random.Random(self.seed * 1_000_003 + step).randrange(k)

    def sync_source(self) -> tuple[int, list[nn.Module]]:
        return self.trainer_rank, [self.encoder, self.decoders]

    def shared_scale(self, topk_m: torch.Tensor) -> torch.Tensor:
        """s = mean over ranks of RMS(g~_k) + 1e-12 (one allreduce of one value), or 1."""
        if self.ae["input_scale"] == "none":
            return torch.ones(1, device=topk_m.device)
        rms = self.rms(topk_m).reshape(1)
        if self.comm is not None:
            self.comm.all_reduce(rms)
            self.log_bytes("scalars", rms)
        return rms / self.world_size + SCALE_EPS

    def compress_sparse(self, plan: Plan, tensors: Sequence[torch.Tensor], info: TensorInfo,
                        phase: int) -> tuple[list[tuple[Payload, Any]], Payload, LGCCtx]:
        if self.trainer_rank >= self.world_size:
            raise ConfigError(f"{self.label}: option 'trainer_rank' is {self.trainer_rank} but "
                              f"the world has {self.world_size} ranks")
        leader = self.leader_at(self.step)
        self.metrics.add("lgc_leader", leader)
        self.metrics.add("lgc_is_leader", int(self.rank == leader))
        indices, index_bytes = self.leader_indices(plan, tensors, leader)
        topk_m, values_l = plan.values(tensors, indices)
        flat_m, flat_l = plan.flat_positions(indices)
        dense = plan.dense_part(tensors)
        self.log_topk_baseline(plan, dense, index_bytes)
        views = plan.views(tensors, indices)
        if phase == 2:
            local = torch.cat([topk_m, values_l])
            gathered = torch.stack(self.comm.all_gather(local) if self.comm is not None
                                   else [local])
            self.log_bytes("values", local)
            if self.rank == self.trainer_rank:
                self.train(plan, gathered[:, :plan.mu])
            payload: Payload = (dense,)
            ctx = RarCtx(info, plan, 2, self.step, flat_m, flat_l, gathered=gathered.mean(0))
        else:
            scale = self.shared_scale(topk_m)
            latent = topk_m.new_zeros(0, dtype=torch.float32)
            if plan.mu:
                with torch.no_grad(), self.metrics.timer("ae_s"):
                    latent = self.encode((topk_m / scale).unsqueeze(0), plan).reshape(-1)
            payload = (dense, latent, values_l)
            ctx = RarCtx(info, plan, 3, self.step, flat_m, flat_l, scale=scale)
        self.log_parts(PARTS[phase], payload)
        return views, payload, ctx

    def decode(self, payload: Payload, ctx: RarCtx) -> torch.Tensor:
        """The mean over ranks of the joint payload -> the mean flat gradient: in phase 3
        M is crop(D(z_mean)) * s."""
        if ctx.phase == 1:
            expect_dense(payload, ctx.info, "lgc_rar phase-1 payload")
            return payload[0].view(ctx.info.shape)
        plan, dense = ctx.plan, payload[0]
        out = torch.zeros(plan.n, dtype=ctx.info.dtype, device=dense.device)
        out[plan.dense_positions(dense.device)] = dense
        if ctx.phase == 2:
            out[torch.cat([ctx.flat_m, ctx.flat_l])] = ctx.gathered
            return out
        _, latent, values_l = payload
        if plan.mu:
            with torch.no_grad(), self.metrics.timer("ae_s"):
                z = latent.view(1, LATENT_CHANNELS, -1)
                x = self.decoders[0](z)[0, 0, :plan.mu] * ctx.scale
            out[ctx.flat_m] = self.check_reconstruction(x).to(out.dtype)
        out[ctx.flat_l] = values_l
        return out

    def train(self, plan: Plan, topk: torch.Tensor) -> None:
        """One step on L = lambda1 * |crop(D(mean_k E(x_k))) - mean_k x_k|^2 with
        x_k = g~_k / s and s the mean RMS (Eqs. (8)-(11); the RMS scaling is this library's)."""
        if not plan.mu:
            return
        topk = topk.float()
        scale = self.rms(topk).mean() + SCALE_EPS if self.ae["input_scale"] == "rms" else 1.0
        x = topk / scale
        target = x.mean(0)
        norm = max(float(target.pow(2).sum()), 1e-30)
        lam1 = float(self.ae["lambda1"])

        def loss() -> torch.Tensor:
            z = self.encoder(pad(x, padded_length(plan.mu))).mean(0, keepdim=True)
            l_rec = (self.decoders[0](z)[0, 0, :plan.mu] - target).pow(2).sum()
            self.metrics.add("lgc_recon_loss", l_rec.item())
            self.metrics.add("lgc_rho", l_rec.item() / norm)
            return lam1 * l_rec

        self.train_step(loss)
