"""A method's training defaults: the trainer options its compressor declares it needs
(`Compressor.training_defaults`, e.g. signSGD's ``lr`` 0.0005), applied where the user did
not set the option.

"Set" means given on the command line (or by the sweep for this job): such a value is kept.
Every other value comes from config files (``configs/trainer/``, an experiment's recipe) and
gives way to the method's default, so ``compressor=signsgd``, ``+method=signsgd`` and
``+experiment=grace_benchmark`` all train signSGD with its small step from one declaration.
The options a run took from its method are printed at start and recorded in the run's
config and summary under `RECORD_KEY`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, open_dict

from gracecomm.compressor import Compressor
from gracecomm.config import instantiate
from gracecomm.validation import ConfigError

RECORD_KEY = "method_defaults"  # {"trainer.lr": 0.001, ...} in the run's config and summary


def given_keys(overrides: Iterable[str]) -> set[str]:
    """The config keys that command-line overrides (Hydra's ``overrides.task``) set."""
    return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))}


def apply_method_defaults(cfg: DictConfig, given: set[str],
                          compressor: Compressor | None = None) -> list[str]:
    """Set each trainer option that the compressor of `cfg` declares a default for, unless
    its key (``trainer.lr``) is in `given`; record what was applied under `RECORD_KEY`.
    Returns one line per declared option, for the run to print."""
    if compressor is None:
        compressor = instantiate(cfg.compressor,
                                 allow_any_target=bool(cfg.get("allow_any_target", False)))
    name = compressor.registry_name or type(compressor).__name__
    applied: dict[str, Any] = {}
    lines = []
    for option, value in compressor.training_defaults.items():
        key = f"trainer.{option}"
        if option not in cfg.trainer:
            raise ConfigError(f"{compressor.label} declares a training default for '{key}', "
                              f"which is not a trainer option ({', '.join(cfg.trainer)})")
        if key in given:
            lines.append(f"{name}: {key}={cfg.trainer[option]} (given; the method's default "
                         f"is {value})")
            continue
        cfg.trainer[option] = value
        applied[key] = value
        lines.append(f"{name}: {key}={value} (method default)")
    with open_dict(cfg):
        cfg[RECORD_KEY] = applied
    return lines
