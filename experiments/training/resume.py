"""What a checkpoint records of its run (`run_settings`), and what a resumed run may change
(`resume_changes`)."""

from __future__ import annotations

import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gracecomm.validation import (
    ConfigError,
)

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


def is_listed(key: str, names: list[str]) -> bool:
    return any(key == n or key.startswith(f"{n}.") for n in names)


def listed_name(name: str) -> str:
    """A name in ``trainer.resume_changes`` as a setting: a trainer option may be given
    without ``trainer.`` (``batch_size``), as the trainer config names its own options."""
    known = [*DATA_SETTINGS, *APPLIED_ON_RESUME]
    if not is_listed(name, known) and is_listed(f"trainer.{name}", known):
        return f"trainer.{name}"
    return name


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
    allowed = [listed_name(str(n)) for n in cfg.trainer.get("resume_changes") or []]
    for name in allowed:
        if not is_listed(name, [*DATA_SETTINGS, *APPLIED_ON_RESUME]):
            raise ConfigError(f"trainer: option 'resume_changes' lists {name!r}, which cannot "
                              f"change on resume; it may list {', '.join(DATA_SETTINGS)} "
                              "(trainer options also without 'trainer.') or options of data; "
                              f"{', '.join(APPLIED_ON_RESUME)} change without being listed "
                              "(the compression and optimizer state belong to the method, "
                              "the model and the world size)")
    if "seed" in allowed and all(run.get("data.seed", missing) == run.get("seed", missing)
                                 for run in (saved, now)):
        allowed.append("data.seed")  # it follows the seed (``seed: ${seed}``) in both runs
    refused = {k: v for k, v in changed.items()
               if k not in APPLIED_ON_RESUME and not is_listed(k, allowed)}
    if refused:
        listed = "; ".join(f"{k} is {new!r} here but {old!r} in the checkpoint's run"
                           for k, (old, new) in refused.items())
        back = " ".join(f"{k}={json.dumps(old)}" for k, (old, _) in refused.items()
                        if old != missing)
        data = [k for k in refused if is_listed(k, list(DATA_SETTINGS))]
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
