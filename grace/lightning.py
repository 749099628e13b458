"""PyTorch Lightning: `GraceStrategy`, the strategy to name instead of ``DDPStrategy``.

    from gracecomm.lightning import GraceStrategy
    trainer = Trainer(strategy=GraceStrategy({"name": "topk", "ratio": 0.01}), devices=2)

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a comm hook only on CUDA devices
and before the optimizers exist. This strategy registers the library's hook itself, on any
device, in `setup` (public), once Lightning has wrapped the model in DDP and created the
optimizers, which are checked then (before the first step); a GradScaler of Lightning's
mixed precision is handed to the hook. Every step's bytes and compression time go to
Lightning's loggers, and checkpoints carry every rank's compression state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gracecomm.ddp import GradientExchange
from gracecomm.frameworks import attach, gather_state, logged_metrics, pipeline, restore_state
from gracecomm.pipeline import Grace, Spec
from gracecomm.validation import ConfigError, MissingDependencyError

try:
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError:
    try:
        from pytorch_lightning.strategies import DDPStrategy
        from pytorch_lightning.trainer.states import TrainerFn
    except ImportError as err:
        raise MissingDependencyError("gracecomm.lightning needs PyTorch Lightning: pip install "
                                "'gracecomm[lightning]'") from err

CHECKPOINT_KEY = "gracecomm"  # every rank's compression state in a Lightning checkpoint
HOOK_OPTIONS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class GraceStrategy(DDPStrategy):
    """DDP with compressed gradient exchange through a `gracecomm.Grace` pipeline.

    Args:
        compressor: a part spec as `gracecomm.build` takes it (``"topk"``, ``{"name":
            "topk", "ratio": 0.01}``, a Hydra config, an instance) or a built pipeline.
        memory: the memory's spec; None brings the compressor's.
        communicator: the communicator's spec; None brings the compressor's.
        check_finite: raise on NaN/Inf gradients (a GradScaler of Lightning's ``16-mixed``
            precision switches this off by itself: its overflow steps pass through).
        weight_decay: added to the gradients before compression, where a part applies the
            momentum itself (the optimizer then runs with neither).
        asynchronous: overlap each bucket's exchange with the rest of backward.
        hierarchy: ``"node"``: reduce dense inside each node and compress only what crosses
            nodes (`gracecomm.hierarchy`); ``"flat"``; None: the pipeline's (flat for specs).
        log_metrics: log ``gracecomm/wire_bytes``, ``gracecomm/dense_bytes``,
            ``gracecomm/compression_factor``, ``gracecomm/compression_s`` and
            ``gracecomm/comm_s`` every step through Lightning's loggers.
        **kwargs: every other `DDPStrategy` keyword (``process_group_backend``, ``timeout``,
            ``start_method``, DDP's ``find_unused_parameters``, ``bucket_cap_mb``, ...).

    Raises:
        ConfigError: a bad part spec, or a comm-hook keyword of `DDPStrategy` (this strategy
            registers its own hook); when fitting starts, an optimizer the method cannot
            train with (DGC's memory with an optimizer that keeps a momentum), or a model
            Lightning did not wrap in DDP.

    Example:
        >>> strategy = GraceStrategy({"name": "topk", "ratio": 0.1},
        ...                          process_group_backend="gloo")
        >>> Trainer(strategy=strategy, accelerator="cpu", devices=2).fit(module)
    """

    def __init__(self, compressor: Spec | Grace = "none", memory: Spec = None,
                 communicator: Spec = None, *, check_finite: bool = True,
                 weight_decay: float = 0.0, asynchronous: bool = True, log_metrics: bool = True,
                 hierarchy: str | None = None, **kwargs: Any) -> None:
        given = [key for key in HOOK_OPTIONS if kwargs.get(key) is not None]
        if given:
            raise ConfigError(f"GraceStrategy registers the gracecomm hook itself, so it "
                              f"takes no {', '.join(given)}: give the method as "
                              "GraceStrategy(compressor, memory, communicator), or use "
                              "DDPStrategy for another hook")
        super().__init__(**kwargs)
        self.grace = pipeline(compressor, memory, communicator, check_finite=check_finite,
                              hierarchy=hierarchy)
        self.weight_decay = weight_decay
        self.asynchronous = asynchronous
        self.log_metrics = log_metrics
        self.exchange: GradientExchange | None = None
        self._resumed: tuple[Any, str] | None = None  # (saved state, checkpoint path)

    def setup(self, trainer: Any) -> None:
        """Lightning's set-up (the model wrapped in DDP, the optimizers created), then the
        hook registered on the DDP model with the optimizers checked, and a resumed
        checkpoint's compression state restored."""
        super().setup(trainer)
        resumed, self._resumed = self._resumed, None
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self.exchange = attach(
            self.model, self.grace, list(self.optimizers), framework="Lightning",
            fix="fit with devices > 1 or num_nodes > 1", weight_decay=self.weight_decay,
            asynchronous=self.asynchronous,
            scaler=getattr(self.precision_plugin, "scaler", None))
        if resumed is not None:
            restore_state(self.grace, resumed[0], self.root_device, resumed[1])

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        """The step (its closure runs forward, backward and the exchange), then the step's
        compression figures to Lightning's loggers."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        stats = self.grace.metrics.pop()
        if self.log_metrics and stats.get("dense_bytes"):
            self.lightning_module.log_dict(logged_metrics(stats), on_step=True, on_epoch=False,
                                           batch_size=1)
        return output

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        """Every rank's compression state into rank 0's checkpoint (every rank calls this,
        as ``Trainer.save_checkpoint`` does)."""
        saved = gather_state(self.grace)
        if saved is not None:
            checkpoint[CHECKPOINT_KEY] = saved
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's loading (its options passed on); this rank's compression state is
        restored when fitting starts (`setup`)."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._resumed = (checkpoint.get(CHECKPOINT_KEY), f"checkpoint {checkpoint_path}")
        return checkpoint
