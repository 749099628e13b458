"""Where metrics go. Every run writes ``metrics.jsonl`` (one JSON object per line: the
config, then step and eval records, then the summary) and ``summary.json`` in its Hydra run
directory; `WandbLogger` sends the same records to Weights & Biases as well."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grace.validation import ConfigError, MissingDependency


class JsonlLogger:
    """JSONL log (rank 0 only): a new run replaces the run directory's metrics.jsonl, a run
    resumed from a checkpoint (`append`) continues it."""

    def __init__(self, run_dir: str, run_config: dict[str, Any], group: str | None = None,
                 append: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a" if append else "w", encoding="utf-8")
        self.group = group
        self.write({"type": "config", "config": run_config, "group": group})

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
    """The wandb module, or `MissingDependency` with the install command."""
    try:
        import wandb
    except ImportError as err:
        raise MissingDependency("logger=wandb needs the wandb package: pip install "
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


class WandbLogger(JsonlLogger):
    """JSONL plus Weights & Biases. ``mode: auto`` logs online when an API key is available
    (WANDB_API_KEY or ``wandb login``) and offline otherwise (sync later with
    ``wandb sync``). Runs of one Hydra multirun share a W&B group."""

    def __init__(self, run_dir: str, run_config: dict[str, Any], group: str | None = None,
                 append: bool = False, project: str = "gracecomm", entity: str | None = None,
                 mode: str = "auto", name: str | None = None,
                 tags: list[str] | None = None) -> None:
        super().__init__(run_dir, run_config, group, append)
        wandb = import_wandb()
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity, group=group, name=name,
                              tags=list(tags or []), config=run_config, dir=str(self.run_dir),
                              mode=wandb_mode(mode), reinit="finish_previous")

    @classmethod
    def check_options(cls, **options: Any) -> None:
        """wandb must be installed and ``mode`` one of `WANDB_MODES`."""
        wandb_mode(options.get("mode", "auto"))
        import_wandb()

    def log(self, record: dict[str, Any]) -> None:
        super().log(record)
        kind = record.get("type", "step")
        values = {f"{kind}/{k}": v for k, v in record.items()
                  if k not in ("type", "step") and isinstance(v, (int, float))}
        self.run.log(values, step=int(record.get("step", 0)))

    def finish(self, summary: dict[str, Any]) -> None:
        super().finish(summary)
        for key, value in summary.items():
            if isinstance(value, (int, float, str)):
                self.run.summary[key] = value
        self.run.finish()
