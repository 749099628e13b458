"""Data-parallel training with compressed gradient exchange (Hydra entry point).

    python -m experiments.train                                   # 2 Gloo workers, digits, no compression
    python -m experiments.train compressor=topk compressor.ratio=0.01
    python -m experiments.train -m compressor=none,topk,randomk  # a sweep
    torchrun --nproc_per_node=2 -m experiments.train             # join torchrun's group

Without launcher variables the command spawns `trainer.world_size` local workers on
127.0.0.1; under torchrun it joins the launcher's process group instead. Rank 0 writes
``metrics.jsonl`` and ``summary.json`` into the Hydra run directory and prints a summary.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

from grace import Grace, register_comm_hook
from grace.config import instantiate
from grace.launch import finish_process_group, init_process_group, launched_externally, spawn
from grace.validation import ConfigError, check_choice, check_range

SUMMED_KEYS = ("dense_bytes", "wire_bytes", "sent_bytes", "compress_s", "decompress_s",
               "memory_s", "comm_s", "step_s")


def build_grace(cfg: DictConfig) -> Grace:
    """Instantiate the compressor, memory and communicator of `cfg` into a pipeline."""
    allow = bool(cfg.get("allow_any_target", False))
    return Grace(instantiate(cfg.compressor, allow_any_target=allow),
                 instantiate(cfg.memory, allow_any_target=allow),
                 instantiate(cfg.communicator, allow_any_target=allow),
                 check_finite=bool(cfg.get("check_finite", True)))


def validate(cfg: DictConfig) -> None:
    """Fail before any worker starts: option ranges, names and pairings."""
    t = cfg.trainer
    check_range(t.world_size, "trainer", "world_size", 1, integer=True)
    check_range(t.epochs, "trainer", "epochs", 1, integer=True)
    check_range(t.batch_size, "trainer", "batch_size", 1, integer=True)
    check_range(t.lr, "trainer", "lr", 0.0, low_open=True)
    check_range(t.momentum, "trainer", "momentum", 0.0, 1.0, high_open=True)
    check_range(t.weight_decay, "trainer", "weight_decay", 0.0)
    check_range(t.timeout_s, "trainer", "timeout_s", 0.0, low_open=True)
    if t.max_steps is not None:
        check_range(t.max_steps, "trainer", "max_steps", 1, integer=True)
    check_choice(t.backend, ("auto", "gloo", "nccl"), "trainer", "backend")
    check_choice(t.device, ("auto", "cpu", "cuda"), "trainer", "device")
    exchange_mode(cfg, build_grace(cfg))
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer: option 'device' is 'cuda' but no CUDA device is available; "
                          "use trainer.device=cpu or auto")
    instantiate(cfg.model, allow_any_target=bool(cfg.get("allow_any_target", False)))


def exchange_mode(cfg: DictConfig, grace: Grace) -> str:
    """``hook``: a DDP comm hook exchanges each gradient bucket during backward; ``step``:
    all gradients are exchanged in one `step_many` after backward (needed by model-level
    methods such as LGC, and the pattern for custom loops)."""
    mode = check_choice(cfg.trainer.get("exchange", "auto"), ("auto", "hook", "step"),
                        "trainer", "exchange")
    if mode == "auto":
        return "step" if grace.compressor.model_level else "hook"
    if mode == "hook" and grace.compressor.model_level:
        raise ConfigError(f"trainer: option 'exchange' is 'hook' but {grace.compressor.label} "
                          "needs all gradients at once; use trainer.exchange=step or auto")
    return mode


def broadcast_state(model: nn.Module, parameters: bool = True) -> None:
    """Copy rank 0's parameters (and buffers) to every rank, as DDP does at construction."""
    if not dist.is_initialized():
        return
    tensors = list(model.buffers()) + (list(model.parameters()) if parameters else [])
    for tensor in tensors:
        dist.broadcast(tensor.data, src=0)


def exchange_gradients(model: nn.Module, grace: Grace) -> None:
    """Replace every gradient by the mean over ranks, through `grace` in one call."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in params]
    for (_, p), mean in zip(params, grace.step_many(grads)):
        p.grad = mean


def _device(cfg: DictConfig, rank: int) -> torch.device:
    use_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto"
                                                 and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _backend(cfg: DictConfig) -> str:
    if cfg.trainer.backend != "auto":
        return str(cfg.trainer.backend)
    use_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto"
                                                 and torch.cuda.is_available())
    return "nccl" if use_cuda else "gloo"


def evaluate(model: nn.Module, dataset: Any, rank: int, world_size: int,
             device: torch.device, batch_size: int) -> dict[str, float]:
    """Loss and accuracy over the whole test set (each rank takes every world_size-th
    example; counts are summed over ranks)."""
    shard = Subset(dataset, range(rank, len(dataset), world_size))
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=max(batch_size, 256)):
            x, y = x.to(device), y.to(device)
            logits = model(x)
            totals[0] += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            totals[1] += (logits.argmax(1) == y).sum().item()
            totals[2] += len(y)
    model.train()
    if dist.is_initialized():
        dist.all_reduce(totals)
    return {"test_loss": float(totals[0] / totals[2]), "test_acc": float(totals[1] / totals[2])}


def train_worker(rank: int, world_size: int, cfg_dict: dict[str, Any], run_dir: str,
                 group: str | None) -> None:
    """One rank's training loop (also the body of a torchrun process)."""
    cfg = OmegaConf.create(cfg_dict)
    allow = bool(cfg.get("allow_any_target", False))
    device = _device(cfg, rank)
    torch.manual_seed(cfg.seed)
    data = instantiate(cfg.data, allow_any_target=allow)
    model = instantiate(cfg.model, allow_any_target=allow).to(device)
    grace = build_grace(cfg)
    t = cfg.trainer
    per_bucket = exchange_mode(cfg, grace) == "hook"
    if per_bucket:
        net: nn.Module = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        register_comm_hook(net, grace)
    else:
        net = model
        broadcast_state(model)
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=cfg.seed)
    loader = DataLoader(data.train, batch_size=t.batch_size, sampler=sampler, drop_last=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum,
                                weight_decay=t.weight_decay)
    total_steps = t.epochs * len(loader)
    if t.max_steps is not None:
        total_steps = min(total_steps, int(t.max_steps))
    logger = None
    if rank == 0:
        logger = instantiate(cfg.logger, run_dir=run_dir, group=group,
                             run_config=OmegaConf.to_container(cfg, resolve=True),
                             allow_any_target=allow, _recursive_=False, _convert_="all")
    progress = None
    if rank == 0 and t.progress:
        from tqdm import tqdm
        progress = tqdm(total=total_steps, desc=f"train [{grace.compressor.registry_name}]",
                        unit="step", dynamic_ncols=True)
    totals = dict.fromkeys(SUMMED_KEYS, 0.0)
    step, evals = 0, {}
    for epoch in range(t.epochs):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)
        grace.set_epoch(epoch)
        for x, y in loader:
            if step >= total_steps:
                break
            start = time.perf_counter()
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            if not per_bucket:
                exchange_gradients(model, grace)
            optimizer.step()
            loss_value = loss.item()
            stats = grace.metrics.pop()
            stats["step_s"] = time.perf_counter() - start
            for key in SUMMED_KEYS:
                totals[key] += stats.get(key, 0.0)
            step += 1
            if logger is not None:
                logger.log({"type": "step", "step": step, "epoch": epoch,
                            "loss": loss_value, **stats})
            if progress is not None:
                progress.set_postfix(loss=f"{loss_value:.3f}", ratio=f"{stats.get('ratio', 1):.1f}x")
                progress.update(1)
        if (epoch + 1) % t.eval_every == 0 or epoch == t.epochs - 1 or step >= total_steps:
            if not per_bucket:
                broadcast_state(model, parameters=False)
            evals = evaluate(model, data.test, rank, world_size, device, t.batch_size)
            if logger is not None:
                logger.log({"type": "eval", "step": step, "epoch": epoch, **evals})
    if progress is not None:
        progress.close()
    summary = _summary(totals, step, world_size, device)
    summary.update(evals, steps=step, world_size=world_size,
                   compressor=grace.compressor.registry_name, memory=grace.memory.registry_name,
                   communicator=grace.communicator.registry_name)
    if logger is not None:
        logger.finish(summary)
        print(format_summary(summary, run_dir), flush=True)


def _summary(totals: dict[str, float], steps: int, world_size: int,
             device: torch.device) -> dict[str, float]:
    """Per-rank, per-step means over all ranks of the summed statistics."""
    vec = torch.tensor([totals[k] for k in SUMMED_KEYS], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(vec)
    per_step = {f"{k}_per_step": float(v) / world_size / max(1, steps)
                for k, v in zip(SUMMED_KEYS, vec.tolist())}
    wire = per_step["wire_bytes_per_step"]
    per_step["ratio"] = per_step["dense_bytes_per_step"] / wire if wire else math.inf
    per_step["overhead_s_per_step"] = (per_step["compress_s_per_step"]
                                       + per_step["decompress_s_per_step"]
                                       + per_step["memory_s_per_step"])
    return per_step


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GB"


def format_summary(s: dict[str, Any], run_dir: str) -> str:
    lines = [
        f"== {s['compressor']} + {s['memory']} memory over {s['communicator']}, "
        f"{s['world_size']} ranks, {s['steps']} steps",
        f"   test accuracy          {s.get('test_acc', float('nan')):.4f}",
        f"   wire bytes / step      {_bytes(s['wire_bytes_per_step'])} per rank "
        f"(dense {_bytes(s['dense_bytes_per_step'])}, ratio {s['ratio']:.1f}x)",
        f"   compression / step     {1e3 * s['overhead_s_per_step']:.2f} ms "
        f"(compress {1e3 * s['compress_s_per_step']:.2f}, decompress "
        f"{1e3 * s['decompress_s_per_step']:.2f}, memory {1e3 * s['memory_s_per_step']:.2f})",
        f"   communication / step   {1e3 * s['comm_s_per_step']:.2f} ms",
        f"   metrics                {os.path.join(run_dir, 'metrics.jsonl')}",
    ]
    return "\n".join(lines)


def _sweep_group() -> str | None:
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        return os.path.basename(os.path.normpath(hc.sweep.dir))
    return None


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> float:
    validate(cfg)
    run_dir = HydraConfig.get().runtime.output_dir
    group = _sweep_group()
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if launched_externally():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_process_group(_backend(cfg), rank, world_size, timeout_s=cfg.trainer.collective_timeout_s)
        try:
            train_worker(rank, world_size, cfg_dict, run_dir, group)
        finally:
            finish_process_group()
    else:
        spawn(train_worker, int(cfg.trainer.world_size), cfg_dict, run_dir, group,
              backend=_backend(cfg), timeout_s=float(cfg.trainer.timeout_s),
              collective_timeout_s=float(cfg.trainer.collective_timeout_s))
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary_path):
        import json

        with open(summary_path, encoding="utf-8") as f:
            return float(json.load(f).get("test_acc", float("nan")))
    return float("nan")


if __name__ == "__main__":
    main()
