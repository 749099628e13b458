"""The training config: composed as the entry point composes it (`compose_config`), its
``auto`` parts resolved (`resolve_parts`), and checked before any worker starts (`validate`):
targets, option names and ranges, the logger, the model against the data set, the exchange
mode and the optimizer."""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from torch.utils.data import default_collate

from gracecomm import Compressor, Grace, Need, build, registry
from gracecomm.config import (
    OPT_IN,
    check_targets,
    guard_composition,
    instantiate,
    opted_in,
)
from gracecomm.configstore import node_of
from gracecomm.experiments.training import checkpoint, rundir  # noqa: F401 (${run_token:})
from gracecomm.experiments.training.launch import launched_externally
from gracecomm.experiments.training.resume import resume_changes
from gracecomm.experiments.training.torch_hooks import check_torch_exchange
from gracecomm.experiments.workloads.tasks import make_task
from gracecomm.hierarchy import FLAT, check_hierarchy
from gracecomm.network import (
    Network,
    networks,
)
from gracecomm.pipeline import AUTO, default_part
from gracecomm.registry import check_known, check_options
from gracecomm.strategy import AUTO as AUTO_STRATEGY
from gracecomm.strategy import FIXED, Strategy, check_strategy
from gracecomm.validation import (
    ConfigError,
    MissingDependencyError,
    check_choice,
    check_range,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


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
    except (ConfigError, MissingDependencyError):
        return cfg  # `validate` reports it, as in a run
    resolve_parts(cfg, compressor)
    return cfg


def build_grace(cfg: DictConfig) -> Grace:
    """The pipeline of `cfg`'s compressor, memory and communicator, assembled by
    `gracecomm.build` (``auto`` parts resolved first, `resolve_parts`)."""
    allow = bool(cfg.get(OPT_IN, False))
    compressor = instantiate(cfg.compressor, allow_any_target=allow)
    resolve_parts(cfg, compressor)
    options = exchange_options(cfg)
    penalty = options.pop("step_penalty")
    if options["strategy"] == AUTO_STRATEGY:
        options["strategy"] = Strategy(step_penalty=1.0 if penalty is None else penalty)
    return build(compressor, instantiate(cfg.memory, allow_any_target=allow),
                 instantiate(cfg.communicator, allow_any_target=allow),
                 check_finite=bool(cfg.get("check_finite", True)), **options)


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
    optimizer_settings(cfg, pipeline)
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


def check_trainer_options(trainer: DictConfig) -> None:
    """Every ``trainer.*`` option must be one the trainer configs declare (a mistyped
    ``+trainer.lrr=0.1`` would otherwise be ignored)."""
    known = sorted({key for path in (CONFIG_DIR / "trainer").glob("*.yaml")
                    for key in OmegaConf.load(path)})
    check_known(trainer, known, "trainer")


# train.yaml's ``exchange:``; step_penalty None: set at launch (`evidence.apply_step_penalty`)
EXCHANGE_DEFAULTS = {"hierarchy": FLAT, "strategy": FIXED, "step_penalty": None}


def exchange_options(cfg: DictConfig) -> dict[str, Any]:
    """The ``exchange.*`` options (configs/train.yaml), defaults filled in, checked: an
    unknown key is refused with the closest known one, a bad value with the allowed ones."""
    given = cfg.get("exchange") or {}
    check_known(given, EXCHANGE_DEFAULTS, "exchange")
    options = {**EXCHANGE_DEFAULTS, **given}
    torch_exchange = (cfg.get("trainer") or {}).get("exchange") == "torch"
    for option, default, check in (("hierarchy", FLAT, check_hierarchy),
                                   ("strategy", FIXED, check_strategy)):
        if check(options[option], "exchange") != default and torch_exchange:
            raise ConfigError(f"exchange: option '{option}={options[option]}' needs this "
                              "library's exchange; trainer.exchange=torch runs PyTorch's own "
                              f"({option} {default}; use trainer.exchange=hook, hook_sync or "
                              "step)")
    if options["step_penalty"] is not None:
        check_range(options["step_penalty"], "exchange", "step_penalty", 1.0)
    return options


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


def configured_networks(cfg: DictConfig, ranks_per_node: int = 1) -> list[Network]:
    """The networks of ``network.bandwidth_gbps`` x ``network.latency_us`` (gracecomm.network)
    for nodes of `ranks_per_node` ranks; ``network.shared``: all ranks' traffic crosses one
    link."""
    return networks(cfg.network.bandwidth_gbps, cfg.network.latency_us,
                    cfg.network.get("shared", False), ranks_per_node)


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
      (`gracecomm.experiments.training.torch_hooks`: plain DDP for ``none``, its fp16/bf16/PowerSGD
      hooks)."""
    return check_choice(cfg.trainer.get("exchange", "hook"), EXCHANGES, "trainer", "exchange")


def optimizer_name(cfg: DictConfig) -> str:
    """``trainer.optimizer``: ``sgd`` (with ``trainer.momentum``) or ``adam`` (Kingma and Ba
    2015, as NCF is trained in He et al. 2017)."""
    return check_choice(cfg.trainer.get("optimizer", "sgd"), ("sgd", "adam"), "trainer",
                        "optimizer")


def optimizer_settings(cfg: DictConfig, grace: Grace
                       ) -> tuple[type[torch.optim.Optimizer], dict[str, float], float]:
    """The optimizer's class and options, and the weight decay the exchange adds before
    compression. Where a part of `grace` applies the momentum itself
    (`Need.OWNS_MOMENTUM`: DGC's memory, Signum), SGD runs without momentum and the weight
    decay moves to the exchange; the library refuses any other combination
    (`gracecomm.ddp.check_optimizer`). Checked without building an optimizer (a process's
    first one imports ``torch._dynamo``, about a second of CPU).

    Returns:
        (class, keyword options besides the parameters, the exchange's weight decay).

    Raises:
        ConfigError: Adam with a part that applies the momentum itself.
    """
    t = cfg.trainer
    if Need.OWNS_MOMENTUM in grace.needs:
        if optimizer_name(cfg) == "adam":
            raise ConfigError(f"trainer: option 'optimizer' is 'adam' but "
                              f"{grace.needed_by(Need.OWNS_MOMENTUM)} applies the momentum "
                              "itself; use trainer.optimizer=sgd")
        return torch.optim.SGD, {"lr": t.lr, "momentum": 0.0}, float(t.weight_decay)
    if optimizer_name(cfg) == "adam":
        return torch.optim.Adam, {"lr": t.lr, "weight_decay": t.weight_decay}, 0.0
    return (torch.optim.SGD, {"lr": t.lr, "momentum": t.momentum,
                              "weight_decay": t.weight_decay}, 0.0)


def make_optimizer(cfg: DictConfig, model: nn.Module,
                   grace: Grace) -> tuple[torch.optim.Optimizer, float]:
    """The optimizer of `model`'s parameters (`optimizer_settings`).

    Returns:
        (the optimizer, the weight decay the exchange adds before compression).
    """
    cls, options, decay = optimizer_settings(cfg, grace)
    return cls(model.parameters(), **options), decay


def checkpoint_dir_of(cfg: DictConfig, run_dir: str) -> str:
    """Where the run saves its checkpoints: ``trainer.checkpoint_dir``, else in its run
    directory."""
    return cfg.trainer.checkpoint_dir or os.path.join(run_dir, "checkpoints")
