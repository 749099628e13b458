"""The Weights & Biases logger of training runs (``logger=wandb``): the JSONL log
(`gracecomm.experiments.training.loggers.JsonlLogger`) sent to W&B as well, with a run name,
tags and config keys made from the parts, and the run's own report table and plots at the
end (`gracecomm.experiments.reports.writer`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gracecomm.experiments.reports.writer import log_report, write_report
from gracecomm.experiments.training.loggers import (
    JsonlLogger,
    import_wandb,
    run_name,
    run_parts,
    wandb_mode,
)


class WandbLogger(JsonlLogger):
    """JSONL plus Weights & Biases. ``mode: auto`` logs online when an API key is available
    (WANDB_API_KEY or ``wandb login``) and offline otherwise (sync later with
    ``wandb sync``). Runs of one Hydra multirun share a group (`sweep_group`); a single run
    is a group of its own (`run_group`); a resumed run keeps its group.

    The run is named from its parts (`run_name`; `name` replaces it), tagged
    ``group:choice`` for each config group Hydra chose (``compressor:topk``,
    ``memory:residual``, ...; `tags` adds more) and gets the short part names as config key
    ``parts``; `choices` and `overrides` are Hydra's (``hydra.runtime.choices``,
    ``hydra.overrides.task``). Training records go under ``train/`` on the axis
    ``train/step``, evaluations under ``eval/`` on their own axis ``eval/epoch``, and the
    summary keeps each evaluation metric's best value. A run resumed from a checkpoint
    continues the same W&B run (its id is in the logger's `state_dict`). At the end the run
    logs its own report table and plots (`gracecomm.experiments.reports.writer`)."""

    def __init__(self, run_dir: str, run_config: dict[str, Any], group: str | None = None,
                 resume: Mapping[str, Any] | None = None, metric: str | None = None,
                 higher_is_better: bool = True, project: str = "gracecomm",
                 entity: str | None = None, mode: str = "auto", name: str | None = None,
                 tags: Sequence[str] = (), job_type: str = "train",
                 choices: Mapping[str, Any] | None = None, overrides: Sequence[str] = ()) -> None:
        super().__init__(run_dir, run_config, group, resume, metric, higher_is_better)
        wandb = import_wandb()
        parts = run_parts(choices or {})
        run_id = (resume or {}).get("wandb_run_id")
        self.run = wandb.init(
            project=project, entity=entity, group=self.group, job_type=job_type,
            name=name or run_name(parts, overrides, run_config),
            tags=[f"{k}:{v}" for k, v in parts.items()] + list(tags),
            config={**run_config, "parts": parts}, dir=str(self.run_dir),
            mode=wandb_mode(mode), id=run_id, resume="allow" if run_id else None,
            reinit="finish_previous")
        for kind, axis in (("train", "step"), ("eval", "epoch")):
            self.run.define_metric(f"{kind}/{axis}")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/{axis}")
        best = {"test_loss": "min"}
        if metric is not None:
            best[metric] = "max" if higher_is_better else "min"
        for key, summary in best.items():
            self.run.define_metric(f"eval/{key}", step_metric="eval/epoch", summary=summary)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "wandb_run_id": self.run.id}

    @classmethod
    def check_options(cls, **options: Any) -> None:
        """wandb must be installed and ``mode`` one of `WANDB_MODES`."""
        wandb_mode(options.get("mode", "auto"))
        import_wandb()

    def log(self, record: dict[str, Any]) -> None:
        super().log(record)
        kind = "eval" if record.get("type") == "eval" else "train"
        self.run.log({f"{kind}/{k}": v for k, v in record.items()
                      if k != "type" and isinstance(v, (int, float))})

    def finish(self, summary: dict[str, Any]) -> None:
        super().finish(summary)
        for key, value in summary.items():
            if isinstance(value, (int, float, str)):
                self.run.summary[key] = value
        log_report(self.run, write_report(self.run_dir))
        self.run.finish()
