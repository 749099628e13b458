"""This library's PowerSGD next to PyTorch's own DDP hook
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``) and uncompressed training,
on the same model, data, seed and training loop (the default experiment unless overridden):

    python -m gracecomm.experiments.powersgd_vs_torch                      # rank 2, 2 workers
    python -m gracecomm.experiments.powersgd_vs_torch --rank 4 trainer.epochs=3 model=mlp

Bytes per step are payload bytes per rank: for gracecomm what its communicators count, for
the PyTorch hook the tensors it hands to ``dist.all_reduce`` (counted by wrapping that
function in the worker). Both send r (n + m) floats per compressed matrix and the other
tensors uncompressed; PyTorch's hook runs plain allreduce for its first
``start_powerSGD_iter`` = 2 steps (it requires > 1 with error feedback), so its bytes are
reported over all steps and over the compressed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from grace import build, register_comm_hook
from grace.config import instantiate
from grace.launch import spawn
from gracecomm.experiments.tasks import make_task
from gracecomm.experiments.train import evaluate, make_optimizer

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
TORCH_START_ITER = 2
MODES = ("none", "powersgd", "torch")


def compose_config(overrides: list[str]) -> DictConfig:
    """The training config (`configs/train.yaml`) with command-line style overrides."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


class AllreduceBytes:
    """Counts the bytes of every tensor given to ``dist.all_reduce`` while installed."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.original = dist.all_reduce

    def __enter__(self) -> AllreduceBytes:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.nbytes += tensor.numel() * tensor.element_size()
            return self.original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self.original


def worker(rank: int, world_size: int, cfg_dict: dict[str, Any], mode: str, r: int,
           out: str) -> None:
    """Train with `mode` and (rank 0) write steps, bytes per step and test metrics to `out`."""
    cfg = OmegaConf.create(cfg_dict)
    torch.manual_seed(cfg.seed)
    data = instantiate(cfg.data)
    task = make_task(data.task, data.task_options)
    model = instantiate(cfg.model)
    ddp = DistributedDataParallel(model)
    grace = None
    if mode == "torch":
        state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=TORCH_START_ITER,
            min_compression_rate=1, use_error_feedback=True, warm_start=True,
            random_seed=cfg.seed)
        ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    else:
        spec = {"name": "powersgd", "rank": r, "seed": cfg.seed} if mode == "powersgd" else "none"
        grace = build(spec)
        register_comm_hook(ddp, grace)
    t = cfg.trainer
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=cfg.seed)
    loader = DataLoader(data.train, batch_size=t.batch_size, sampler=sampler)
    optimizer = make_optimizer(cfg, model)
    total = t.epochs * len(loader) if t.max_steps is None else int(t.max_steps)
    step_bytes: list[float] = []
    for epoch in range(t.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if len(step_bytes) >= total:
                break
            optimizer.zero_grad(set_to_none=True)
            with AllreduceBytes() as counter:
                task.loss(ddp(x), y).backward()
            optimizer.step()
            step_bytes.append(counter.nbytes if grace is None
                              else grace.metrics.pop().get("wire_bytes", 0.0))
    metrics = evaluate(model, data.test, task, rank, world_size, torch.device("cpu"),
                       t.batch_size)
    if rank == 0:
        later = step_bytes[TORCH_START_ITER:] or step_bytes
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"mode": mode, "steps": len(step_bytes), **metrics,
                       "bytes_per_step": sum(step_bytes) / max(1, len(step_bytes)),
                       "bytes_per_compressed_step": sum(later) / len(later)}, f)


def compare(overrides: list[str], r: int = 2,
            modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    """Run `modes` with the training config plus `overrides`; one record per mode."""
    cfg = compose_config(overrides)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            out = os.path.join(tmp, f"{mode}.json")
            spawn(worker, int(cfg.trainer.world_size), cfg_dict, mode, r, out,
                  timeout_s=float(cfg.trainer.timeout_s))
            with open(out, encoding="utf-8") as f:
                results.append(json.load(f))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD rank r (default 2)")
    parser.add_argument("overrides", nargs="*",
                        help="training config overrides, e.g. trainer.epochs=3")
    args = parser.parse_args(argv)
    rows = compare(args.overrides, args.rank)
    metric = next(k for k in rows[0] if k.startswith("test_") and k != "test_loss")
    print(f"{'mode':<10} {'steps':>6} {metric:>10} {'bytes/step':>12} "
          f"{'bytes/compressed step':>22}")
    for row in rows:
        label = {"none": "none", "powersgd": "gracecomm", "torch": "torch hook"}[row["mode"]]
        print(f"{label:<10} {row['steps']:>6} {row[metric]:>10.4f} {row['bytes_per_step']:>12.0f} "
              f"{row['bytes_per_compressed_step']:>22.0f}")


if __name__ == "__main__":
    main()
