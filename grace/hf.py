"""The Hugging Face `Trainer`: `GraceTrainer`, a Trainer whose DDP gradient exchange goes
through a Grace pipeline.

    from gracecomm.hf import GraceTrainer
    trainer = GraceTrainer(model=model, args=args, train_dataset=data,
                           grace={"name": "topk", "ratio": 0.01})

The Trainer wraps the model in DDP (through Accelerate) inside ``train``; the hook is
registered on the wrapped model at the first `training_step` (public), before the first
backward, with the Trainer's optimizer checked and its GradScaler handed over. Each logged
training record gains the library's figures (means per step since the last record), and
every checkpoint folder ``checkpoint-N`` holds every rank's compression state in
``gracecomm.pt``, restored by ``train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import os
from typing import Any

from gracecomm.ddp import GradientExchange, check_optimizer
from gracecomm.frameworks import (
    MetricsWindow,
    attach,
    load_state_file,
    pipeline,
    save_state_file,
)
from gracecomm.pipeline import Grace, Spec
from gracecomm.validation import ConfigError, MissingDependencyError

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
    from transformers.training_args import ParallelMode
except ImportError as err:
    raise MissingDependencyError("gracecomm.hf needs transformers: pip install "
                            "'gracecomm[transformers]'") from err

SEVERAL_PROCESSES = ("the Trainer runs one process; start several, e.g. `torchrun "
                     "--nproc_per_node 2 train.py` (on CPUs with TrainingArguments("
                     "use_cpu=True))")


class GraceTrainer(Trainer):
    """A `transformers.Trainer` with compressed gradient exchange. Combine it with another
    Trainer subclass by inheriting from both (``class MyTrainer(GraceTrainer, SFTTrainer)``).

    Args:
        *args: the Trainer's.
        grace: a part spec as `gracecomm.build` takes it for the compressor (``"topk"``,
            ``{"name": "topk", "ratio": 0.01}``), or a built pipeline.
        weight_decay: added to the gradients before compression, where a part applies the
            momentum itself (the optimizer then runs with neither).
        asynchronous: overlap each bucket's exchange with the rest of backward.
        hierarchy: ``"node"``: reduce dense inside each node and compress only what crosses
            nodes (`gracecomm.hierarchy`); ``"flat"``; None: the pipeline's (flat for specs).
        **kwargs: the Trainer's.

    Raises:
        ConfigError: when constructed (before `train` starts anything), a bad spec, arguments
            that run one process (the Trainer would not wrap the model in DDP) or a given
            optimizer the method cannot train with; at the first training step, a model
            the Trainer did not wrap in DDP or an optimizer it created that the method
            cannot train with.

    Example:
        >>> GraceTrainer(model=model, args=TrainingArguments("out", use_cpu=True),
        ...              train_dataset=data, grace={"name": "topk", "ratio": 0.01}).train()
    """

    def __init__(self, *args: Any, grace: Spec | Grace = "none", weight_decay: float = 0.0,
                 asynchronous: bool = True, hierarchy: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grace = pipeline(grace, None, None, hierarchy=hierarchy)
        # what is known now is refused now, before `train` starts the framework's machinery
        if self.optimizer is not None:  # given; else the Trainer creates it in `train`
            check_optimizer(self.grace, self.optimizer)
        if self.args.parallel_mode != ParallelMode.DISTRIBUTED:
            raise ConfigError("the Hugging Face Trainer will not wrap the model in "
                              "DistributedDataParallel (TrainingArguments.parallel_mode is "
                              f"{self.args.parallel_mode.value}), so the gradients would never "
                              f"reach the gracecomm hook and train uncompressed: "
                              f"{SEVERAL_PROCESSES}")
        self.grace_weight_decay = weight_decay
        self.grace_asynchronous = asynchronous
        self.exchange: GradientExchange | None = None
        self._grace_model: Any = None  # the wrapped model the hook is registered on
        self._grace_window = MetricsWindow()
        self._grace_resume: str | None = None
        self.add_callback(_SaveCompressionState(self))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """The Trainer's ``train``; a checkpoint to resume from also restores every rank's
        compression state."""
        if resume_from_checkpoint is True:
            self._grace_resume = get_last_checkpoint(self.args.output_dir)
        elif resume_from_checkpoint:
            self._grace_resume = str(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's step; the first one on a newly wrapped model registers the hook."""
        if self._grace_model is not model:  # a later ``train`` may wrap the model anew
            self.exchange = attach(
                model, self.grace, [self.optimizer] if self.optimizer is not None else [],
                framework="the Hugging Face Trainer", fix=SEVERAL_PROCESSES,
                weight_decay=self.grace_weight_decay, asynchronous=self.grace_asynchronous,
                scaler=self.accelerator.scaler)
            self._grace_model = model
            if self._grace_resume is not None:
                load_state_file(self.grace, self._grace_resume, self.args.device)
                self._grace_resume = None
        loss = super().training_step(model, inputs, *args, **kwargs)
        stats = self.grace.metrics.pop()
        if stats.get("dense_bytes"):  # an accumulation step without exchange has none
            self._grace_window.add(stats)
        return loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """A training record gains the library's means per step since the last one."""
        if "loss" in logs:
            logs = {**logs, **self._grace_window.means()}
        super().log(logs, *args, **kwargs)


class _SaveCompressionState(TrainerCallback):
    """Every rank's compression state into each checkpoint folder the Trainer writes."""

    def __init__(self, trainer: GraceTrainer) -> None:
        self.grace = trainer.grace

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        save_state_file(self.grace, folder)
