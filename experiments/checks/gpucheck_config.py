"""What `gracecomm.experiments.checks.gpucheck` checks: the methods its config names
(`entries`: every registered compressor, a DeepReduce per codec and the `variants`, each
built from its Hydra config as ``gracecomm-train compressor=NAME`` builds it) and the
config itself (`validate`: refused before any check runs, naming the option)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf

import gracecomm
from gracecomm import registry
from gracecomm.compressor import Compressor
from gracecomm.config import instantiate
from gracecomm.configstore import register_configs
from gracecomm.validation import ConfigError, check_choice, check_range, check_ratio

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


@dataclass(frozen=True)
class Entry:
    """One method checked: a label and the ``gracecomm-train`` overrides that build it."""

    label: str
    overrides: tuple[str, ...]


def short_schedule(cfg: DictConfig, compressor: str) -> tuple[str, ...]:
    """The overrides of ``cfg.short_schedule`` (option -> value) that `compressor` takes as
    options (its constructor's), so that a few steps reach every phase of a method with
    phases (LGC's ``warmup_iters``, ``ae_train_iters``)."""
    options = registry.options_of(registry.get("compressor", compressor)) or {}
    return tuple(f"compressor.{key}={value}"
                 for key, value in (cfg.get("short_schedule") or {}).items() if key in options)


def entries(cfg: DictConfig) -> list[Entry]:
    """Every registered compressor, a DeepReduce per registered index and value codec, and
    the variants; `cfg.methods`, if set, picks some of them by label."""
    found = [Entry(name, (f"compressor={name}", *short_schedule(cfg, name)))
             for name in gracecomm.available("compressor")]
    for kind in ("index", "value"):
        for codec in gracecomm.available(f"{kind}_codec"):
            found.append(Entry(f"deepreduce[{kind}={codec}]",
                               ("compressor=deepreduce", f"compressor/{kind}={codec}")))
    found += variants(cfg)
    if cfg.get("methods") is None:
        return found
    by_label = {e.label: e for e in found}
    for label in cfg.methods:
        check_choice(str(label), list(by_label), "gpucheck", "methods")
    return [by_label[str(label)] for label in cfg.methods]


def variants(cfg: DictConfig) -> list[Entry]:
    """The `variants` of `cfg`, labelled ``natural[rng=torch]``."""
    found = []
    for name, options in (cfg.get("variants") or {}).items():
        settings = [f"{key}={value}" for key, value in (options or {}).items()]
        found.append(Entry(f"{name}[{','.join(settings)}]",
                           (f"compressor={name}", *short_schedule(cfg, str(name)),
                            *(f"compressor.{s}" for s in settings))))
    return found


@functools.cache
def compressor_config(overrides: tuple[str, ...]) -> DictConfig:
    """The compressor's config, composed from the training config as a run composes it
    (once per method: every check instantiates its own copy)."""
    if GlobalHydra.instance().is_initialized():  # inside this entry point's Hydra run
        return hydra.compose(config_name="train", overrides=list(overrides)).compressor
    register_configs()  # the registered parts' config groups, as the commands compose them
    with hydra.initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra.compose(config_name="train", overrides=list(overrides)).compressor


def build(entry: Entry) -> Compressor:
    """A new compressor of `entry`."""
    return instantiate(compressor_config(entry.overrides))


def parse_device(name: str) -> torch.device:
    """The device option `device` names (cuda, cuda:N or cpu), present or not."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"gpucheck: option 'device' must be cuda, cuda:N or cpu; got "
                          f"{name!r}") from None
    check_choice(device.type, ("cuda", "cpu"), "gpucheck", "device")
    return device


def check_keys(node: DictConfig, known: DictConfig, where: str) -> None:
    """Every key of `node` must be one of `known` (configs/gpucheck.yaml's), nested sections
    alike; `ConfigError` naming the first unknown one and the options there."""
    for key in node:
        if key not in known:
            options = ", ".join(where + str(k) for k in known)
            raise ConfigError(f"gpucheck: unknown option '{where}{key}'."
                              f"{registry.did_you_mean(key, map(str, known))} The options "
                              f"are {options}")
        if isinstance(known[key], DictConfig) and key not in ("variants", "short_schedule"):
            if not isinstance(node[key], DictConfig):
                raise ConfigError(f"gpucheck: option '{where}{key}' is a section of options "
                                  f"({', '.join(map(str, known[key]))}); got {node[key]!r}")
            check_keys(node[key], known[key], f"{where}{key}.")


def validate(cfg: DictConfig) -> None:
    """Refuse, before any check runs, an option configs/gpucheck.yaml does not have or a
    value outside what it allows (`ConfigError` naming the option and what is allowed):
    counts and sizes of at least one, the ratio in (0, 1], tolerances and budgets not
    negative, a device name, registered compressors (and their options in `variants` and
    `short_schedule`), and `methods` null or labels of `entries`."""
    known = OmegaConf.load(CONFIG_DIR / "gpucheck.yaml")
    del known["hydra"]  # Hydra's own, not in the job's config
    check_keys(cfg, known, "")
    parse_device(str(cfg.device))
    for option in ("methods", "sizes", "ddp.methods"):
        value = OmegaConf.select(cfg, option)
        if not isinstance(value, ListConfig) and not (option == "methods" and value is None):
            raise ConfigError(f"gpucheck: option '{option}' must be a list ({option}=[...]); "
                              f"got {value!r}")
    for option in ("check_numel", "calls", "pipeline_steps", "repeats", "threads"):
        check_range(cfg[option], "gpucheck", option, 1, integer=True)
    check_range(cfg.warmup, "gpucheck", "warmup", 0, integer=True)
    check_range(cfg.seed, "gpucheck", "seed", 0, integer=True)
    check_ratio(cfg.ratio, "gpucheck")
    check_range(cfg.slow_call_s, "gpucheck", "slow_call_s", 0.0, low_open=True)
    check_range(cfg.budget_s, "gpucheck", "budget_s", 0.0)
    for i, size in enumerate(cfg.sizes):
        check_range(size, "gpucheck", f"sizes[{i}]", 1, integer=True)
    tol = cfg.tolerance
    check_range(tol.close_fraction, "gpucheck", "tolerance.close_fraction", 0.0, 1.0)
    check_range(tol.close_relative, "gpucheck", "tolerance.close_relative", 0.0)
    check_range(tol.statistics, "gpucheck", "tolerance.statistics", 0.0)
    names = gracecomm.available("compressor")
    every_option = {str(k) for name in names
                    for k in registry.options_of(registry.get("compressor", name)) or {}}
    for key in cfg.short_schedule or {}:
        check_choice(str(key), sorted(every_option), "gpucheck", "short_schedule")
    for name, options in (cfg.variants or {}).items():
        check_choice(str(name), names, "gpucheck", "variants")
        allowed = registry.options_of(registry.get("compressor", str(name))) or {}
        for key in options or {}:
            if key not in allowed:
                raise ConfigError(f"gpucheck: option 'variants.{name}.{key}' is not an option "
                                  f"of compressor '{name}'.{registry.did_you_mean(key, allowed)}"
                                  f" Its options: {', '.join(allowed)}")
    if cfg.methods is not None and not len(cfg.methods):
        raise ConfigError("gpucheck: option 'methods' is empty, which checks nothing; give "
                          "null (every method) or a list of labels, e.g. methods=[topk]")
    entries(cfg)  # `methods` are labels
    for entry in variants(cfg):
        try:
            build(entry)
        except Exception as err:  # noqa: BLE001 - any refusal of the options
            raise ConfigError(f"gpucheck: option 'variants': {entry.label} cannot be built: "
                              f"{str(err).splitlines()[0]}") from None
    d = cfg.ddp
    for method in d.methods:
        check_choice(str(method), names, "gpucheck", "ddp.methods")
    check_range(d.steps, "gpucheck", "ddp.steps", 1, integer=True)
    check_range(d.world_size, "gpucheck", "ddp.world_size", 1, integer=True)
    check_range(d.timeout_s, "gpucheck", "ddp.timeout_s", 0.0, low_open=True)
