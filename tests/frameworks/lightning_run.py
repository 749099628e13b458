"""Lightning scenarios for tests/test_integrations.py, run on 2 CPU processes (``topk_node``:
on 2 nodes of 2, one torchrun agent per node):

    torchrun --nproc_per_node=2 tests/frameworks/lightning_run.py OUT NAME...

Each scenario fits a small LightningModule (a client script as a user writes it) and every
rank writes ``OUT/NAME.rank<r>.pt``: the final parameters, the training losses, the error
the fit raised (if any), the compression state and the payload bytes it sent at each step.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from scenarios import main  # tests/frameworks/, the script's folder
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

import gracecomm
from gracecomm.lightning import CHECKPOINT_KEY, GraceStrategy

STEPS_PER_EPOCH = 16  # 512 examples, 2 ranks, batches of 16


class Classifier(pl.LightningModule):
    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.momentum = momentum
        self.losses: list[float] = []
        self.wire: list[float] = []  # this rank's logged payload bytes, step by step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        wire = self.trainer.callback_metrics.get("gracecomm/wire_bytes")
        if wire is not None:
            self.wire.append(float(wire))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(512, 16, generator=gen)
        y = (x[:, :4] * torch.tensor([3.0, -2.0, 1.0, 0.5])).argmax(1)
        return DataLoader(TensorDataset(x, y), batch_size=16)


class TorchFP16Strategy(DDPStrategy):
    """PyTorch's fp16_compress_hook on CPU, registered at the same override point as
    GraceStrategy's (Lightning registers comm hooks only on CUDA)."""

    def setup(self, trainer):
        super().setup(trainer)
        self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)


def fit(out: Path, name: str, strategy, module: Classifier | None = None, epochs: int = 2,
        ckpt_path: str | None = None, **trainer_options) -> Classifier:
    pl.seed_everything(0, verbose=False)
    module = module or Classifier()
    initial = nn.utils.parameters_to_vector(module.parameters()).detach().clone()
    error = None
    options = {"logger": False, **trainer_options}
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, **options)
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    except gracecomm.ConfigError as err:
        error = f"{type(err).__name__}: {err}"
    grace = getattr(strategy, "grace", None)
    torch.save({"params": nn.utils.parameters_to_vector(module.parameters()).detach(),
                "initial": initial,
                "losses": module.losses, "error": error, "wire": module.wire,
                "state": grace.state_dict() if grace is not None else None,
                "check_finite": grace.check_finite if grace is not None else None},
               out / f"{name}.rank{trainer.global_rank}.pt")
    module.trainer_ = trainer
    return module


def topk(**options) -> GraceStrategy:
    return GraceStrategy({"name": "topk", "ratio": 0.1}, process_group_backend="gloo",
                         **options)


def run(out: Path, name: str) -> None:
    if name == "topk":  # the target, with Lightning's CSV logger
        fit(out, name, topk(), logger=pl.loggers.CSVLogger(out, name="csv", version=0),
            log_every_n_steps=1)
    elif name == "topk_node":  # two levels on 2 nodes of 2 ranks: as many steps in 4 epochs
        fit(out, name, topk(hierarchy="node"), epochs=4, num_nodes=2)
    elif name == "plain":
        fit(out, name, DDPStrategy(process_group_backend="gloo"))
    elif name == "fp16":
        fit(out, name, GraceStrategy("fp16", process_group_backend="gloo"))
    elif name == "torch_fp16":
        fit(out, name, TorchFP16Strategy(process_group_backend="gloo"))
    elif name == "resume":  # one epoch, a checkpoint, then the second epoch from it
        first = fit(out, "half", topk(), epochs=1)
        first.trainer_.save_checkpoint(out / "half.ckpt")
        fit(out, name, topk(), ckpt_path=str(out / "half.ckpt"))
        if first.trainer_.global_rank == 0:  # the same checkpoint without compression state
            saved = torch.load(out / "half.ckpt", weights_only=False)
            del saved[CHECKPOINT_KEY]
            torch.save(saved, out / "half_plain.ckpt")
        first.trainer_.strategy.barrier()
        fit(out, "resume_without_state", topk(), ckpt_path=str(out / "half_plain.ckpt"))
    elif name == "dgc_momentum":  # DGC's memory applies the momentum: refused at set-up
        fit(out, name, GraceStrategy({"name": "dgc", "ratio": 0.1}, process_group_backend="gloo"))
    elif name == "dgc":  # ... and trains with an optimizer without momentum
        fit(out, name, GraceStrategy({"name": "dgc", "ratio": 0.1}, process_group_backend="gloo"),
            module=Classifier(momentum=0.0))
    elif name == "skipped":  # Lightning's own comm-hook options skip the hook on CPU
        module = Classifier()
        state, hook = gracecomm.comm_hook(gracecomm.build("topk"), module)
        fit(out, name, DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook,
                                   process_group_backend="gloo"), module=module)
    elif name == "amp":  # fp16 autocast with a GradScaler that overflows at first
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
        fit(out, name, topk(), plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
            logger=pl.loggers.CSVLogger(out, name="csv_amp", version=0), log_every_n_steps=1)
    else:
        raise SystemExit(f"unknown scenario {name}")


if __name__ == "__main__":
    main(run)
