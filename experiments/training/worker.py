"""One rank's training loop (`train_worker`, also the body of a torchrun process): build the
model, the compression pipeline and the optimizer, restore a checkpoint, wrap the model for the
configured exchange, then train, evaluate, checkpoint and log step by step (`Worker`)."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

from gracecomm import GradientExchange, Need, register_comm_hook
from gracecomm.config import OPT_IN, instantiate
from gracecomm.experiments.method_defaults import RECORD_KEY
from gracecomm.experiments.training import checkpoint
from gracecomm.experiments.training.collapse import CollapseWatch
from gracecomm.experiments.training.config import (
    build_grace,
    checkpoint_dir_of,
    configured_networks,
    exchange_mode,
    make_optimizer,
)
from gracecomm.experiments.training.consistency import (
    describe,
    gather_text,
    verify_same_on_all_ranks,
)
from gracecomm.experiments.training.resume import (
    DATA_SETTINGS,
    is_listed,
    resume_changes,
    run_settings,
)
from gracecomm.experiments.training.rundir import to_log_file
from gracecomm.experiments.training.summary import (
    accumulate,
    measured_speedup,
    new_totals,
    summarize,
    summary_lines,
    tensor_bytes,
)
from gracecomm.experiments.training.torch_hooks import AllreduceCounter, register_torch_hook
from gracecomm.experiments.workloads.tasks import Task, make_task
from gracecomm.network import compute_time, project
from gracecomm.rng import stable_hash
from gracecomm.validation import NonFiniteError


def broadcast_state(model: nn.Module, parameters: bool = True) -> None:
    """Copy rank 0's parameters (and buffers) to every rank, as DDP does at construction."""
    if not dist.is_initialized():
        return
    tensors = list(model.buffers()) + (list(model.parameters()) if parameters else [])
    for tensor in tensors:
        dist.broadcast(tensor.data, src=0)


def device_of(cfg: DictConfig, rank: int) -> torch.device:
    use_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto"
                                                 and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def backend_of(cfg: DictConfig) -> str:
    if cfg.trainer.backend != "auto":
        return str(cfg.trainer.backend)
    use_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto"
                                                 and torch.cuda.is_available())
    return "nccl" if use_cuda else "gloo"


def evaluate(model: nn.Module, dataset: Any, task: Task, rank: int, world_size: int,
             device: torch.device, batch_size: int) -> dict[str, float]:
    """Test loss and the task's metric over the whole test set (each rank takes every
    world_size-th example; the task's sums are added over ranks)."""
    shard = Subset(dataset, range(rank, len(dataset), world_size))
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=max(batch_size, 256)):
            totals += torch.tensor(task.eval_sums(model, x.to(device), y.to(device)),
                                   dtype=torch.float64, device=device)
    model.train()
    if dist.is_initialized():
        dist.all_reduce(totals)
    return task.finish(totals.tolist())


def setup_parts(cfg: DictConfig, model: nn.Module, world_size: int) -> dict[str, str]:
    """What every rank must agree on: the compression set-up, the exchange mode, the
    parameters' names, shapes and dtypes, and the world size (`consistency`)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    params = [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    return {"compressor": describe(container["compressor"]),
            "memory": describe(container["memory"]),
            "communicator": describe(container["communicator"]),
            "exchange": describe([exchange_mode(cfg), cfg.check_finite]),
            "parameters": describe(params), "world_size": str(world_size)}



def train_worker(rank: int, world_size: int, cfg_dict: dict[str, Any], run_dir: str,
                 group: str | None) -> None:
    """One rank's training loop (also the body of a torchrun process)."""
    cfg = OmegaConf.create(cfg_dict)
    if dist.is_initialized():  # under torchrun every rank named its own; rank 0's counts
        run_dir = gather_text(run_dir)[0]
    worker = Worker(cfg, rank, world_size, run_dir)
    worker.wrap_model()
    worker.prepare_loader()
    worker.announce()
    worker.open_outputs(group)
    worker.train()
    worker.finish(cfg_dict)


class Worker:
    """The state of one rank's training run, built and used in the order `train_worker`
    calls its steps: the parts (`__init__`, with `restore`), the exchange (`wrap_model`),
    the data order and the position to start from (`prepare_loader`), rank 0's notes, logger
    and progress bar (`announce`, `open_outputs`), the epochs and steps (`train`,
    `run_epoch`, `train_step`), and the summary (`finish`)."""

    def __init__(self, cfg: DictConfig, rank: int, world_size: int, run_dir: str) -> None:
        self.cfg, self.t = cfg, cfg.trainer
        self.rank, self.world_size, self.run_dir = rank, world_size, run_dir
        self.allow = bool(cfg.get(OPT_IN, False))
        self.device = device_of(cfg, rank)
        torch.manual_seed(cfg.seed)
        self.data = instantiate(cfg.data, allow_any_target=self.allow)
        self.task = make_task(self.data.task, self.data.task_options)
        self.model = instantiate(cfg.model, allow_any_target=self.allow).to(self.device)
        self.grace = build_grace(cfg)
        layout = self.grace.node_layout()  # two levels: priced on nodes of its ranks
        self.nets = configured_networks(cfg, 1 if layout is None else layout.ranks_per_node)
        parts = setup_parts(cfg, self.model, world_size)
        verify_same_on_all_ranks(parts)
        self.fingerprint = str(stable_hash(sorted(parts.items())))
        self.optimizer, self.decay = make_optimizer(cfg, self.model, self.grace)
        self.position, self.totals = checkpoint.Position(), new_totals()
        self.resumed: dict[str, Any] | None = None
        self.source = f"checkpoint {self.t.resume} (rank {rank})"
        self.settings = run_settings(cfg, world_size)
        self.changes: dict[str, tuple[Any, Any]] = {}
        if self.t.resume:
            self.restore()
        self.new_data = [k for k in self.changes if is_listed(k, list(DATA_SETTINGS))]

    def restore(self) -> None:
        """Load this rank's file of the checkpoint ``trainer.resume``: the model, the
        optimizer (with this run's hyper-parameters), the compression state, the position
        and the totals; `resume_changes` refuses settings the run may not change."""
        t, optimizer = self.t, self.optimizer
        self.resumed = resumed = checkpoint.load(t.resume, self.rank, self.world_size,
                                                 self.fingerprint)
        self.changes = resume_changes(self.cfg, resumed["settings"], self.world_size)
        checkpoint.check_shapes(resumed, self.model, self.source)
        self.model.load_state_dict(resumed["model"])
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(resumed["optimizer"])
        for param_group, values in zip(optimizer.param_groups, hyper):  # this run's values
            param_group.update(values)
        self.grace.load_state_dict(resumed["grace"])
        self.position = checkpoint.Position(**resumed["position"])
        self.totals.update(resumed["totals"])

    def wrap_model(self) -> None:
        """The exchange of ``trainer.exchange`` (`exchange_mode`): DDP with the library's comm
        hook or PyTorch's own (per bucket), or the model itself with
        `GradientExchange.step` after backward; then time one dense allreduce."""
        mode = exchange_mode(self.cfg)
        self.per_bucket = mode != "step"
        self.counter: Any = contextlib.nullcontext()
        self.exchange: GradientExchange | None = None  # PyTorch's hooks have none
        model, grace, device = self.model, self.grace, self.device
        if self.per_bucket:
            net: nn.Module = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=float(self.t.bucket_cap_mb))
            if mode == "torch":
                register_torch_hook(net, grace)
                self.counter = AllreduceCounter(net, grace.metrics,
                                                hooked=grace.compressor.registry_name != "none")
            else:
                self.exchange = register_comm_hook(net, grace, self.optimizer,
                                                   weight_decay=self.decay,
                                                   asynchronous=mode == "hook")
        else:
            net = model
            broadcast_state(model)
            self.exchange = GradientExchange(grace, model, self.optimizer,
                                             weight_decay=self.decay)
        self.net = net
        self.dense_s = time_dense_allreduce(model, device)

    def prepare_loader(self) -> None:
        """The sampler and loader of the training set, and the position to start from: the
        checkpoint's, or the start of the next epoch at the end of one or where the data
        order changed; every rank must agree on it."""
        cfg, t = self.cfg, self.t
        self.sampler = DistributedSampler(self.data.train, num_replicas=self.world_size,
                                          rank=self.rank, shuffle=True, seed=cfg.seed)
        self.loader = DataLoader(self.data.train, batch_size=t.batch_size,
                                 sampler=self.sampler, drop_last=False)
        position, loader = self.position, self.loader
        if self.resumed is not None and not self.new_data:
            position.check(len(loader), self.source)
        verify_same_on_all_ranks(
            {"resume position": describe(vars(position) if self.resumed else None)})
        self.saved_epoch = position.epoch
        if position.batch >= len(loader) or self.new_data:  # an epoch's end, or a new order
            self.position = checkpoint.Position(position.step, position.epoch + 1, 0)
        self.total_steps = t.epochs * len(loader)
        if t.max_steps is not None:
            self.total_steps = min(self.total_steps, int(t.max_steps))
        self.checkpoint_dir = checkpoint_dir_of(cfg, self.run_dir)

    def announce(self) -> None:
        """Rank 0 says what changed since the checkpoint's run, that a part applies the
        momentum, and that a checkpoint holds the end of the run."""
        t, position, grace = self.t, self.position, self.grace
        if self.rank != 0:
            return
        if self.changes:
            print(f"resumed from {t.resume} at step {position.step}; changed since its run: "
                  + "; ".join(f"{k} {old!r} -> {new!r}"
                              for k, (old, new) in self.changes.items())
                  + (f" (the new data order starts with epoch {position.epoch})"
                     if self.new_data else ""), flush=True)
        if Need.OWNS_MOMENTUM in grace.needs:
            print(f"{grace.needed_by(Need.OWNS_MOMENTUM)} applies the momentum: the optimizer "
                  "runs with momentum 0 and weight decay is added to the gradients before "
                  "compression", flush=True)
        if self.resumed is not None and position.step >= self.total_steps:
            print(f"{t.resume} holds the end of this run (step {position.step} of "
                  f"{self.total_steps}): nothing left to train, evaluating it (raise "
                  "trainer.epochs or trainer.max_steps to train further)", flush=True)

    def open_outputs(self, group: str | None) -> None:
        """Rank 0's logger (``logger``) and progress bar (``trainer.progress``); every
        rank's collapse watch and training clock."""
        cfg, t, task, grace, resumed = self.cfg, self.t, self.task, self.grace, self.resumed
        self.logger = None
        if self.rank == 0:
            self.logger = instantiate(
                cfg.logger, run_dir=self.run_dir, group=group,
                run_config=OmegaConf.to_container(cfg, resolve=True),
                resume=None if resumed is None else resumed.get("logger", {}),
                metric=task.metric, higher_is_better=task.higher_is_better,
                allow_any_target=self.allow, _recursive_=False, _convert_="all")
        self.progress = None
        if self.rank == 0 and t.progress:
            from tqdm import tqdm
            # a thread lock: tqdm's default multiprocessing one outlives the worker's os._exit
            # and the resource tracker then warns of a leaked semaphore at the launcher's exit
            tqdm.set_lock(threading.RLock())
            self.progress = tqdm(total=self.total_steps, initial=self.position.step,
                                 unit="step", desc=f"train [{grace.compressor.registry_name}]",
                                 dynamic_ncols=True)
        self.watch = CollapseWatch(task, task.chance(self.data.test) if self.rank == 0 else None,
                                   grace.compressor.label, grace.compressor.sensitivities)
        self.clock = TrainingClock()
        self.step, self.evals = self.position.step, {}
        self.save_at: checkpoint.Position | None = None
        self.evaluated_at: int | None = None

    def save(self, at: checkpoint.Position) -> None:
        checkpoint.save(self.checkpoint_dir, self.rank, self.world_size, at, self.model,
                        self.optimizer, self.grace.state_dict(), self.totals, self.fingerprint,
                        self.logger.state_dict() if self.logger is not None else {},
                        self.settings)

    def evaluate_now(self, epoch: int) -> dict[str, float]:
        """Evaluate on the test set (the training clock paused) and log it."""
        self.clock.pause()
        if not self.per_bucket:
            broadcast_state(self.model, parameters=False)
        evals = evaluate(self.model, self.data.test, self.task, self.rank, self.world_size,
                         self.device, self.t.batch_size)
        self.watch.evaluated(self.step, epoch, evals[self.task.metric])
        evals["state_bytes"] = tensor_bytes(self.grace.state_dict())
        evals["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        evals["train_time_s"] = self.clock.elapsed()
        if self.logger is not None:
            self.logger.log({"type": "eval", "step": self.step, "epoch": epoch, **evals})
        self.clock.resume()
        return evals

    def reached(self, evals: dict[str, float]) -> bool:
        """Whether the test metric reached ``trainer.stop_at`` (every rank agrees: the
        evaluation's sums are added over the ranks)."""
        if self.t.stop_at is None or not evals:
            return False
        value = evals[self.task.metric]
        return value >= self.t.stop_at if self.task.higher_is_better else value <= self.t.stop_at

    def done(self) -> bool:
        return self.step >= self.total_steps or self.reached(self.evals)

    def train(self) -> None:
        """Every epoch from the start position until the last step or ``trainer.stop_at``;
        a run resumed from its end is evaluated once."""
        for epoch in range(self.position.epoch, self.t.epochs):
            if self.done():
                break
            self.run_epoch(epoch)
        if not self.evals:  # resumed from the end of the run
            self.evals = self.evaluate_now(self.saved_epoch)
        if self.progress is not None:
            self.progress.close()

    def batches(self, epoch: int) -> tuple[Any, int]:
        """The epoch's batch iterator and the batches skipped in it (a run resumed within
        the epoch), with the random state the checkpoint saved restored around it."""
        position, resumed = self.position, self.resumed
        skip = position.batch if epoch == position.epoch else 0
        if resumed is not None and epoch == position.epoch and skip == 0:
            checkpoint.set_rng_state(resumed["rng"])  # saved before this epoch's iterator
        batches = iter(self.loader)  # draws the loader's base seed from the global RNG
        if resumed is not None and epoch == position.epoch and skip:
            checkpoint.set_rng_state(resumed["rng"])  # saved after this epoch's iterator
            for _ in range(skip):
                next(batches)
        return batches, skip

    def run_epoch(self, epoch: int) -> None:
        """One epoch's steps, with the evaluations of ``trainer.eval_every_steps`` and
        ``trainer.eval_every`` and the checkpoint due at its end."""
        t = self.t
        self.sampler.set_epoch(epoch)
        self.grace.set_epoch(epoch)
        batches, skip = self.batches(epoch)
        for batch_index, (x, y) in enumerate(batches, start=skip):
            if self.done():
                break
            self.train_step(x, y, epoch, batch_index)
            if t.eval_every_steps and self.step % t.eval_every_steps == 0:
                self.evals, self.evaluated_at = self.evaluate_now(epoch), self.step
                if self.reached(self.evals):
                    break
        due = ((epoch + 1) % t.eval_every == 0 or epoch == t.epochs - 1
               or self.step >= self.total_steps)
        if due and self.evaluated_at != self.step:
            self.evals, self.evaluated_at = self.evaluate_now(epoch), self.step
        if self.save_at is not None:
            self.save(self.save_at)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, epoch: int, batch_index: int) -> None:
        """One step: forward, backward and exchange, the optimizer's step, the step's
        statistics, a checkpoint when one is due, the log and the progress bar."""
        t, grace, exchange = self.t, self.grace, self.exchange
        start = self.clock.start()
        x, y = x.to(self.device), y.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with self.counter:
                self.loss = self.task.loss(self.net(x), y)
                self.loss.backward()
            if exchange is not None and not self.per_bucket:
                exchange.step()
        except (NonFiniteError, RuntimeError) as err:
            cause = (exchange.error if exchange is not None else None) or err
            if not isinstance(cause, NonFiniteError):
                raise
            # name the step: a gradient overflowed, not only a tensor
            raise self.watch.diverged(self.step + 1, epoch, self.loss.item(), cause) from err
        self.optimizer.step()
        loss_value = self.loss.item()
        self.watch.loss(self.step + 1, epoch, loss_value)
        stats = grace.metrics.pop()
        if stats.get("decisions") and self.logger is not None:  # exchange.strategy=auto
            print(grace.strategy.table(), flush=True)  # gracecomm.strategy logs it too
        stats["step_s"] = time.perf_counter() - start
        stats["compute_s"] = slowest(compute_time(stats), self.device)
        stats.update(project(stats, self.world_size, self.nets))
        accumulate(self.totals, stats, startup=self.step == self.position.step)
        self.step += 1
        step = self.step
        due = t.checkpoint_every and (step % t.checkpoint_every == 0 or step == self.total_steps)
        self.save_at = checkpoint.Position(step, epoch, batch_index + 1) if due else None
        if self.save_at is not None and self.save_at.batch < len(self.loader):
            self.save(self.save_at)  # an epoch's last batch is saved after its evaluation
            self.save_at = None
        if self.logger is not None:
            self.logger.log({"type": "step", "step": step, "epoch": epoch,
                             "loss": loss_value, **stats})
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{loss_value:.3f}",
                                      factor=f"{stats.get('compression_factor', 1):.1f}x")
            self.progress.update(1)

    def finish(self, cfg_dict: dict[str, Any]) -> None:
        """The run's summary (`summarize`, the measured speedup, the last evaluation and the
        parts), given to the logger and printed by rank 0."""
        grace, task, t, resumed = self.grace, self.task, self.t, self.resumed
        summary = summarize(self.totals, self.step, self.world_size, self.device, self.nets)
        summary.update(measured_speedup(summary, self.dense_s))
        summary.update(self.evals, steps=self.step, world_size=self.world_size, task=task.name,
                       metric=task.metric, metric_label=task.label,
                       higher_is_better=task.higher_is_better,
                       compressor=grace.compressor.registry_name,
                       memory=grace.memory.registry_name,
                       communicator=grace.communicator.registry_name, chance=self.watch.chance,
                       collapse=self.watch.verdict(), **{RECORD_KEY: cfg_dict.get(RECORD_KEY, {})})
        if grace.strategy is not None:  # exchange.strategy=auto: the last decision
            summary["strategy"] = {"link": grace.strategy.link,
                                   "step_penalty": grace.strategy.step_penalty,
                                   "decisions": grace.strategy.decisions,
                                   "buckets": grace.strategy.decision}
        if resumed is not None:
            summary["resume"] = {"from": str(t.resume), "step": resumed["position"]["step"],
                                 "changed": {k: list(v) for k, v in self.changes.items()}}
        if self.logger is not None:
            self.logger.finish(summary)
            for line in summary_lines(summary, self.run_dir):
                print(line, flush=True)
                to_log_file(line)


class TrainingClock:
    """Wall-clock seconds of training since the first step began, evaluations excluded
    (the time-to-accuracy clock of ``trainer.eval_every_steps`` runs)."""

    def __init__(self) -> None:
        self.origin: float | None = None
        self.paused_s, self.paused_at = 0.0, None

    def start(self) -> float:
        """The start of a step (now); the first one starts the clock."""
        now = time.perf_counter()
        if self.origin is None:
            self.origin = now
        return now

    def pause(self) -> None:
        self.paused_at = time.perf_counter()

    def resume(self) -> None:
        if self.paused_at is not None:
            self.paused_s += time.perf_counter() - self.paused_at
            self.paused_at = None

    def elapsed(self) -> float:
        if self.origin is None:
            return 0.0
        end = self.paused_at if self.paused_at is not None else time.perf_counter()
        return end - self.origin - self.paused_s


def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds` (one small allreduce)."""
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def time_dense_allreduce(model: nn.Module, device: torch.device, repeats: int = 9) -> float:
    """Seconds one dense allreduce of all of `model`'s gradients (float32) takes on this
    run's process group: the median of `repeats` after a warm-up, the slowest rank's; 0
    without peers. Every rank calls it (collectives)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    buffer = torch.zeros(sum(p.numel() for p in model.parameters() if p.requires_grad),
                         device=device)
    dist.all_reduce(buffer)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return slowest(sorted(times)[repeats // 2], device)
