"""Where metrics go. Every run writes ``metrics.jsonl`` (one JSON object per line: the
config, then step and eval records, then the summary) and ``summary.json`` in its Hydra run
directory; `gracecomm.experiments.reports.wandb_logger.WandbLogger` sends the same records
to Weights & Biases as well, with a run name, tags and config keys made from the parts, and
its own report table and plots."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from gracecomm.validation import ConfigError, MissingDependencyError


class JsonlLogger:
    """JSONL log (rank 0 only): a new run replaces the run directory's metrics.jsonl, a run
    resumed from a checkpoint continues it. `resume` is the logger state the checkpoint
    kept (`state_dict`), None for a new run; `metric` names the task's test metric in eval
    records and `higher_is_better` its direction."""

    def __init__(self, run_dir: str, run_config: dict[str, Any], group: str | None = None,
                 resume: Mapping[str, Any] | None = None, metric: str | None = None,
                 higher_is_better: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("w" if resume is None else "a", encoding="utf-8")
        self.group = (resume or {}).get("group", group)  # a resumed run keeps its group
        self.write({"type": "config", "config": run_config, "group": self.group, "metric": metric,
                    "higher_is_better": higher_is_better})

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps for this logger to continue after a resume: the group."""
        return {"group": self.group}

    @classmethod
    def check_options(cls, **options: Any) -> None:
        """Raise, before any worker starts, if `options` cannot work (nothing to check
        here; subclasses that need packages or accounts check them)."""

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()

    def log(self, record: dict[str, Any]) -> None:
        """A step or eval record: ``{"type": "step"|"eval", "step": ..., ...}``."""
        self.write(record)

    def finish(self, summary: dict[str, Any]) -> None:
        self.write({"type": "summary", **summary})
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        self._file.close()


def _wandb_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


WANDB_MODES = ("auto", "online", "offline", "disabled")


def import_wandb() -> Any:
    """The wandb module, or `MissingDependencyError` with the install command."""
    try:
        import wandb
    except ImportError as err:
        raise MissingDependencyError("logger=wandb needs the wandb package: pip install "
                                "'gracecomm[wandb]'") from err
    return wandb


def wandb_mode(mode: str) -> str:
    """W&B's mode for ``mode``: ``auto`` is online when an API key is available
    (WANDB_API_KEY or ``wandb login``), offline otherwise."""
    if mode not in WANDB_MODES:
        raise ConfigError(f"logger 'wandb': option 'mode' must be one of "
                          f"{', '.join(WANDB_MODES)}; got {mode!r}")
    if mode == "auto":
        return "online" if _wandb_key_available() else "offline"
    return mode


# groups of the Hydra config whose choice does not describe the method or the experiment
UNTAGGED_GROUPS = ("logger", "trainer")
PARTS = ("compressor", "memory", "communicator")


def sweep_group(hydra: DictConfig) -> str:
    """A multirun's W&B group from Hydra's config, shared by its runs: the experiment's name
    (Hydra's job name without one) and the sweep directory's last two parts, by default its
    date and its time with the run token: ``sidco_2026-11-22_00-08-05_81230``."""
    return _group(hydra, hydra.sweep.dir)


def run_group(hydra: DictConfig) -> str:
    """A single run's W&B group, a group of its own: the experiment's (or job's) name and
    the run directory's last two parts, ``train_2026-11-22_02-10-06_topk_81230``."""
    return _group(hydra, hydra.run.dir)


def _group(hydra: DictConfig, folder: str) -> str:
    name = hydra.runtime.choices.get("experiment") or hydra.job.name
    return "_".join([str(name), *Path(str(folder)).parts[-2:]])


def logged_group(root: Path) -> str | None:
    """The group the runs under `root` logged with (the config record of the first
    ``metrics.jsonl``), so a report written later joins its sweep's W&B group."""
    for path in sorted(Path(root).rglob("metrics.jsonl")):
        with path.open(encoding="utf-8") as f:
            return json.loads(f.readline() or "{}").get("group")
    return None


def run_parts(choices: Mapping[str, Any]) -> dict[str, str]:
    """The short names Hydra chose for each group (``compressor: topk``, ``memory:
    residual``, ``compressor_index: bloom``, ``model: cnn``, ...), without Hydra's own."""
    return {group.replace("/", "_"): str(choice) for group, choice in choices.items()
            if choice is not None and not group.startswith("hydra/")
            and group not in UNTAGGED_GROUPS}


def run_name(parts: Mapping[str, str], overrides: Sequence[str],
             run_config: Mapping[str, Any]) -> str:
    """``topk-0.01``: the compressor (with its nested parts, ``deepreduce(topk+bloom+raw)``),
    its ratio if it has one, and every option of the three parts set on the command line
    (``powersgd-rank=4``, ``topk-0.01-memory=none``)."""
    nested = [v for k, v in parts.items() if k.startswith("compressor_")]
    pieces = [parts.get("compressor", "run") + (f"({'+'.join(nested)})" if nested else "")]
    ratio = (run_config.get("compressor") or {}).get("ratio")
    if ratio is not None:
        pieces.append(f"{ratio:g}" if isinstance(ratio, float) else str(ratio))
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.split(".")[0] in PARTS and key not in ("compressor", "compressor.ratio"):
            pieces.append(f"{key.removeprefix('compressor.')}={value}")
    return "-".join(pieces)
