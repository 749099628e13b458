"""The Memory abstraction: error feedback around a compressor (GRACE, Sec. 3).

``compensate(g, name)`` runs before compression and returns the tensor to compress;
``update(t, name, compressor, payload, ctx)`` runs after it, with the compensated tensor and
this rank's own payload, and keeps whatever the next step needs (e.g. the residual
t - decompress(payload)). A memory with ``wants_mean`` also gets ``update_mean(t, name,
compressor, ctx, mean)`` once the exchange has returned the mean over ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from gracecomm.compressor import Compressor, Payload
from gracecomm.needs import Need
from gracecomm.part import Part


class Memory(Part, ABC, kind="memory"):
    """Base class of all memories.

    A subclass implements `compensate` and `update`, declares its state in ``state_attrs``
    (`gracecomm.state`) and registers itself (``@MEMORIES.register("name")``).

    Example:
        Error feedback in five lines (the built-in ``residual`` adds scaling options):

        >>> import torch
        >>> from gracecomm import Memory, create
        >>> class Residual(Memory):
        ...     state_attrs = ("residuals",)
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.residuals = {}
        ...     def compensate(self, tensor, name):
        ...         return tensor + self.residuals.get(name, 0.0)
        ...     def update(self, tensor, name, compressor, payload, ctx):
        ...         self.residuals[name] = compressor.subtract_decompressed(tensor, payload, ctx)
        >>> top, memory = create("compressor", "topk", ratio=0.5), Residual()
        >>> t = memory.compensate(torch.tensor([1.0, -3.0]), "w")
        >>> memory.update(t, "w", top, *top.compress(t, "w"))
        >>> memory.state_dict()
        {'residuals': {'w': tensor([1., 0.])}}
    """

    identity: ClassVar[bool] = False  # compensate returns its input and update keeps nothing

    @property
    def wants_mean(self) -> bool:
        """Whether `update_mean` should be called after each exchange."""
        return False

    def needs(self) -> frozenset[Need]:
        """What this memory needs from the exchange.

        Returns:
            Its requirements (`gracecomm.needs`); none by default.
        """
        return frozenset()

    def check(self, compressor: Compressor) -> None:
        """Check that this memory can work with a compressor (the pipeline calls it once).

        Args:
            compressor: The pipeline's compressor.

        Raises:
            IncompatibleError: It cannot (the message names what to pick instead).
        """

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor to compress, before compression.

        Args:
            tensor: The gradient.
            name: Its name, which keys per-tensor state.

        Returns:
            The tensor to compress (e.g. the gradient plus the residual).
        """

    @abstractmethod
    def update(self, tensor: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        """Record what was not sent, after compression.

        Args:
            tensor: What `compensate` returned.
            name: Its name.
            compressor: The compressor (for `Compressor.subtract_decompressed`).
            payload: This rank's payload for the tensor.
            ctx: Its ctx.
        """

    def keeps_nothing_for(self, names: Sequence[str]) -> bool:
        """Whether `compensate` returns these tensors as they are: nothing kept for them and
        no scaling (then a bucket they fill may go whole, `Grace.sends_whole`).

        Args:
            names: The tensors' names.

        Returns:
            `identity` by default; a memory of residuals answers for its own.
        """
        return self.identity

    def update_sent_whole(self, named: Sequence[tuple[str, torch.Tensor]],
                          dense: Compressor) -> None:
        """Record tensors sent whole, in fp16 or dense (``strategy="auto"``'s other forms,
        `gracecomm.strategy`): nothing of them is left to feed back. The fp16 cast's
        rounding (relative error at most 2**-11) is dropped, as the fp16 method drops it
        with its default memory ``none``. By default `update` of each with `dense`'s
        payload; a memory that keeps only residuals forgets theirs.

        Args:
            named: The (name, tensor) pairs `compensate_many` returned.
            dense: The dense codec (compressor ``none``).
        """
        if self.identity:
            return
        for name, tensor in named:
            self.update(tensor, name, dense, *dense.compress(tensor, name))

    def update_mean(self, tensor: torch.Tensor, name: str, compressor: Compressor, ctx: Any,
                    mean: torch.Tensor) -> None:
        """After the exchange, for memories with ``wants_mean``.

        Args:
            tensor: What `compensate` returned.
            name: Its name.
            compressor: The compressor.
            ctx: This rank's ctx for the tensor.
            mean: The mean over ranks the exchange returned for it.
        """

    def compensate_many(self, named: Sequence[tuple[str, torch.Tensor]]
                        ) -> list[tuple[str, torch.Tensor]]:
        """`compensate` for each tensor of one call, in order; a memory may do it in fewer
        calls (one per call instead of one per tensor) with the same result.

        Args:
            named: The (name, tensor) pairs of the call.

        Returns:
            (name, tensor to compress) for each, in the same order.
        """
        return [(name, self.compensate(tensor, name)) for name, tensor in named]

    def update_mean_many(self, named: Sequence[tuple[str, torch.Tensor]],
                         compressor: Compressor, ctxs: Sequence[Any],
                         means: Sequence[torch.Tensor]) -> None:
        """`update_mean` for each tensor of one call (as `compensate_many`).

        Args:
            named: The (name, tensor) pairs `compensate_many` returned.
            compressor: The compressor.
            ctxs: This rank's ctx for each tensor.
            means: The mean over ranks the exchange returned for each.
        """
        for (name, tensor), ctx, mean in zip(named, ctxs, means):
            self.update_mean(tensor, name, compressor, ctx, mean)

    def set_local_norm(self, norm: float) -> None:
        """Receive the norm of all local gradients of the step, for memories that need
        `Need.GLOBAL_NORM` (DGC's clipping); the pipeline gives it before any gradient of
        the step is compensated.

        Args:
            norm: The 2-norm of the concatenation of the step's local gradients.
        """
