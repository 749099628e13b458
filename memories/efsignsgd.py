"""Error feedback of EF-SIGNSGD (Karimireddy, Rebjock, Stich, Jaggi: *Error Feedback Fixes
SignSGD and other Gradient Compression Schemes*, ICML 2019, Algorithm 1), in the paper's
parameter units:

    compensate:  p = lr * g + e
    update:      e = p - C(p)

The paired ``efsignsgd`` compressor divides the aggregate by the same `lr` (this memory sets
it when the pipeline is built), so the optimiser's step lr * output is the paper's update
C(p), averaged over ranks. With a constant learning rate this equals residual memory in
gradient units; with a changing one the residual keeps the paper's units."""

from __future__ import annotations

from gracecomm.compressor import Compressor
from gracecomm.memories.residual import ResidualMemory
from gracecomm.registry import MEMORIES
from gracecomm.validation import IncompatibleError, check_range


@MEMORIES.register("efsignsgd")
class EFSignSGDMemory(ResidualMemory):
    """Residual memory with beta = 1 and gamma = `lr` (set it to the optimiser's learning
    rate; the config group entry follows ``trainer.lr``)."""

    run_keys = {"lr": "trainer.lr"}

    def __init__(self, lr: float = 1.0) -> None:
        super().__init__(beta=1.0, gamma=float(check_range(lr, "memory 'efsignsgd'", "lr", 0.0,
                                                           low_open=True)))

    def check(self, compressor: Compressor) -> None:
        """Only the ``efsignsgd`` compressor undoes the scaling; hand it the learning rate."""
        if compressor.registry_name != "efsignsgd":
            raise IncompatibleError(
                f"{self.label} scales gradients by the learning rate, which only compressor "
                f"'efsignsgd' divides out, not {compressor.label}; use memory=residual")
        compressor.lr = self.gamma  # type: ignore[attr-defined]
