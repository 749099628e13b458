"""Accelerate scenarios for tests/test_integrations.py, on 2 CPU processes (``topk_node``: on
2 nodes of 2, one torchrun agent per node):

    torchrun --nproc_per_node=2 tests/frameworks/accelerate_run.py OUT NAME...

A training loop as Accelerate's users write it (``Accelerator(cpu=True)``, ``prepare``,
``accelerator.backward``); every rank writes ``OUT/NAME.rank<r>.pt`` with the final
parameters, the losses, the error raised (if any), the logged figures and the compression
state.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from scenarios import main  # tests/frameworks/, the script's folder
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

import gracecomm
import gracecomm.accelerate
from gracecomm.frameworks import logged_metrics


def data() -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=gen)
    y = (x[:, :4] * torch.tensor([3.0, -2.0, 1.0, 0.5])).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def train(out: Path, name: str, hook: str, epochs: tuple[int, int] = (0, 2),
          save_after: int | None = None, load: Path | None = None,
          hierarchy: str | None = None) -> None:
    """Epochs ``range(*epochs)`` of SGD; `hook` is a gracecomm compressor, ``torch_fp16``
    (PyTorch's hook) or ``none`` (plain DDP); `hierarchy` as `register_comm_hook` takes it."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    initial = nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, data())
    grace, error, logged, losses = None, None, [], []
    try:
        if hook == "torch_fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook != "none":
            spec = {"name": "topk", "ratio": 0.1} if hook == "topk" else hook
            grace = gracecomm.build(spec)
            gracecomm.accelerate.register_comm_hook(accelerator, model, grace, optimizer,
                                                    hierarchy=hierarchy)
        if load is not None:
            accelerator.load_state(str(load))
        for epoch in range(*epochs):
            for x, y in loader:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                losses.append(float(loss))
                if grace is not None:
                    logged.append(logged_metrics(grace.metrics.pop()))
            if save_after is not None and epoch + 1 == save_after:
                accelerator.save_state(str(out / f"{name}_state"))
    except gracecomm.ConfigError as err:
        error = f"{type(err).__name__}: {err}"
    torch.save({"params": nn.utils.parameters_to_vector(model.parameters()).detach(),
                "initial": initial, "losses": losses, "error": error, "logged": logged,
                "wire": [step["gracecomm/wire_bytes"] for step in logged],
                "state": grace.state_dict() if grace is not None else None},
               out / f"{name}.rank{accelerator.process_index}.pt")


def run(out: Path, name: str) -> None:
    if name in ("topk", "none", "fp16", "torch_fp16"):
        train(out, name, name)
    elif name == "topk_node":  # two levels on 2 nodes of 2 ranks: as many steps in 4 epochs
        train(out, name, "topk", epochs=(0, 4), hierarchy="node")
    elif name == "resume":  # one epoch and save_state, then the second from load_state
        train(out, "half", "topk", epochs=(0, 1), save_after=1)
        train(out, name, "topk", epochs=(1, 2), load=out / "half_state")
        if torch.distributed.get_rank() == 0:  # the same state without the compression's
            shutil.copytree(out / "half_state", out / "plain_state",
                            ignore=shutil.ignore_patterns("gracecomm.pt"))
        torch.distributed.barrier()
        train(out, "resume_without_state", "topk", epochs=(1, 2), load=out / "plain_state")
    elif name == "one_process":  # run without a launcher: Accelerate wraps nothing
        train(out, name, "topk")
    else:
        raise SystemExit(f"unknown scenario {name}")


if __name__ == "__main__":
    main(run)
