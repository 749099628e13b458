"""The Memory abstraction: error feedback around a compressor (GRACE, Sec. 3).

``compensate(g, name)`` runs before compression and returns the tensor to compress;
``update(t, name, compressor, payload, ctx)`` runs after it, with the compensated tensor and
this rank's own payload, and keeps whatever the next step needs (e.g. the residual
t - decompress(payload)). A memory with ``wants_mean`` also gets ``update_mean(t, name,
compressor, ctx, mean)`` once the exchange has returned the mean over ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from gracecomm.compressor import Compressor, Payload
from gracecomm.needs import Need
from gracecomm.part import Part


class Memory(Part, ABC, kind="memory"):
    """Base class of all memories."""

    identity: ClassVar[bool] = False  # compensate returns its input and update keeps nothing

    @property
    def wants_mean(self) -> bool:
        """Whether `update_mean` should be called after each exchange."""
        return False

    def needs(self) -> frozenset[Need]:
        """What this memory needs from the exchange (`gracecomm.needs`)."""
        return frozenset()

    def check(self, compressor: Compressor) -> None:
        """Raise `IncompatibleError` if this memory cannot work with `compressor`."""

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return the tensor to compress (e.g. the gradient plus the residual)."""

    @abstractmethod
    def update(self, tensor: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        """Record what was not sent; `tensor` is what `compensate` returned."""

    def update_mean(self, tensor: torch.Tensor, name: str, compressor: Compressor, ctx: Any,
                    mean: torch.Tensor) -> None:
        """After the exchange (memories with ``wants_mean``): `tensor` is what `compensate`
        returned, `mean` the mean over ranks the exchange returned for it."""

    def set_local_norm(self, norm: float) -> None:
        """The norm of all local gradients of the step, given by the pipeline before any of
        them is compensated, to memories that need `Need.GLOBAL_NORM` (DGC's clipping)."""
