"""Hugging Face Accelerate: the library's hook on the model `Accelerator.prepare` wrapped.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    exchange = gracecomm.accelerate.register_comm_hook(accelerator, model, grace, optimizer)

Accelerate wraps the model in DDP only when it runs several processes; the hook is then
registered on it (the optimizer checked, the accelerator's GradScaler of ``fp16`` mixed
precision handed over), and ``accelerator.save_state``/``load_state`` carry every rank's
compression state in ``gracecomm.pt`` beside Accelerate's own files.
"""

from __future__ import annotations

from typing import Any

import torch

from gracecomm.ddp import GradientExchange
from gracecomm.frameworks import attach, load_state_file, save_state_file
from gracecomm.pipeline import Grace

SEVERAL_PROCESSES = (
    "start several processes, e.g. `accelerate launch --multi_gpu --num_processes 2 "
    "train.py` (on CPUs too, with Accelerator(cpu=True); `accelerate launch --cpu "
    "--num_processes 2` starts one process) or `torchrun --nproc_per_node 2 train.py`, "
    "and register the hook after accelerator.prepare(model)")


def register_comm_hook(accelerator: Any, model: Any, grace: Grace,
                       optimizer: torch.optim.Optimizer | None = None, *,
                       weight_decay: float = 0.0, asynchronous: bool = True,
                       hierarchy: str | None = None) -> GradientExchange:
    """Register the hook on the model `accelerator` prepared.

    Args:
        accelerator: the `accelerate.Accelerator`.
        model: the model ``accelerator.prepare`` returned (DistributedDataParallel).
        grace: the pipeline (`gracecomm.build`).
        optimizer: the prepared optimizer, checked where a part applies the momentum itself.
        weight_decay: added to the gradients before compression.
        asynchronous: overlap each bucket's exchange with the rest of backward.
        hierarchy: ``"node"``: reduce dense inside each node and compress only what crosses
            nodes (`gracecomm.hierarchy`); ``"flat"``; None keeps the pipeline's.

    Returns:
        The hook's state; ``grace.metrics.pop()`` after each step gives its figures
        (``accelerator.log(gracecomm.frameworks.logged_metrics(...))``).

    Raises:
        ConfigError: the model is not DDP (Accelerate runs one process), or the optimizer is
            refused.

    Example:
        >>> model, optimizer = accelerator.prepare(model, optimizer)
        >>> register_comm_hook(accelerator, model, build("topk"), optimizer)
    """
    optimizers = [] if optimizer is None else [getattr(optimizer, "optimizer", optimizer)]
    exchange = attach(model, grace, optimizers, framework="Accelerate",
                      fix=SEVERAL_PROCESSES, weight_decay=weight_decay,
                      asynchronous=asynchronous, scaler=accelerator.scaler,
                      hierarchy=hierarchy)
    device = accelerator.device

    def save(models: Any, weights: Any, output_dir: str) -> None:
        save_state_file(grace, output_dir)

    def load(models: Any, input_dir: str) -> None:
        load_state_file(grace, input_dir, device)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return exchange
