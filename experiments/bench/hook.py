"""Suite ``hook``: the DDP hook's own CPU cost per step, next to plain DDP and PyTorch's hooks.

    gracecomm-bench suite=hook
    gracecomm-bench suite=hook '+hook.methods=[ddp,dense,fp16,torch_fp16]' +hook.steps=100
    gracecomm-bench suite=hook '+hook.methods=[ddp,topk,dgc]' \
        '+hook.overrides=[model=resnet20,data=prototypes,trainer.bucket_cap_mb=0.25]'

Two Gloo ranks on this machine, one thread each, train the same model on the same batch with
each method in turn: every method's DDP model and pipeline exist side by side, and a round
runs ``steps`` forward/backward steps of each method one after the other (no optimizer step,
so every step does the same work). A step's cost is the CPU time of the rank's process
(`time.process_time`: the training thread, the exchange worker and Gloo's threads) from the
forward pass until backward has returned, which is when DDP has received every bucket's
averaged gradients. ``cpu_ms`` is the median step of a round, averaged over the ranks, best
of ``rounds``; ``over_ddp_ms`` subtracts plain DDP's (the method ``ddp``, no hook) from the
same run; where the run has PyTorch's hook on the same settings (the preset that builds on
the method's and only sets ``trainer.exchange=torch``: ``torch_fp16`` for ``fp16``,
``torch_powersgd`` for ``powersgd_parity``; `gracecomm.experiments.presets.torch_twin`),
``over_torch_ms`` subtracts its ``cpu_ms`` and ``x_torch`` divides the added cost by the one
it adds.

PyTorch's ``powerSGD_hook`` launches its later allreduces from future callbacks, on the
process group the training thread also uses; with Gloo and more than one bucket the ranks
can then issue them in different orders, which aborts the process ("Received data size
doesn't match expected size"). It happened here in some runs of ``torch_powersgd``
(ResNet-20 has two buckets: DDP caps the first at 1 MiB); run again when it does.

Methods are method presets (configs/method/, `gracecomm.experiments.presets`), trained with
``overrides`` (default: those of ``gracecomm-netbench``, ResNet-20 on the prototypes data)
before them.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from gracecomm.config import instantiate
from gracecomm.ddp import register_comm_hook
from gracecomm.experiments import presets
from gracecomm.experiments.bench import Record, suite, suite_options
from gracecomm.experiments.training.config import (
    CONFIG_DIR,
    build_grace,
    compose_config,
    exchange_mode,
)
from gracecomm.experiments.training.launch import spawn
from gracecomm.experiments.training.torch_hooks import register_torch_hook
from gracecomm.experiments.workloads.tasks import make_task

DEFAULTS = {"methods": ["ddp", "dense", "fp16", "torch_fp16", "topk", "powersgd",
                        "powersgd_parity", "torch_powersgd"],
            "steps": 40, "rounds": 5, "warmup_steps": 5, "world_size": 2, "timeout_s": 900,
            "overrides": None}
BASELINE = "ddp"


def plan(methods: list[str], base: list[str] | None) -> list[tuple[str, list[str]]]:
    """(method, gracecomm-train overrides) for each method preset, after `base` (None: the
    ``overrides`` of configs/netbench.yaml)."""
    presets.check(methods, "bench: suite 'hook'", "hook.methods")
    if base is None:
        base = [str(o) for o in OmegaConf.load(CONFIG_DIR / "netbench.yaml").overrides]
    return [(m, [*base, *presets.overrides(m)]) for m in methods]


def _worker(rank: int, world_size: int, runs: list[tuple[str, list[str]]],
            options: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    models, batch = [], None
    for method, overrides in runs:
        cfg = compose_config(*overrides, "trainer.progress=false")
        torch.manual_seed(int(cfg.seed))
        if batch is None:
            data = instantiate(cfg.data)
            task = make_task(data.task, data.task_options)
            examples = [data.train[i] for i in range(int(cfg.trainer.batch_size))]
            batch = tuple(torch.stack([torch.as_tensor(e[j]) for e in examples])
                          for j in range(2))
        net = DistributedDataParallel(instantiate(cfg.model),
                                      bucket_cap_mb=float(cfg.trainer.bucket_cap_mb))
        grace = build_grace(cfg)
        mode = exchange_mode(cfg)
        if mode == "torch":
            register_torch_hook(net, grace)
        else:
            register_comm_hook(net, grace, asynchronous=mode == "hook")
        models.append((method, net, grace))

    def step(net: DistributedDataParallel) -> float:
        start = time.process_time()
        net.zero_grad(set_to_none=True)
        task.loss(net(batch[0]), batch[1]).backward()
        return time.process_time() - start

    for _, net, grace in models:
        for _ in range(int(options["warmup_steps"])):
            step(net)
        grace.metrics.pop()
    medians: dict[str, list[float]] = {m: [] for m, _, _ in models}
    for _ in range(int(options["rounds"])):
        for method, net, grace in models:
            medians[method].append(statistics.median(
                step(net) for _ in range(int(options["steps"]))))
            grace.metrics.pop()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


@suite("hook")
def run(cfg: DictConfig) -> list[Record]:
    options = suite_options(cfg, "hook", DEFAULTS)
    base = options["overrides"]
    runs = plan([str(m) for m in options["methods"]],
                None if base is None else [str(o) for o in base])
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "medians.json")
        spawn(_worker, int(options["world_size"]), runs, options, out,
              timeout_s=float(options["timeout_s"]))
        per_rank = json.loads(Path(out).read_text())
    cpu = {m: min(statistics.mean(rank[m][i] for rank in per_rank)
                  for i in range(int(options["rounds"]))) for m, _ in runs}
    base = cpu.get(BASELINE)
    records = []
    for method, _ in runs:
        record: Record = {"method": method, "cpu_ms": 1e3 * cpu[method]}
        if base is not None:
            record["over_ddp_ms"] = 1e3 * (cpu[method] - base)
            torch_twin = presets.torch_twin(method)
            if torch_twin in cpu:
                record["over_torch_ms"] = 1e3 * (cpu[method] - cpu[torch_twin])
                if cpu[torch_twin] > base:
                    record["x_torch"] = (cpu[method] - base) / (cpu[torch_twin] - base)
        records.append(record)
    return records
