"""What a method needs from the exchange, declared by its parts (`Compressor.needs`,
`Memory.needs`) and honoured by the library for the DDP hook and custom loops alike
(`gracecomm.ddp.GradientExchange`)."""

from __future__ import annotations

from enum import Enum


class Need(Enum):
    """One requirement of a compressor or memory on how gradients reach it.

    Example:
        >>> import gracecomm
        >>> gracecomm.build("dgc").needs  # DGC's memory applies the momentum
        frozenset({<Need.OWNS_MOMENTUM: 'the momentum'>})
    """

    WHOLE_MODEL = "every gradient of a step in one call"
    """It compresses the model as one vector (LGC): one exchange per step, after backward."""

    OWNS_MOMENTUM = "the momentum"
    """It applies the momentum itself (DGC's momentum correction, Signum): the optimizer must
    run without momentum, and weight decay is added to the gradients before compression."""

    GLOBAL_NORM = "the norm of all local gradients of a step"
    """It clips by the norm of all local gradients (DGC's local gradient clipping), which is
    known only once every gradient of the step is."""
