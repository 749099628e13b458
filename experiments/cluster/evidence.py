"""Stored convergence evidence: how many steps each method needed to reach a target accuracy
in a ``goal=accuracy`` netbench run (results/cluster_tta/ by default), labelled with the
model, data and cluster it came from.

Two readers: `gracecomm-advise` multiplies a method's projected step by its steps there (a
time to the target), and ``exchange.strategy=auto`` weighs the method's step by its steps
over the run's lossless baseline (plain DDP), its step penalty (`gracecomm.strategy`). Both
assume that the ratio of steps to the target carries over to another model, data set or
cluster, which it need not: the label says where it was measured, and
``exchange.step_penalty=X`` replaces it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gracecomm.config import instantiate
from gracecomm.experiments import presets

EVIDENCE = Path(__file__).resolve().parents[2] / "results" / "cluster_tta" / "4n_100mbit.json"
PARTS = ("compressor", "memory", "communicator")  # what makes two runs one method


def stored_runs(path: Path | None = None) -> tuple[dict[str, dict[str, Any]], str, str]:
    """The runs of a stored netbench result (`EVIDENCE` by default).

    Args:
        path: A ``goal=accuracy`` netbench JSON result.

    Returns:
        method -> its record (``reached_target``, ``steps_to_target``), a label naming the
        run (its file, model, data and cluster), and its baseline method; ``({}, "", "")``
        where there is no such file.
    """
    path = EVIDENCE if path is None else Path(path)
    if not path.is_file():
        return {}, "", ""
    result = json.loads(path.read_text(encoding="utf-8"))
    command = result.get("provenance", {}).get("command", "")
    setting = re.search(r"overrides=\[([^\]]*)\]", command)
    data = setting[1].replace('"', "") if setting else "netbench's default model and data"
    label = (f"{path.name}: {data}, {result['world_size']} nodes at "
             f"{result['bandwidth_mbps']:g} Mbit/s, target accuracy "
             f"{result['target_accuracy']:.3f}")
    return ({row["method"]: row for row in result["runs"]}, label,
            str(result.get("baseline", "ddp")))


def step_penalty(method: str, path: Path | None = None) -> tuple[float, str] | None:
    """A method's steps to the target over the baseline's in the stored run.

    Args:
        method: A method preset.
        path: The stored run (`stored_runs`).

    Returns:
        (the ratio, at least 1; ``math.inf`` where the method missed the target, a line
        saying where it comes from), or None where the run has no such method, or its
        baseline missed the target.
    """
    runs, label, baseline = stored_runs(path)
    run, base = runs.get(method), runs.get(baseline)
    if run is None or base is None or not base["reached_target"]:
        return None
    if not run["reached_target"]:
        return math.inf, f"{method} missed the target in {label}"
    penalty = max(1.0, run["steps_to_target"] / base["steps_to_target"])
    return penalty, (f"{method} needed {run['steps_to_target']} steps to the target, "
                     f"{baseline} {base['steps_to_target']}, in {label}")


def _parts(cfg: DictConfig) -> dict[str, Any]:
    return {part: OmegaConf.to_container(cfg[part], resolve=False) for part in PARTS}


def preset_of(cfg: DictConfig, choices: Mapping[str, Any]) -> str | None:
    """The method preset a training config runs: the one it selected (``+method=NAME``) or
    its compressor's own preset (``compressor=NAME``), where the preset's compressor, memory
    and communicator are the config's (none else: another ratio is another method).

    Args:
        cfg: A composed training config, its parts resolved (`resolve_parts`).
        choices: Hydra's runtime choices of the run (config group -> option).

    Returns:
        The preset's name, or None.
    """
    from gracecomm.experiments.training.config import resolve_parts  # the trainer imports us
    for name in dict.fromkeys(str(choices[g]) for g in ("method", "compressor")
                              if choices.get(g)):
        if name not in presets.available():
            continue
        preset = presets.compose(name)
        resolve_parts(preset, instantiate(preset.compressor))
        if _parts(preset) == _parts(cfg):
            return name
    return None


def apply_step_penalty(cfg: DictConfig, choices: Mapping[str, Any]) -> list[str]:
    """Set ``exchange.step_penalty`` of an ``exchange.strategy=auto`` run that left it unset
    (null) from the stored evidence of its method (`step_penalty`), or to 1 (step time
    alone) where there is none.

    Args:
        cfg: The run's composed training config, its parts resolved.
        choices: Hydra's runtime choices of the run.

    Returns:
        One line saying what was set and why, for the run to print; none where the run is
        not ``auto`` or gave the option.
    """
    exchange = cfg.get("exchange") or {}
    if exchange.get("strategy") != "auto" or exchange.get("step_penalty") is not None:
        return []
    method = preset_of(cfg, choices)
    found = step_penalty(method) if method is not None else None
    penalty, why = found or (1.0, f"no stored run of {method or 'this method'} ({EVIDENCE.name}"
                                  "): step time alone; exchange.step_penalty=X weighs its "
                                  "accuracy per step")
    cfg.exchange.step_penalty = penalty
    return [f"exchange.step_penalty={penalty:.3g} ({why})"]
