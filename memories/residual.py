"""Residual memory, i.e. error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et
al. 2019): what compression dropped is added back to the next gradient.

    compensate:  t = beta * e + gamma * g      (t = gamma * g on the first call)
    update:      e = t - decompress(C(t))      (``reference: own``, the default)
                 e = t - mean over ranks        (``reference: mean``, after the exchange)

``reference: mean`` feeds back what the aggregate lacks of this rank's tensor, the choice of
PyTorch's ``powerSGD_hook``; it skips the steps a compressor sends without error feedback
(`Compressor.feeds_back`, e.g. PowerSGD's dense warm-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gracecomm.buffers import dense_empty_like, difference, recycled
from gracecomm.compressor import Compressor, Payload
from gracecomm.memory import Memory
from gracecomm.registry import MEMORIES
from gracecomm.validation import check_choice, check_range


@MEMORIES.register("residual")
class ResidualMemory(Memory):
    state_attrs = ("residuals",)

    def __init__(self, beta: float = 1.0, gamma: float = 1.0, reference: str = "own") -> None:
        super().__init__()
        self.beta = float(check_range(beta, self.label, "beta", 0.0))
        self.gamma = float(check_range(gamma, self.label, "gamma", 0.0))
        self.reference = check_choice(reference, ("own", "mean"), self.label, "reference")
        self.residuals: dict[str, torch.Tensor] = {}
        self.lent: dict[str, torch.Tensor] = {}  # compensate's outputs, until their update

    @property
    def wants_mean(self) -> bool:
        return self.reference == "mean"

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        residual = self.residuals.get(name)
        if residual is None or residual.shape != tensor.shape:
            if self.gamma == 1.0:
                return tensor
            out = torch.mul(tensor, self.gamma, out=dense_empty_like(tensor))
        else:
            out = dense_empty_like(tensor, torch.result_type(tensor, residual))
            scaled = tensor if self.gamma == 1.0 else torch.mul(tensor, self.gamma, out=out)
            torch.add(scaled, residual, alpha=self.beta, out=out)
        self.lent[name] = out
        return out

    def compensate_many(self, named: Sequence[tuple[str, torch.Tensor]]
                        ) -> list[tuple[str, torch.Tensor]]:
        """`compensate` of every tensor, those below `dense_empty`'s recycling size with a
        residual of their shape and dtype added in one call (``torch._foreach_add``): the
        same sums, without a call per tensor (a DDP bucket holds dozens of small ones)."""
        out = [None] * len(named)
        joint = []
        for i, (name, tensor) in enumerate(named):
            residual = self.residuals.get(name)
            if (self.gamma == 1.0 and residual is not None and residual.shape == tensor.shape
                    and residual.dtype == tensor.dtype and not recycled(tensor)):
                joint.append(i)
            else:
                out[i] = (name, self.compensate(tensor, name))
        if joint:
            sums = torch._foreach_add([named[i][1] for i in joint],
                                      [self.residuals[named[i][0]] for i in joint],
                                      alpha=self.beta)
            for i, total in zip(joint, sums):
                self.lent[named[i][0]] = total
                out[i] = (named[i][0], total)
        return out

    def update(self, tensor: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        """e = t - decompress(C(t)) (`Compressor.subtract_decompressed`), in place when t
        is this memory's own output of `compensate`."""
        own = self.lent.pop(name, None) is tensor
        if self.reference == "own":
            self.residuals[name] = compressor.subtract_decompressed(tensor, payload, ctx, own)

    def keeps_nothing_for(self, names: Sequence[str]) -> bool:
        """True where none of the tensors has a residual and gamma is 1."""
        return self.gamma == 1.0 and not any(name in self.residuals for name in names)

    def update_sent_whole(self, named: Sequence[tuple[str, torch.Tensor]],
                          dense: Compressor) -> None:
        """Forget the residuals of tensors sent whole (nothing of them is left)."""
        for name, _ in named:
            self.residuals.pop(name, None)
            self.lent.pop(name, None)

    def update_mean(self, tensor: torch.Tensor, name: str, compressor: Compressor, ctx: Any,
                    mean: torch.Tensor) -> None:
        if compressor.feeds_back(ctx):
            self.residuals[name] = difference(tensor, mean)

    def update_mean_many(self, named: Sequence[tuple[str, torch.Tensor]],
                         compressor: Compressor, ctxs: Sequence[Any],
                         means: Sequence[torch.Tensor]) -> None:
        """`update_mean` of every tensor, the small ones in one ``torch._foreach_sub``."""
        joint = []
        for (name, tensor), ctx, mean in zip(named, ctxs, means):
            if not compressor.feeds_back(ctx):
                continue
            if recycled(tensor) or mean.dtype != tensor.dtype or mean.shape != tensor.shape:
                self.residuals[name] = difference(tensor, mean)
            else:
                joint.append((name, tensor, mean))
        if joint:
            for (name, _, _), residual in zip(joint, torch._foreach_sub(
                    [t for _, t, _ in joint], [m for _, _, m in joint])):
                self.residuals[name] = residual

