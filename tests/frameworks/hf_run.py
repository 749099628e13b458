"""Hugging Face Trainer scenarios for tests/test_integrations.py, on 2 CPU processes
(``topk_node``: on 2 nodes of 2, one torchrun agent per node):

    torchrun --nproc_per_node=2 tests/frameworks/hf_run.py OUT NAME...

A tiny model trained by ``Trainer`` (plain) or ``GraceTrainer``; every rank writes
``OUT/NAME.rank<r>.pt`` with the final parameters, the training losses the Trainer logged,
its log history, the error raised (if any), the payload bytes each logged window's steps
sent on average and the compression state.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from scenarios import main  # tests/frameworks/, the script's folder
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

import gracecomm
from gracecomm.hf import GraceTrainer


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Examples(Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(512, 16, generator=gen)
        self.y = (self.x[:, :4] * torch.tensor([3.0, -2.0, 1.0, 0.5])).argmax(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def train(out: Path, name: str, grace, epochs: int = 2, resume: str | None = None,
          momentum: float = 0.9, hierarchy: str | None = None) -> None:
    args = TrainingArguments(
        output_dir=str(out / f"{name}_out"), use_cpu=True, per_device_train_batch_size=16,
        num_train_epochs=epochs, learning_rate=0.1, lr_scheduler_type="constant",
        logging_steps=4, save_strategy="epoch", report_to="none", disable_tqdm=True,
        remove_unused_columns=False, seed=0)
    torch.manual_seed(0)
    model = Classifier()
    initial = nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    options = {"model": model, "args": args, "train_dataset": Examples(),
               "optimizers": (optimizer, None)}
    trainer, error, cannot_resume = None, None, None
    try:  # GraceTrainer refuses what it can when constructed
        trainer = (Trainer(**options) if grace is None
                   else GraceTrainer(**options, grace=grace, hierarchy=hierarchy))
        trainer.train(resume_from_checkpoint=resume)
    except gracecomm.ConfigError as err:
        error = f"{type(err).__name__}: {err}"
    except RuntimeError as err:  # the Trainer's own loading (transformers 4.x, torch < 2.?)
        if resume is None or "restore data location" not in str(err):
            raise
        cannot_resume = error = f"the Trainer cannot resume on CPU processes here: {err}"
    history = trainer.state.log_history if trainer is not None else []
    torch.save({"params": nn.utils.parameters_to_vector(model.parameters()).detach(),
                "initial": initial, "error": error, "history": history,
                "wire": [h["gracecomm/wire_bytes"] for h in history
                         if "gracecomm/wire_bytes" in h],
                "state": trainer.grace.state_dict() if isinstance(trainer, GraceTrainer)
                else None,
                "cannot_resume": cannot_resume},
               out / f"{name}.rank{args.process_index}.pt")


def run(out: Path, name: str) -> None:
    topk = {"name": "topk", "ratio": 0.1}
    if name == "topk":
        train(out, name, topk)
    elif name == "topk_node":  # two levels on 2 nodes of 2 ranks: as many steps in 4 epochs
        train(out, name, topk, epochs=4, hierarchy="node")
    elif name == "plain":
        train(out, name, None)
    elif name == "resume":  # the first epoch's checkpoint of "topk", then the second
        checkpoint = out / "topk_out" / "checkpoint-16"
        train(out, name, topk, resume=str(checkpoint))
        if dist.get_rank() == 0:  # the same checkpoint without the compression state
            shutil.copytree(checkpoint, out / "plain_checkpoint",
                            ignore=shutil.ignore_patterns("gracecomm.pt"))
        dist.barrier()
        train(out, "resume_without_state", topk, resume=str(out / "plain_checkpoint"))
    elif name == "dgc_momentum":  # DGC's memory applies the momentum: refused
        train(out, name, "dgc")
    elif name == "one_process":  # run without a launcher: the Trainer wraps nothing
        train(out, name, topk)
    else:
        raise SystemExit(f"unknown scenario {name}")


if __name__ == "__main__":
    main(run)
