"""Suite ``integrity``: what the always-on check of the peers' float fields costs an exchange.

    gracecomm-bench suite=integrity
    gracecomm-bench suite=integrity '+integrity.methods=[topk,qsgd:broadcast]' \
        +integrity.rounds=7

Every exchange checks that the floating-point tensors of every rank's payload (Top-k's
values, QSGD's norms, TernGrad's scales, fp16 values; for allreduce, the sum) are finite
(`gracecomm.communicator.check_finite_fields`). Two Gloo ranks on this machine, one thread
each, exchange the gradients of a ResNet-20 (its 65 parameters' shapes, random values, one
`Grace.step_many` per step: compress, exchange, decompress) with each method twice: as the
library runs it, and with `Communicator.check_fields` replaced by a no-op. The two
pipelines alternate step by step (which goes first alternates too), so a change of load
reaches both alike. A step's cost is the CPU time of the rank's process
(`time.process_time`: all its threads, Gloo's included); per round the median step of
each, best of ``rounds``, mean over the ranks: ``with_ms`` and ``without_ms``. The check
itself is also timed where it runs (`time.thread_time` around each call, summed per step):
``check_ms``, and ``ratio`` is ``with_ms / (with_ms - check_ms)``, the exchange with the
check over the same exchange without it. ``ab_ms`` (with - without) measures the same cost
across the two pipelines; on a loaded machine it is the noisier of the two (a rank's CPU
time includes Gloo's threads polling while the peer is descheduled). Methods are registry
names, ``name:communicator`` for another communicator.
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

from gracecomm import build
from gracecomm.config import instantiate
from gracecomm.experiments.bench import Record, suite, suite_options
from gracecomm.experiments.training.config import CONFIG_DIR
from gracecomm.experiments.training.launch import spawn

DEFAULTS = {"methods": ["none", "fp16", "topk", "topk:broadcast", "topk:parameter_server",
                        "qsgd", "terngrad"],
            "model": "resnet20", "steps": 20, "rounds": 5, "warmup_steps": 3,
            "timeout_s": 900}


def _skip(*args: Any, **kwargs: Any) -> None:
    """The check removed."""


class _Timed:
    """`Communicator.check_fields` with its thread CPU time added up in `seconds`."""

    def __init__(self, check: Any) -> None:
        self.check = check
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        start = time.thread_time()
        try:
            self.check(*args, **kwargs)
        finally:
            self.seconds += time.thread_time() - start


def _worker(rank: int, world_size: int, options: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    model = instantiate(OmegaConf.load(CONFIG_DIR / "model" / f"{options['model']}.yaml"))
    gen = torch.Generator().manual_seed(rank)
    grads = [(name, torch.randn(p.shape, generator=gen)) for name, p in model.named_parameters()]
    medians: dict[str, dict[str, list[float]]] = {}
    for method in options["methods"]:
        name, _, comm = str(method).partition(":")
        pipes = {"with": build(name, communicator=comm or None),
                 "without": build(name, communicator=comm or None)}
        pipes["without"].communicator.check_fields = _skip  # type: ignore[method-assign]
        timed = _Timed(pipes["with"].communicator.check_fields)
        pipes["with"].communicator.check_fields = timed  # type: ignore[method-assign]
        for pipe in pipes.values():
            for _ in range(int(options["warmup_steps"])):
                pipe.step_many(grads)
        times: dict[str, list[float]] = {"with": [], "without": [], "check": []}
        medians[method] = {key: [] for key in times}
        for _ in range(int(options["rounds"])):
            for key in times:
                times[key].clear()
            for step in range(int(options["steps"])):
                order = ("with", "without") if step % 2 == 0 else ("without", "with")
                for key in order:
                    before, start = timed.seconds, time.process_time()
                    pipes[key].step_many(grads)
                    times[key].append(time.process_time() - start)
                    if key == "with":
                        times["check"].append(timed.seconds - before)
            for key in times:
                medians[method][key].append(statistics.median(times[key]))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


@suite("integrity", columns=("method", "with_ms", "without_ms", "check_ms", "ratio", "ab_ms"))
def run(cfg: DictConfig) -> list[Record]:
    options = suite_options(cfg, "integrity", DEFAULTS)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "medians.json")
        spawn(_worker, 2, options, out, timeout_s=float(options["timeout_s"]))
        per_rank = json.loads(Path(out).read_text())
    records = []
    for method in options["methods"]:
        best = {key: min(statistics.mean(rank[method][key][i] for rank in per_rank)
                         for i in range(int(options["rounds"])))
                for key in ("with", "without", "check")}
        records.append({"method": method, "with_ms": 1e3 * best["with"],
                        "without_ms": 1e3 * best["without"], "check_ms": 1e3 * best["check"],
                        "ratio": best["with"] / (best["with"] - best["check"]),
                        "ab_ms": 1e3 * (best["with"] - best["without"])})
    return records
