"""Deep Gradient Compression's memory (Lin et al., ICLR 2018, Secs. 3.2-3.3): momentum
correction, momentum factor masking and local gradient clipping.

    compensate(g):  g = g min(1, c / (||g|| + 1e-6)),  c = clip_norm N^(-1/2)   (if clipping)
                    u = m u + g                    (momentum correction)
                    v = v + u                      (Nesterov: v = v + g + m u)
                    return v
    update:         u[sent] = 0;  v[sent] = 0     (momentum factor masking)
                    v = 0 and u kept when the whole tensor was sent (dense transmission:
                    exact heavy-ball momentum, as LGC's dense layers and warm-up need)

The momentum lives here, so the optimizer must run with momentum 0, and weight decay must be
added to g before `compensate` (`Need.OWNS_MOMENTUM`; the library checks the optimizer and
adds the decay). With ``clip_scope: model`` (DGC's choice) every tensor is scaled by the same
factor from the norm of all local gradients, which the pipeline supplies with `set_local_norm`
before the exchange (`Need.GLOBAL_NORM`); ``tensor`` clips each tensor by its own norm. With
m = 0 and no clipping this memory equals residual memory exactly.

Momentum factor masking needs a compressor that sends some elements and leaves the others
(a sparsifier, or a dense or per-element method). PowerSGD (Vogels et al., NeurIPS 2019)
sends a low-rank approximation of every element: every position counts as sent, v would be
zeroed each step, and its error M - P Q^T (the error feedback of its Algorithm 1) would be
dropped, training plain momentum SGD on low-rank gradients. The pairing is refused
(`check`): PowerSGD's own error feedback is ``memory=residual``, with the momentum in the
optimizer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from gracecomm.buffers import dense_empty_like
from gracecomm.compressor import Compressor, Payload
from gracecomm.memory import Memory
from gracecomm.needs import Need
from gracecomm.registry import MEMORIES
from gracecomm.sparse import SparseSelection
from gracecomm.validation import ConfigError, IncompatibleError, check_choice, check_range

LOW_RANK = ("powersgd",)  # compressors whose payload approximates every element (`check`)


@MEMORIES.register("dgc")
class DGCMemory(Memory):

    state_attrs = ("u", "v", "local_norm")
    run_keys = {"momentum": "trainer.momentum"}  # the optimizer's, which then runs without

    def __init__(self, momentum: float = 0.9, nesterov: bool = False,
                 clip_norm: float | None = None, clip_scope: str = "model") -> None:
        super().__init__()
        self.momentum = float(check_range(momentum, self.label, "momentum", 0.0, 1.0,
                                          high_open=True))
        self.nesterov = bool(nesterov)
        self.clip_norm = None if clip_norm is None else float(
            check_range(clip_norm, self.label, "clip_norm", 0.0, low_open=True))
        self.clip_scope = check_choice(clip_scope, ("model", "tensor"), self.label, "clip_scope")
        self.local_norm: float | None = None
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def needs(self) -> frozenset[Need]:
        clips_by_model = self.clip_norm is not None and self.clip_scope == "model"
        return frozenset({Need.OWNS_MOMENTUM, *([Need.GLOBAL_NORM] if clips_by_model else [])})

    def check(self, compressor: Compressor) -> None:
        """Refuse a low-rank compressor (PowerSGD), whose payload carries no element for
        momentum factor masking to clear (module docstring)."""
        if compressor.registry_name in LOW_RANK:
            raise IncompatibleError(
                f"{self.label} masks its momentum and accumulation at the elements a "
                "compressor sends (Lin et al. 2018, Sec. 3.3), but "
                f"{compressor.label} sends a low-rank approximation of every element, so "
                "the whole accumulation would be cleared each step and its error feedback "
                "(Vogels et al. 2019, Algorithm 1) lost; use memory=residual (its default) "
                "with the optimizer's momentum")

    def set_local_norm(self, norm: float) -> None:
        self.local_norm = float(norm)

    def clip(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Scale `tensor` so that the local norm is at most clip_norm / sqrt(N)."""
        assert self.clip_norm is not None
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.clip_scope == "tensor":
            norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float64))
        elif self.local_norm is None:
            raise ConfigError(f"{self.label}: clip_scope 'model' needs the norm of all local "
                              "gradients before each exchange, which the pipeline sets; call "
                              "memory.set_local_norm(norm) when using the memory on its own, or "
                              f"use clip_scope=tensor (tensor '{name}')")
        else:
            norm = self.local_norm
        factor = self.clip_norm / math.sqrt(world) / (norm + 1e-6)
        return tensor * factor if factor < 1.0 else tensor

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        g = tensor if self.clip_norm is None else self.clip(tensor, name)
        u, v = self.u.get(name), self.v.get(name)
        if u is None or v is None or u.shape != g.shape:
            u, v = torch.zeros_like(g), torch.zeros_like(g)
        # new tensors, not in place: a state snapshot taken before the step stays valid
        # (on recycled buffers when large: `gracecomm.buffers.dense_empty`)
        u = torch.add(g, u, alpha=self.momentum, out=dense_empty_like(g))
        if self.nesterov:
            v = torch.add(v, g, out=dense_empty_like(g))
            v.add_(torch.mul(u, self.momentum, out=dense_empty_like(g)))
        else:
            v = torch.add(v, u, out=dense_empty_like(g))
        self.u[name], self.v[name] = u, v
        return v

    def update(self, tensor: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        u, v = self.u[name].view(-1), self.v[name].view(-1)
        sent = sent_positions(compressor, payload, ctx, v.numel())
        if sent is None:  # dense transmission: nothing left to accumulate
            v.zero_()
            return
        u.index_fill_(0, sent, 0)
        v.index_fill_(0, sent, 0)


def sent_positions(compressor: Compressor, payload: Payload, ctx: Any,
                   numel: int) -> torch.Tensor | None:
    """Flat positions (int64) of the elements `payload` carries, None when it carries all
    `numel`: a sparse selection's own indices (no pass over a mask), else the positions of
    the compressor's `transmitted` mask."""
    if isinstance(compressor, SparseSelection):
        sent = compressor.kept_indices(payload, ctx).long()
        return None if sent.numel() == numel else sent
    mask = compressor.transmitted(payload, ctx)
    return None if bool(mask.all()) else mask.nonzero().view(-1)

