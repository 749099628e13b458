"""PyTorch's own DDP communication for the compressors it has, as baselines
(``trainer.exchange=torch``): the same model, data, seed and training loop as this library's
hook, with PyTorch doing the exchange.

| ``compressor=`` | PyTorch |
|---|---|
| ``none`` | no hook: DDP's own bucketed allreduce |
| ``fp16``, ``bf16`` | ``fp16_compress_hook``, ``bf16_compress_hook`` |
| ``powersgd`` | ``powerSGD_hook`` with the compressor's options (below) |

PowerSGD's hook takes the compressor's rank, warm start, seed, dense warm-up
(``start_iter``), ``min_compression_rate`` and error feedback (residual memory).

Bytes are counted as this library counts its own: the tensors PyTorch hands to
``dist.all_reduce`` (`AllreduceCounter`; its hooks run their later allreduces in future
callbacks, which the counter sees too), or, without a hook, the dense gradients in one
allreduce per DDP bucket.
"""

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from gracecomm import Grace
from gracecomm.ddp import TailTimer
from gracecomm.metrics import Metrics
from gracecomm.network import bytes_key, calls_key
from gracecomm.validation import ConfigError

HOOKS = ("none", "fp16", "bf16", "powersgd")


def check_torch_exchange(grace: Grace) -> None:
    """Refuse a set-up PyTorch's hooks cannot run (naming what they can)."""
    name = grace.compressor.registry_name
    if name not in HOOKS:
        raise ConfigError(f"trainer: option 'exchange' is 'torch' but PyTorch has no DDP hook "
                          f"for compressor '{name}'; with exchange=torch use compressor="
                          f"{', '.join(HOOKS)}, or exchange=hook for this library's")
    if grace.communicator.registry_name != "allreduce":
        raise ConfigError("trainer: option 'exchange' is 'torch': PyTorch's hooks allreduce, "
                          f"not communicator '{grace.communicator.registry_name}'")
    memory = grace.memory.registry_name
    if name == "powersgd" and memory == "residual":
        if grace.memory.reference != "mean":
            raise ConfigError("trainer: option 'exchange' is 'torch': PyTorch's powerSGD_hook "
                              "feeds back against the mean over ranks; set "
                              "memory=residual memory.reference=mean (or memory=none) to compare "
                              "like with like")
    elif memory != "none":
        raise ConfigError(f"trainer: option 'exchange' is 'torch': PyTorch's hook for "
                          f"'{name}' has no memory '{memory}'; use memory=none"
                          + (" or residual with reference=mean" if name == "powersgd" else ""))


def register_torch_hook(ddp: DistributedDataParallel, grace: Grace) -> None:
    """Register PyTorch's hook for `grace`'s compressor (nothing for ``none``), timed as
    this library's hook is (``comm_s``: `gracecomm.ddp.TailTimer`)."""
    check_torch_exchange(grace)
    comp = grace.compressor
    name = comp.registry_name
    state: Any = None
    if name in ("fp16", "bf16"):
        hook = (default_hooks.fp16_compress_hook if name == "fp16"
                else default_hooks.bf16_compress_hook)
    elif name == "powersgd":
        hook = torch_powersgd.powerSGD_hook
        state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=comp.rank,
            start_powerSGD_iter=comp.start_iter, min_compression_rate=comp.min_compression_rate,
            use_error_feedback=grace.memory.registry_name == "residual",
            warm_start=comp.warm_start, random_seed=comp.seed,
            batch_tensors_with_same_shape=comp.batch_same_shape)
    else:
        return
    tail = TailTimer(grace.metrics)

    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        if not bucket.is_last():
            return future

        def communicated(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            tail.mark("communicated", time.perf_counter())
            return done.value()

        result = future.then(communicated)
        tail.mark("returned", time.perf_counter())
        return result

    ddp.register_comm_hook(state, timed)


class AllreduceCounter:
    """While entered, counts what PyTorch exchanges for one step into `metrics` under this
    library's keys (``wire_bytes``, ``sent_bytes``, ``coll_allreduce_calls/bytes``,
    ``dense_bytes``, ``exchanges``)."""

    def __init__(self, ddp: DistributedDataParallel, metrics: Metrics, hooked: bool) -> None:
        self.ddp = ddp
        self.metrics = metrics
        self.hooked = hooked
        self.original = dist.all_reduce

    def dense_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.ddp.module.parameters()
                   if p.requires_grad)

    def buckets(self) -> int:
        sizes = str(self.ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        return max(1, len([s for s in sizes.split(",") if s.strip()]))

    def record(self, nbytes: int, calls: int) -> None:
        for key, value in (("wire_bytes", nbytes), ("sent_bytes", nbytes),
                           (bytes_key("allreduce"), nbytes), (calls_key("allreduce"), calls)):
            self.metrics.add(key, value)

    def __enter__(self) -> "AllreduceCounter":
        if self.hooked:
            def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.record(tensor.numel() * tensor.element_size(), 1)
                return self.original(tensor, *args, **kwargs)

            dist.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self.original
        dense = self.dense_bytes()
        buckets = self.buckets()
        self.metrics.add("dense_bytes", dense)
        self.metrics.add("exchanges", buckets)
        if not self.hooked:
            self.record(dense, buckets)

