"""Method presets by name: every compressor by its name alone (generated from the registry,
`gracecomm.configstore`), and the files of ``configs/method/``, the only place any other
named setting of a method lives (its compressor with options, memory, communicator, and the
trainer options it needs, e.g. ``trainer.exchange=torch`` for PyTorch's own hooks). Training
picks one with ``+method=NAME``; the benchmarks (`gracecomm.experiments.cluster.netbench`, the
``hook`` and ``compressors`` suites of ``gracecomm-bench``,
`gracecomm.experiments.checks.powersgd_vs_torch`) name presets the same way, so a name means one
thing everywhere.

    available()                  # ['bf16', 'ddp', 'dense', 'dgc', ...]
    overrides("topk")            # ['+method=topk']: gracecomm-train overrides
    extends("torch_fp16")        # ['fp16']: the presets a preset builds on
    torch_twin("powersgd_parity")  # 'torch_powersgd': PyTorch's hook on the same settings
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import hydra
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from gracecomm.configstore import METHOD_GROUP, generated, method_names
from gracecomm.registry import did_you_mean
from gracecomm.validation import ConfigError

PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "method"


def available() -> list[str]:
    """Every preset name (the compressors and the files of ``configs/method/``), sorted."""
    return method_names()


def check(names: list[str], owner: str, option: str = "methods") -> list[str]:
    """`names`, if each is a preset; else a `ConfigError` naming the unknown ones and listing
    the presets."""
    known = available()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"{owner}: option '{option}' names {unknown}, which are not method "
                          f"presets.{did_you_mean(unknown[0], known)} Presets (every compressor "
                          f"and configs/method/): "
                          f"{', '.join(known)}")
    return names


def train_config(*overrides: str) -> DictConfig:
    """The training config of ``gracecomm-train OVERRIDES``, composed as the trainer composes
    it, also from inside this package's Hydra entry points (which search the same config
    directory)."""
    if GlobalHydra.instance().is_initialized():
        return hydra.compose(config_name="train", overrides=list(overrides))
    from gracecomm.experiments.training.config import compose_config  # the trainer imports much
    return compose_config(*overrides)


def compose(name: str, *extra: str) -> DictConfig:
    """The training config of preset `name`, with `extra` overrides (`train_config`)."""
    return train_config(*overrides(name), *extra)


def overrides(name: str) -> list[str]:
    """The ``gracecomm-train`` overrides that select preset `name`."""
    check([name], "presets", "name")
    return [f"+method={name}"]


@cache
def _raw(name: str) -> dict:
    path = PRESET_DIR / f"{name}.yaml"
    return (OmegaConf.to_container(OmegaConf.load(path)) if path.exists()
            else generated(METHOD_GROUP, name) or {})


def extends(name: str) -> list[str]:
    """The presets `name` builds on (plain names in its ``defaults`` list)."""
    check([name], "presets", "name")
    return [d for d in _raw(name).get("defaults", []) if isinstance(d, str) and d != "_self_"]


def exchange(name: str) -> str:
    """The ``trainer.exchange`` preset `name` sets (through the presets it builds on), else
    ``hook``, the trainer's default."""
    own = _raw(name).get("trainer", {}).get("exchange")
    if own is not None:
        return str(own)
    for base in extends(name):
        if exchange(base) != "hook":
            return exchange(base)
    return "hook"


def torch_twin(name: str) -> str | None:
    """The preset that runs PyTorch's own hook (``trainer.exchange=torch``) on exactly the
    settings of `name` (it builds on `name` and adds only the exchange), if one exists."""
    for other in available():
        raw = _raw(other)
        if (extends(other) == [name] and exchange(other) == "torch"
                and set(raw) <= {"defaults", "trainer"} and set(raw.get("trainer", {})) ==
                {"exchange"}):
            return other
    return None
