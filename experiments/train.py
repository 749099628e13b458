"""Data-parallel training with compressed gradient exchange (Hydra entry point).

    gracecomm-train                                # 2 Gloo workers, digits, Top-1%
    gracecomm-train compressor=topk compressor.ratio=0.01
    gracecomm-train -m compressor=none,topk,randomk                # a sweep
    torchrun --nproc_per_node=2 -m gracecomm.experiments.train     # join torchrun's group

Without launcher variables the command spawns `trainer.world_size` local workers on
127.0.0.1; under torchrun it joins the launcher's process group instead. Rank 0 writes
``metrics.jsonl`` and ``summary.json`` into the Hydra run directory and prints a summary.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import json
import math
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_collate

from gracecomm import Compressor, Grace, GradientExchange, Need, build, register_comm_hook, registry
from gracecomm.config import (
    OPT_IN,
    check_targets,
    guard_composition,
    guarded,
    instantiate,
    opted_in,
)
from gracecomm.configstore import node_of
from gracecomm.experiments import checkpoint, rundir
from gracecomm.experiments.collapse import Collapsed, CollapseWatch
from gracecomm.experiments.consistency import describe, gather_text, verify_same_on_all_ranks
from gracecomm.experiments.launch import (
    WorkerError,
    WorkerTimeout,
    exit_now,
    launched_externally,
    run_rank,
    spawn,
)
from gracecomm.experiments.loggers import run_group, sweep_group
from gracecomm.experiments.method_defaults import RECORD_KEY, apply_method_defaults, given_keys
from gracecomm.experiments.tasks import Task, make_task
from gracecomm.experiments.torch_hooks import (
    AllreduceCounter,
    check_torch_exchange,
    register_torch_hook,
)
from gracecomm.network import (
    COLLECTIVE_KEYS,
    Network,
    compute_time,
    networks,
    overhead_time,
    project,
)
from gracecomm.pipeline import AUTO, default_part
from gracecomm.registry import check_options
from gracecomm.rng import stable_hash
from gracecomm.validation import (
    ConfigError,
    MissingDependency,
    NonFiniteError,
    check_choice,
    check_range,
)

SUMMED_KEYS = ("dense_bytes", "wire_bytes", "sent_bytes", "downlink_bytes", "compress_s",
               "decompress_s", "memory_s", "comm_s", "step_s", "exchanges", *COLLECTIVE_KEYS)
STARTUP = "startup_"  # prefix of the totals of start-up steps (see `accumulate`)
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def compose_config(*overrides: str) -> DictConfig:
    """The training config with command-line style overrides, composed and checked as the
    entry point composes and checks it (for tests and scripts); `overrides` are the
    caller's own, so ``allow_any_target=true`` among them opens every target."""
    from hydra import compose, initialize_config_dir
    with guard_composition(), initialize_config_dir(config_dir=str(CONFIG_DIR),
                                                    version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # `${hydra:...}` values resolve, as in a run
    with open_dict(cfg):
        del cfg["hydra"]
        cfg[OPT_IN] = opted_in(overrides)
    try:
        compressor = instantiate(cfg.compressor, allow_any_target=cfg[OPT_IN])
    except (ConfigError, MissingDependency):
        return cfg  # `validate` reports it, as in a run
    resolve_parts(cfg, compressor)
    return cfg


def build_grace(cfg: DictConfig) -> Grace:
    """The pipeline of `cfg`'s compressor, memory and communicator, assembled by
    `gracecomm.build` (``auto`` parts resolved first, `resolve_parts`)."""
    allow = bool(cfg.get(OPT_IN, False))
    compressor = instantiate(cfg.compressor, allow_any_target=allow)
    resolve_parts(cfg, compressor)
    return build(compressor, instantiate(cfg.memory, allow_any_target=allow),
                 instantiate(cfg.communicator, allow_any_target=allow),
                 check_finite=bool(cfg.get("check_finite", True)))


def part_config(group: str, name: str) -> DictConfig:
    """The config of the `group` part registered as `name`: its file in ``configs/<group>/``
    where there is one, else the entry generated from its class (`gracecomm.configstore`,
    with the run values it interpolates). A path that leaves the config tree is refused."""
    where = Path(group, f"{name}.yaml")
    if where.is_absolute() or ".." in where.parts:
        raise ConfigError(f"part config {str(where)!r} leaves the config tree; give a group "
                          f"of configs/ ({', '.join(registry.REGISTRIES)}) and a registered name")
    path = CONFIG_DIR / where
    if path.exists():
        return OmegaConf.load(path)
    return OmegaConf.create(node_of(registry.get(group, name)))


def resolve_parts(cfg: DictConfig, compressor: Compressor) -> None:
    """Replace an ``auto`` memory or communicator (configs/memory/auto.yaml, the default) by
    the config of the part `compressor` brings, chosen as `gracecomm.build` chooses it
    (`default_part`: from the compressor's options), with any options given to the auto
    node (``+memory.beta=0.9``) on top, and name it in a logger's Hydra ``choices``."""
    chosen: dict[str, str] = {}
    for group in ("memory", "communicator"):
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or not node.get(AUTO, False):
            continue
        name = default_part(AUTO, getattr(compressor.capabilities(), f"default_{group}"))
        options = {str(k): v for k, v in node.items_ex(resolve=False) if k != AUTO}
        resolved = part_config(group, name)
        keys = (set(resolved) | set(options)) - {"_target_"}
        check_options(registry.get(group, name), dict.fromkeys(keys),
                      f"{group} '{name}' (brought by {compressor.label} as {group}=auto)")
        with open_dict(cfg):
            cfg[group] = OmegaConf.merge(resolved, options)
        chosen[group] = name
    logger = cfg.get("logger")
    if chosen and isinstance(logger, DictConfig) and "choices" in logger:
        choices = OmegaConf.to_container(logger.choices, resolve=True)
        logger.choices = {**choices, **chosen}


def validate(cfg: DictConfig) -> None:
    """Fail before any worker starts: targets, option names, ranges and pairings, the
    logger's set-up and the checkpoint to resume from."""
    check_scale(cfg)  # first: the other options' values interpolate the scale's preset
    if not cfg.get(OPT_IN, False):
        check_targets(cfg)
    check_trainer_options(cfg.trainer)
    t = cfg.trainer
    check_range(t.world_size, "trainer", "world_size", 1, integer=True)
    check_range(t.epochs, "trainer", "epochs", 1, integer=True)
    check_range(t.batch_size, "trainer", "batch_size", 1, integer=True)
    check_range(t.lr, "trainer", "lr", 0.0, low_open=True)
    check_range(t.momentum, "trainer", "momentum", 0.0, 1.0, high_open=True)
    check_range(t.weight_decay, "trainer", "weight_decay", 0.0)
    check_range(t.timeout_s, "trainer", "timeout_s", 0.0, low_open=True)
    check_range(t.collective_timeout_s, "trainer", "collective_timeout_s", 0.0, low_open=True)
    check_range(t.eval_every, "trainer", "eval_every", 1, integer=True)
    check_range(t.eval_every_steps, "trainer", "eval_every_steps", 0, integer=True)
    if t.stop_at is not None:
        check_range(t.stop_at, "trainer", "stop_at", -math.inf)
    if t.max_steps is not None:
        check_range(t.max_steps, "trainer", "max_steps", 1, integer=True)
    check_choice(t.backend, ("auto", "gloo", "nccl"), "trainer", "backend")
    check_choice(t.device, ("auto", "cpu", "cuda"), "trainer", "device")
    optimizer_name(cfg)
    check_range(t.bucket_cap_mb, "trainer", "bucket_cap_mb", 0.0, low_open=True)
    pipeline = build_grace(cfg)
    make_optimizer(cfg, nn.Linear(1, 1), pipeline)
    if exchange_mode(cfg) == "torch":
        check_torch_exchange(pipeline)
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer: option 'device' is 'cuda' but no CUDA device is available; "
                          "use trainer.device=cpu or auto")
    configured_networks(cfg)
    check_model_fits_data(cfg)
    check_logger(cfg.logger)
    check_range(t.checkpoint_every, "trainer", "checkpoint_every", 0, integer=True)
    if t.resume and launched_externally():  # the manifest and this process's rank's file
        world_size = int(os.environ["WORLD_SIZE"])
        found = checkpoint.manifest(t.resume, world_size, [int(os.environ["RANK"])])
    elif t.resume:  # the manifest and every rank's file
        world_size = int(t.world_size)
        found = checkpoint.manifest(t.resume, world_size)
    if t.resume:
        resume_changes(cfg, found["settings"], world_size)


# -- what a checkpoint records of its run, and what a resumed run may change -------------------

# Applied on resume, and reported and recorded: the optimizer continues with this run's values.
APPLIED_ON_RESUME = ("trainer.lr", "trainer.momentum", "trainer.weight_decay")
# May change when ``trainer.resume_changes`` lists them (a group name lists all its options):
# the data order changes with them, so the run continues at the start of the next epoch.
DATA_SETTINGS = ("seed", "trainer.batch_size", "data")
NOT_SETTINGS = ("data.root", "data.download")  # where the data set lives, not what it is


def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items()
                for k, v in _flatten(value, f"{prefix}.{key}").items()}
    return {prefix: node}


def run_settings(cfg: DictConfig, world_size: int) -> dict[str, Any]:
    """Everything that decides what the next training step computes, by dotted name, as
    JSON values: the seed (data split and order), the world size, the batch size, the data
    set, the model, the compressor, memory and communicator with all their options, the
    exchange, the non-finite rule and the optimizer with its hyper-parameters. A checkpoint
    records them (`checkpoint.save`) and a resumed run is compared with them
    (`resume_changes`)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    trainer = container["trainer"]
    out: dict[str, Any] = {"seed": container.get("seed"), "trainer.world_size": world_size,
                           "check_finite": container.get("check_finite", True),
                           "trainer.exchange": trainer.get("exchange", "hook"),
                           "trainer.optimizer": trainer.get("optimizer", "sgd")}
    for key in ("batch_size", "bucket_cap_mb", "lr", "momentum", "weight_decay"):
        out[f"trainer.{key}"] = trainer.get(key)
    for group in ("data", "model", "compressor", "memory", "communicator"):
        out.update(_flatten(container.get(group), group))
    for key in NOT_SETTINGS:
        out.pop(key, None)
    return json.loads(json.dumps(out, default=str))


def _listed(key: str, names: list[str]) -> bool:
    return any(key == n or key.startswith(f"{n}.") for n in names)


def resume_changes(cfg: DictConfig, saved: dict[str, Any],
                   world_size: int) -> dict[str, tuple[Any, Any]]:
    """The settings (`run_settings`) of this run that differ from those of the checkpoint's
    run, as (checkpoint's, this run's), when the resumed run may go on with them: the
    optimizer's hyper-parameters (applied) and the data settings ``trainer.resume_changes``
    lists. Any other difference is refused with `ConfigError` naming each setting, both
    values and how to resume."""
    now = run_settings(cfg, world_size)
    missing = "not set"
    changed = {k: (saved.get(k, missing), now.get(k, missing)) for k in sorted({*saved, *now})
               if saved.get(k, missing) != now.get(k, missing)}
    allowed = [str(n) for n in cfg.trainer.get("resume_changes") or []]
    for name in allowed:
        if not _listed(name, list(DATA_SETTINGS)):
            raise ConfigError(f"trainer: option 'resume_changes' lists {name!r}, which cannot "
                              f"change on resume; it may list {', '.join(DATA_SETTINGS)} or "
                              "options of data (the compression and optimizer state belong "
                              "to the method, the model and the world size)")
    refused = {k: v for k, v in changed.items()
               if k not in APPLIED_ON_RESUME and not _listed(k, allowed)}
    if refused:
        listed = "; ".join(f"{k} is {new!r} here but {old!r} in the checkpoint's run"
                           for k, (old, new) in refused.items())
        back = " ".join(f"{k}={json.dumps(old)}" for k, (old, _) in refused.items()
                        if old != missing)
        data = [k for k in refused if _listed(k, list(DATA_SETTINGS))]
        allow = (f"; or let the data settings change with "
                 f"'trainer.resume_changes=[{','.join(data)}]' (the run then continues at "
                 "the start of the next epoch)" if data else "")
        how = back or "drop the options it did not have"
        raise ConfigError(
            f"trainer: option 'resume' points to {cfg.trainer.resume}, whose run computed "
            f"its steps with other settings: {listed}. A resumed run must compute the steps "
            f"that run would have: resume with its values ({how}), or start a new run "
            f"without trainer.resume{allow}")
    return changed


def check_trainer_options(trainer: DictConfig) -> None:
    """Every ``trainer.*`` option must be one the trainer configs declare (a mistyped
    ``+trainer.lrr=0.1`` would otherwise be ignored)."""
    known = sorted({key for path in (CONFIG_DIR / "trainer").glob("*.yaml")
                    for key in OmegaConf.load(path)})
    for key in trainer:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"trainer: unknown option '{key}'{hint}; the options are "
                              f"{', '.join(known)}")


def check_logger(logger: DictConfig) -> None:
    """The logger's options must match its class, and the class must accept their values
    (``logger=wandb`` needs wandb installed and a valid ``mode``), before any worker starts:
    the logger itself is only created on rank 0 once training begins."""
    cls = get_class(logger._target_)
    # unresolved: `choices` and `overrides` interpolate Hydra's runtime, absent outside a run
    options = {str(k): v for k, v in logger.items_ex(resolve=False) if k != "_target_"}
    try:
        inspect.signature(cls).bind(run_dir="", run_config={}, **options)
    except TypeError as err:
        raise ConfigError(f"logger '{cls.__name__}': {err}; its options are "
                          f"{', '.join(list(inspect.signature(cls).parameters)[2:])}") from None
    check = getattr(cls, "check_options", None)
    if check is not None:
        check(**options)


def check_scale(cfg: DictConfig) -> None:
    """An experiment's ``scale`` must name one of its presets (``small``, ``paper``, ...)."""
    exp = cfg.get("experiment")
    if exp is not None and "scale" in exp:
        presets = [k for k, v in exp.items() if isinstance(v, DictConfig)]
        check_choice(exp.scale, presets, f"experiment '{exp.get('name', '?')}'", "scale")


def configured_networks(cfg: DictConfig) -> list[Network]:
    """The networks of ``network.bandwidth_gbps`` x ``network.latency_us`` (gracecomm.network);
    ``network.shared``: all ranks' traffic crosses one link."""
    return networks(cfg.network.bandwidth_gbps, cfg.network.latency_us,
                    cfg.network.get("shared", False))


def check_model_fits_data(cfg: DictConfig) -> None:
    """Refuse, before any worker starts, a model whose options disagree with the data set's
    options of the same name (``num_classes``, ``vocab_size``, ``num_users``, ...), whose
    task differs from the data set's, or that cannot take one of its training examples."""
    what = f"model '{cfg.model._target_}' with data '{cfg.data._target_}'"
    for key in sorted(set(cfg.model) & set(cfg.data) - {"_target_", "seed"}):
        if cfg.model[key] != cfg.data[key]:
            raise ConfigError(f"{what}: option 'model.{key}' is {cfg.model[key]} but "
                              f"'data.{key}' is {cfg.data[key]}; they must be equal")
    allow = bool(cfg.get(OPT_IN, False))
    data = instantiate(cfg.data, allow_any_target=allow)
    model = instantiate(cfg.model, allow_any_target=allow)
    task = make_task(data.task, data.task_options)
    model_task = getattr(model, "task", task.name)
    if model_task != task.name:
        fitting = [p.stem for p in sorted((CONFIG_DIR / "model").glob("*.yaml"))
                   if getattr(get_class(OmegaConf.load(p)._target_), "task", None) == task.name]
        raise ConfigError(f"{what}: the model takes {model_task} batches but the data set is "
                          f"for {task.name}; models for {task.name}: {', '.join(fitting)}")
    x, y = default_collate([data.train[0]])
    model.eval()
    try:
        with torch.no_grad():
            task.loss(model(x), y)
    except (RuntimeError, ValueError, IndexError) as err:
        raise ConfigError(f"{what}: the model cannot take the data set's examples ({err}); "
                          "match the model's sizes to the data (channels, classes, image "
                          "size, users/items, vocabulary)") from None


EXCHANGES = ("hook", "hook_sync", "step", "torch")


def exchange_mode(cfg: DictConfig) -> str:
    """How gradients are exchanged (`gracecomm.ddp`):

    - ``hook`` (every method): the asynchronous DDP comm hook, each bucket's communication
      overlapping the backward pass of the next (methods that need the whole step at once
      are exchanged after the last bucket);
    - ``hook_sync``: the same hook, waiting for each bucket's exchange (no overlap);
    - ``step``: the custom-loop path, `GradientExchange.step` after backward;
    - ``torch``: PyTorch's own DDP communication for the compressor, as a baseline
      (`gracecomm.experiments.torch_hooks`: plain DDP for ``none``, its fp16/bf16/PowerSGD
      hooks)."""
    return check_choice(cfg.trainer.get("exchange", "hook"), EXCHANGES, "trainer", "exchange")


def broadcast_state(model: nn.Module, parameters: bool = True) -> None:
    """Copy rank 0's parameters (and buffers) to every rank, as DDP does at construction."""
    if not dist.is_initialized():
        return
    tensors = list(model.buffers()) + (list(model.parameters()) if parameters else [])
    for tensor in tensors:
        dist.broadcast(tensor.data, src=0)


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


def optimizer_name(cfg: DictConfig) -> str:
    """``trainer.optimizer``: ``sgd`` (with ``trainer.momentum``) or ``adam`` (Kingma and Ba
    2015, as NCF is trained in He et al. 2017)."""
    return check_choice(cfg.trainer.get("optimizer", "sgd"), ("sgd", "adam"), "trainer",
                        "optimizer")


def make_optimizer(cfg: DictConfig, model: nn.Module,
                   grace: Grace) -> tuple[torch.optim.Optimizer, float]:
    """The optimizer, and the weight decay the exchange adds before compression. Where a
    part of `grace` applies the momentum itself (`Need.OWNS_MOMENTUM`: DGC's memory,
    Signum), SGD runs without momentum and the weight decay moves to the exchange; the
    library refuses any other combination (`gracecomm.ddp.check_optimizer`)."""
    t = cfg.trainer
    if Need.OWNS_MOMENTUM in grace.needs:
        if optimizer_name(cfg) == "adam":
            raise ConfigError(f"trainer: option 'optimizer' is 'adam' but "
                              f"{grace.needed_by(Need.OWNS_MOMENTUM)} applies the momentum "
                              "itself; use trainer.optimizer=sgd")
        return torch.optim.SGD(model.parameters(), lr=t.lr, momentum=0.0), float(t.weight_decay)
    if optimizer_name(cfg) == "adam":
        return torch.optim.Adam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay), 0.0
    return torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum,
                           weight_decay=t.weight_decay), 0.0


def setup_parts(cfg: DictConfig, model: nn.Module, world_size: int) -> dict[str, str]:
    """What every rank must agree on: the compression set-up, the exchange mode, the
    parameters' names, shapes and dtypes, and the world size (gracecomm.experiments.consistency)."""
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
    allow = bool(cfg.get(OPT_IN, False))
    device = _device(cfg, rank)
    torch.manual_seed(cfg.seed)
    data = instantiate(cfg.data, allow_any_target=allow)
    task = make_task(data.task, data.task_options)
    nets = configured_networks(cfg)
    model = instantiate(cfg.model, allow_any_target=allow).to(device)
    grace = build_grace(cfg)
    t = cfg.trainer
    parts = setup_parts(cfg, model, world_size)
    verify_same_on_all_ranks(parts)
    fingerprint = str(stable_hash(sorted(parts.items())))
    optimizer, decay = make_optimizer(cfg, model, grace)
    position, totals = checkpoint.Position(), new_totals()
    resumed, source = None, f"checkpoint {t.resume} (rank {rank})"
    settings, changes = run_settings(cfg, world_size), {}
    if t.resume:
        resumed = checkpoint.load(t.resume, rank, world_size, fingerprint)
        changes = resume_changes(cfg, resumed["settings"], world_size)
        checkpoint.check_shapes(resumed, model, source)
        model.load_state_dict(resumed["model"])
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(resumed["optimizer"])
        for param_group, values in zip(optimizer.param_groups, hyper):  # this run's values
            param_group.update(values)
        grace.load_state_dict(resumed["grace"])
        position = checkpoint.Position(**resumed["position"])
        totals.update(resumed["totals"])
    new_data = [k for k in changes if _listed(k, list(DATA_SETTINGS))]
    mode = exchange_mode(cfg)
    per_bucket = mode != "step"
    counter = contextlib.nullcontext()
    exchange: GradientExchange | None = None  # PyTorch's hooks have none
    if per_bucket:
        net: nn.Module = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=float(t.bucket_cap_mb))
        if mode == "torch":
            register_torch_hook(net, grace)
            counter = AllreduceCounter(net, grace.metrics,
                                       hooked=grace.compressor.registry_name != "none")
        else:
            exchange = register_comm_hook(net, grace, optimizer, weight_decay=decay,
                                          asynchronous=mode == "hook")
    else:
        net = model
        broadcast_state(model)
        exchange = GradientExchange(grace, model, optimizer, weight_decay=decay)
    dense_s = time_dense_allreduce(model, device)
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=cfg.seed)
    loader = DataLoader(data.train, batch_size=t.batch_size, sampler=sampler, drop_last=False)
    if resumed is not None and not new_data:
        position.check(len(loader), source)
    verify_same_on_all_ranks({"resume position": describe(vars(position) if resumed else None)})
    saved_epoch = position.epoch
    if position.batch >= len(loader) or new_data:  # at the end of an epoch, or a new order
        position = checkpoint.Position(position.step, position.epoch + 1, 0)
    if changes and rank == 0:
        print(f"resumed from {t.resume} at step {position.step}; changed since its run: "
              + "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
              + (f" (the new data order starts with epoch {position.epoch})" if new_data
                 else ""), flush=True)
    if Need.OWNS_MOMENTUM in grace.needs and rank == 0:
        print(f"{grace.needed_by(Need.OWNS_MOMENTUM)} applies the momentum: the optimizer "
              "runs with momentum 0 and weight decay is added to the gradients before "
              "compression", flush=True)
    total_steps = t.epochs * len(loader)
    if t.max_steps is not None:
        total_steps = min(total_steps, int(t.max_steps))
    checkpoint_dir = checkpoint_dir_of(cfg, run_dir)
    if resumed is not None and position.step >= total_steps and rank == 0:
        print(f"{t.resume} holds the end of this run (step {position.step} of {total_steps}): "
              "nothing left to train, evaluating it (raise trainer.epochs or trainer.max_steps "
              "to train further)", flush=True)
    logger = None
    if rank == 0:
        logger = instantiate(cfg.logger, run_dir=run_dir, group=group,
                             run_config=OmegaConf.to_container(cfg, resolve=True),
                             resume=None if resumed is None else resumed.get("logger", {}),
                             metric=task.metric, higher_is_better=task.higher_is_better,
                             allow_any_target=allow, _recursive_=False, _convert_="all")
    progress = None
    if rank == 0 and t.progress:
        from tqdm import tqdm
        # a thread lock: tqdm's default multiprocessing one outlives the worker's os._exit
        # and the resource tracker then warns of a leaked semaphore at the launcher's exit
        tqdm.set_lock(threading.RLock())
        progress = tqdm(total=total_steps, initial=position.step, unit="step",
                        desc=f"train [{grace.compressor.registry_name}]", dynamic_ncols=True)
    watch = CollapseWatch(task, task.chance(data.test) if rank == 0 else None,
                          grace.compressor.label, grace.compressor.sensitivities)

    def save(at: checkpoint.Position) -> None:
        checkpoint.save(checkpoint_dir, rank, world_size, at, model, optimizer,
                        grace.state_dict(), totals, fingerprint,
                        logger.state_dict() if logger is not None else {}, settings)

    clock = TrainingClock()

    def evaluate_now(epoch: int) -> dict[str, float]:
        clock.pause()
        if not per_bucket:
            broadcast_state(model, parameters=False)
        evals = evaluate(model, data.test, task, rank, world_size, device, t.batch_size)
        watch.evaluated(step, epoch, evals[task.metric])
        evals["state_bytes"] = tensor_bytes(grace.state_dict())
        evals["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        evals["train_time_s"] = clock.elapsed()
        if logger is not None:
            logger.log({"type": "eval", "step": step, "epoch": epoch, **evals})
        clock.resume()
        return evals

    def reached(evals: dict[str, float]) -> bool:
        """Whether the test metric reached ``trainer.stop_at`` (every rank agrees: the
        evaluation's sums are added over the ranks)."""
        if t.stop_at is None or not evals:
            return False
        value = evals[task.metric]
        return value >= t.stop_at if task.higher_is_better else value <= t.stop_at

    step, evals, save_at, evaluated_at = position.step, {}, None, None
    for epoch in range(position.epoch, t.epochs):
        if step >= total_steps or reached(evals):
            break
        sampler.set_epoch(epoch)
        grace.set_epoch(epoch)
        skip = position.batch if epoch == position.epoch else 0
        if resumed is not None and epoch == position.epoch and skip == 0:
            checkpoint.set_rng_state(resumed["rng"])  # saved before this epoch's iterator
        batches = iter(loader)  # draws the loader's base seed from the global RNG
        if resumed is not None and epoch == position.epoch and skip:
            checkpoint.set_rng_state(resumed["rng"])  # saved after this epoch's iterator
            for _ in range(skip):
                next(batches)
        for batch_index, (x, y) in enumerate(batches, start=skip):
            if step >= total_steps or reached(evals):
                break
            start = clock.start()
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            try:
                with counter:
                    loss = task.loss(net(x), y)
                    loss.backward()
                if exchange is not None and not per_bucket:
                    exchange.step()
            except (NonFiniteError, RuntimeError) as err:
                cause = (exchange.error if exchange is not None else None) or err
                if not isinstance(cause, NonFiniteError):
                    raise
                # name the step: a gradient overflowed, not only a tensor
                raise watch.diverged(step + 1, epoch, loss.item(), cause) from err
            optimizer.step()
            loss_value = loss.item()
            watch.loss(step + 1, epoch, loss_value)
            stats = grace.metrics.pop()
            stats["step_s"] = time.perf_counter() - start
            stats["compute_s"] = slowest(compute_time(stats), device)
            stats.update(project(stats, world_size, nets))
            accumulate(totals, stats, startup=step == position.step)
            step += 1
            due = t.checkpoint_every and (step % t.checkpoint_every == 0 or step == total_steps)
            save_at = checkpoint.Position(step, epoch, batch_index + 1) if due else None
            if save_at is not None and save_at.batch < len(loader):
                save(save_at)  # an epoch's last batch is saved after its evaluation
                save_at = None
            if logger is not None:
                logger.log({"type": "step", "step": step, "epoch": epoch,
                            "loss": loss_value, **stats})
            if progress is not None:
                progress.set_postfix(loss=f"{loss_value:.3f}",
                                     factor=f"{stats.get('compression_factor', 1):.1f}x")
                progress.update(1)
            if t.eval_every_steps and step % t.eval_every_steps == 0:
                evals, evaluated_at = evaluate_now(epoch), step
                if reached(evals):
                    break
        due = (epoch + 1) % t.eval_every == 0 or epoch == t.epochs - 1 or step >= total_steps
        if due and evaluated_at != step:
            evals, evaluated_at = evaluate_now(epoch), step
        if save_at is not None:
            save(save_at)
    if not evals:  # resumed from the end of the run
        evals = evaluate_now(saved_epoch)
    if progress is not None:
        progress.close()
    summary = _summary(totals, step, world_size, device, nets)
    summary.update(measured_speedup(summary, dense_s))
    summary.update(evals, steps=step, world_size=world_size, task=task.name,
                   metric=task.metric, metric_label=task.label,
                   higher_is_better=task.higher_is_better,
                   compressor=grace.compressor.registry_name, memory=grace.memory.registry_name,
                   communicator=grace.communicator.registry_name, chance=watch.chance,
                   collapse=watch.verdict(), **{RECORD_KEY: cfg_dict.get(RECORD_KEY, {})})
    if resumed is not None:
        summary["resume"] = {"from": str(t.resume), "step": resumed["position"]["step"],
                             "changed": {k: list(v) for k, v in changes.items()}}
    if logger is not None:
        logger.finish(summary)
        print(format_summary(summary, run_dir), flush=True)
        if summary["collapse"]:
            print(f"!! {summary['collapse']['message']}", flush=True)


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


def measured_speedup(summary: dict[str, Any], dense_s: float) -> dict[str, float]:
    """The speedup measured on this run's own network: its mean step against the same
    step's computation plus one dense allreduce of the gradients timed in the run
    (`time_dense_allreduce`); nothing without peers."""
    if not dense_s:
        return {}
    step = summary["step_s_per_step"]
    compute = max(0.0, step - summary["comm_s_per_step"] - summary["overhead_s_per_step"])
    return {"dense_allreduce_s": dense_s,
            "measured_speedup": (compute + dense_s) / step if step > 0 else 1.0}


def tensor_bytes(state: Any) -> int:
    """Bytes of all tensors in a nested state dict (compression state that must not grow)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


def new_totals() -> dict[str, float]:
    """Zeroed run totals: every summed statistic, over all steps and over start-up steps."""
    return dict.fromkeys([*SUMMED_KEYS, *(STARTUP + k for k in SUMMED_KEYS), "startup_steps"],
                         0.0)


def accumulate(totals: dict[str, float], stats: dict[str, float], startup: bool) -> None:
    """Add one step's statistics to the run's totals. The first step a process runs is also
    summed apart as start-up (numba kernels load or compile, buffers and DDP buckets are
    built: seconds that would otherwise skew every per-step mean of a short run)."""
    for key in SUMMED_KEYS:
        totals[key] += stats.get(key, 0.0)
        if startup:
            totals[STARTUP + key] += stats.get(key, 0.0)
    totals["startup_steps"] += int(startup)


def _summary(totals: dict[str, float], steps: int, world_size: int, device: torch.device,
             nets: list[Network]) -> dict[str, float]:
    """Per-rank, per-step means over all ranks of the summed statistics, taken over the
    steady-state steps (all but the start-up steps, unless the run has no other), the network
    projection (gracecomm.network) of those means, and the start-up steps' own figures."""
    keys = list(totals)
    vec = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(vec)
    total = {k: float(v) / world_size for k, v in zip(keys, vec.tolist())}
    startup = round(total["startup_steps"]) if steps > total["startup_steps"] else 0
    steady = steps - startup
    means = {k: (total[k] - (total[STARTUP + k] if startup else 0.0)) / max(1, steady)
             for k in SUMMED_KEYS}
    summary = {f"{k}_per_step": v for k, v in means.items()}
    wire, down = means["wire_bytes"], means["downlink_bytes"]
    summary["compression_factor"] = means["dense_bytes"] / wire if wire else math.inf
    if down:  # a parameter server's reply, which every rank receives
        summary["compression_factor_down"] = means["dense_bytes"] / down
    summary["overhead_s_per_step"] = overhead_time(means)
    summary.update(project(means, world_size, nets))
    summary.update(steady_steps=steady, startup_steps=startup,
                   startup_step_s=total[STARTUP + "step_s"] if startup else 0.0,
                   startup_overhead_s=overhead_time(
                       {k: total[STARTUP + k] for k in SUMMED_KEYS}) if startup else 0.0)
    return summary


def format_bytes(n: float) -> str:
    """Decimal units, as the network model's bandwidths: 1 KB = 1,000 bytes."""
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"


def format_summary(s: dict[str, Any], run_dir: str) -> str:
    def row(label: str, text: str) -> str:
        return f"   {label:<22} {text}"

    down = s.get("downlink_bytes_per_step", 0.0)
    lines = [f"== {s['compressor']} + {s['memory']} memory over {s['communicator']}, "
             f"{s['world_size']} ranks, {s['steps']} steps",
             row(s["metric_label"], f"{s.get(s['metric'], float('nan')):.4f}"),
             row("uplink / step" if down else "wire bytes / step",
                 f"{format_bytes(s['wire_bytes_per_step'])} per rank (dense "
                 f"{format_bytes(s['dense_bytes_per_step'])}, compression factor "
                 f"{s['compression_factor']:.1f}x)")]
    if down:
        lines.append(row("downlink / step", f"{format_bytes(down)} to every rank (compression "
                                            f"factor {s['compression_factor_down']:.1f}x)"))
    lines += [
        row("compression / step", f"{1e3 * s['overhead_s_per_step']:.2f} ms (compress "
                                  f"{1e3 * s['compress_s_per_step']:.2f}, decompress "
                                  f"{1e3 * s['decompress_s_per_step']:.2f}, memory "
                                  f"{1e3 * s['memory_s_per_step']:.2f})"),
        row("communication / step", f"{1e3 * s['comm_s_per_step']:.2f} ms"),
        row("projected speedup", ", ".join(f"{v:.2f}x at {k.split('@')[1]}" for k, v in s.items()
                                           if k.startswith("speedup@"))
            + " (vs dense ring allreduce)"),
    ]
    if "measured_speedup" in s:
        lines.append(row("measured speedup",
                         f"{s['measured_speedup']:.2f}x on this run's network (vs a dense "
                         f"allreduce timed in the run: {1e3 * s['dense_allreduce_s']:.2f} ms)"))
    lines += [row("per-step figures", steady_steps_text(s)),
              row("metrics", os.path.join(run_dir, "metrics.jsonl")),
              bought(s)]
    return "\n".join(lines)


def bought(s: dict[str, Any]) -> str:
    """The summary's last line: what compression bought, in bytes and in projected step
    time on the slowest and fastest modelled networks."""
    factor = s["compression_factor"]
    if not math.isfinite(factor) or abs(factor - 1.0) < 0.005:
        return (f"== compression bought nothing: {s['compressor']} sends what dense "
                "allreduce sends (try compressor=topk)")
    speedups = [(k.split("@")[1], v) for k, v in s.items() if k.startswith("speedup@")]
    text = (f"== compression bought {factor:.1f}x fewer bytes than dense allreduce"
            if factor > 1 else f"== compression cost {1 / factor:.1f}x more bytes than dense "
            "allreduce")
    if speedups:
        (slow, first), (fast, last) = speedups[0], speedups[-1]
        text += f"; projected speedup {first:.2f}x at {slow}"
        if fast != slow:
            text += f", {last:.2f}x at {fast}"
    return text


# What `main` returns to a Hydra sweeper such as Optuna, every one minimised: `error` is 1 -
# the test metric where higher is better (accuracy, hit rate) and the test metric itself
# where lower is better (perplexity); the others are bytes per rank per step (payload; sent,
# with size headers and padding).
OBJECTIVES = ("error", "wire_bytes", "sent_bytes")


def objective_names(cfg: DictConfig) -> list[str]:
    """``objective``: one name of `OBJECTIVES` or a list of them (Optuna's multi-objective
    mode)."""
    names = cfg.get("objective", "error")
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ConfigError(f"option 'objective' is empty; give one or more of "
                          f"{', '.join(OBJECTIVES)}")
    return [check_choice(name, OBJECTIVES, "config", "objective") for name in names]


def objective(summary: dict[str, Any], names: list[str]) -> float | tuple[float, ...]:
    """The run's value of each objective in `names`, all to be minimised (a float for one
    name, a tuple for several); NaN for a run that wrote no summary."""
    values = []
    for name in names:
        if name == "error":
            metric = float(summary.get(summary.get("metric", ""), math.nan))
            values.append(1.0 - metric if summary.get("higher_is_better", True) else metric)
        else:
            values.append(float(summary.get(f"{name}_per_step", math.nan)))
    return values[0] if len(values) == 1 else tuple(values)


def steady_steps_text(s: dict[str, Any]) -> str:
    """Which steps the per-step figures average, and what the start-up steps cost."""
    startup, steps = s.get("startup_steps", 0), s["steps"]
    if not startup:
        return f"means over all {steps} steps"
    which = (f"steps 2-{steps}; start-up (step 1)" if startup == 1 else
             f"{s['steady_steps']} steady-state steps; start-up (the first step of each of "
             f"{startup} process starts)")
    return (f"means over {which} took {s['startup_step_s']:.2f} s, of it compression "
            f"{s['startup_overhead_s']:.2f} s")


def _run_group() -> str:
    hc = HydraConfig.get()
    return sweep_group(hc) if hc.mode == RunMode.MULTIRUN else run_group(hc)


def one_line_errors(run: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """A configuration refused before any worker starts (`ConfigError`, its
    `IncompatibleError`, a `MissingDependency`) ends a single run with its one-line message
    and exit code 1 instead of a traceback; a sweep's job raises it as before."""

    @functools.wraps(run)
    def checked(cfg: DictConfig) -> Any:
        try:
            return run(cfg)
        except (ConfigError, MissingDependency) as err:
            if HydraConfig.get().mode == RunMode.MULTIRUN:
                raise
            print(f"{type(err).__module__}.{type(err).__name__}: {err}", file=sys.stderr,
                  flush=True)
            sys.exit(1)

    return checked


def checkpoint_dir_of(cfg: DictConfig, run_dir: str) -> str:
    """Where the run saves its checkpoints: ``trainer.checkpoint_dir``, else in its run
    directory."""
    return cfg.trainer.checkpoint_dir or os.path.join(run_dir, "checkpoints")


@contextlib.contextmanager
def claim_run(cfg: DictConfig, run_dir: str) -> Iterator[None]:
    """Lock the run directory and, where the run saves checkpoints, its checkpoint
    directory for the life of the run (`rundir.claim`: a second live run given either is
    refused), and refuse a checkpoint directory that holds another run's checkpoint unless
    the run resumes from it: saving would replace that checkpoint."""
    folder = Path(checkpoint_dir_of(cfg, run_dir))
    with contextlib.ExitStack() as stack:
        stack.enter_context(rundir.claim(run_dir))
        if cfg.trainer.checkpoint_every:
            if folder.resolve() != Path(run_dir).resolve():
                stack.enter_context(rundir.claim(folder, "checkpoint directory",
                                                 "give this run its own trainer.checkpoint_dir"))
            resume = cfg.trainer.resume
            if (folder / checkpoint.MANIFEST).exists() and not (
                    resume and Path(resume).resolve() == folder.resolve()):
                raise ConfigError(f"trainer: option 'checkpoint_dir' is {folder}, which holds "
                                  "the checkpoint of another run, and saving would replace "
                                  f"it: resume from it (trainer.resume={folder}), or give "
                                  "this run another trainer.checkpoint_dir")
        yield


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
@one_line_errors
def train_job(cfg: DictConfig) -> float | tuple[float, ...]:
    """Train one configuration; return its `objective` (minimised) to a Hydra sweeper."""
    if launched_externally() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ConfigError("a Hydra multirun (-m) cannot run under torchrun: torchrun starts "
                          "one process group for one training run, so only the first job "
                          "would run. Sweep without torchrun (local workers: "
                          "trainer.world_size=N, any Hydra launcher), or start one torchrun "
                          "per configuration")
    allow = opted_in(HydraConfig.get().overrides.task)
    if cfg.get(OPT_IN, False) and not allow:  # `guard_composition` refused it already
        raise ConfigError(f"a config file sets {OPT_IN}: true; give {OPT_IN}=true on the "
                          "command line to allow any target")
    with open_dict(cfg):
        cfg[OPT_IN] = allow
    compressor = instantiate(cfg.compressor, allow_any_target=allow)
    resolve_parts(cfg, compressor)
    for line in apply_method_defaults(cfg, given_keys(HydraConfig.get().overrides.task),
                                      compressor):
        if os.environ.get("RANK", "0") == "0":  # once, also under torchrun
            print(line, flush=True)
    validate(cfg)
    names = objective_names(cfg)
    run_dir = HydraConfig.get().runtime.output_dir
    group = _run_group()
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if launched_externally():  # run this rank and exit, as spawned workers do
        rank = int(os.environ["RANK"])
        with claim_run(cfg, run_dir) if rank == 0 else contextlib.nullcontext():
            run_rank(train_worker, rank, int(os.environ["WORLD_SIZE"]),
                     (cfg_dict, run_dir, group), backend=_backend(cfg),
                     collective_timeout_s=float(cfg.trainer.collective_timeout_s))
    try:
        with claim_run(cfg, run_dir):
            spawn(train_worker, int(cfg.trainer.world_size), cfg_dict, run_dir, group,
                  backend=_backend(cfg), timeout_s=float(cfg.trainer.timeout_s),
                  collective_timeout_s=float(cfg.trainer.collective_timeout_s))
    except (KeyboardInterrupt, WorkerError, WorkerTimeout) as err:
        # the workers are stopped: say why and exit at once (the interpreter's teardown
        # takes seconds, on a loaded machine sometimes a minute)
        interrupted = isinstance(err, KeyboardInterrupt)
        print("interrupted (SIGINT): the workers were stopped" if interrupted else
              f"{type(err).__module__}.{type(err).__name__}: {err}", file=sys.stderr)
        exit_now(128 + signal.SIGINT if interrupted else 1)
    summary_path = os.path.join(run_dir, "summary.json")
    summary = {}
    if os.path.exists(summary_path):
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
    # a sweep goes on to its other runs
    if summary.get("collapse") and HydraConfig.get().mode != RunMode.MULTIRUN:
        raise Collapsed(summary["collapse"]["message"])
    return objective(summary, names)


# The ``gracecomm-train`` command: Hydra's entry point (`train_job`), with every config Hydra
# composes checked before any part of it is used (`gracecomm.config.check_composed`: targets,
# ``hydra.*`` callbacks, logging and environment included).
main = guarded(train_job)


if __name__ == "__main__":
    # run the installed module's `main`, not this `__main__` copy: a launcher plugin (joblib,
    # submitit) pickles `train_worker` by its module name, which `__main__` does not resolve
    from gracecomm.experiments.train import main as installed_main

    installed_main()
