"""Entry point of the micro-benchmarks (see `gracecomm.experiments.bench`)."""

from __future__ import annotations

import json
import os

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from gracecomm.config import guarded
from gracecomm.experiments.bench import SUITE_COLUMNS, SUITE_OPTIONS, SUITES
from gracecomm.experiments.bench.table import format_table
from gracecomm.experiments.training import rundir  # noqa: F401 - registers ${run_token:}
from gracecomm.plugins import import_submodules
from gracecomm.validation import ConfigError, check_choice


def check_overrides(name: str, overrides: list[str]) -> None:
    """Refuse a command-line option that suite `name` would not read (``sizes=[...]`` with
    ``suite=quantizers``, whose sizes are ``+quantizers.sizes``)."""
    allowed = SUITE_OPTIONS[name]
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group.split(".")[0]
        if key not in allowed:
            raise ConfigError(f"bench: option '{key}' is not read by suite '{name}', which "
                              f"reads {', '.join(allowed)}; options of one suite go under its "
                              f"name (e.g. +{name}.{key}=...)")


@hydra.main(version_base="1.3", config_path="../../configs", config_name="bench")
def bench_job(cfg: DictConfig) -> None:
    import_submodules("gracecomm.experiments.bench")
    check_choice(cfg.suite, sorted(SUITES), "bench", "suite")
    check_overrides(cfg.suite, list(HydraConfig.get().overrides.task))
    torch.set_num_threads(int(cfg.get("threads", 1)))  # ratios of single-threaded CPU times
    records = SUITES[cfg.suite](cfg)
    out = os.path.join(HydraConfig.get().runtime.output_dir, "bench.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1, default=float)
    print(format_table(records, cfg.get("columns") or SUITE_COLUMNS[cfg.suite]))
    print(f"\n{len(records)} records written to {out}")


main = guarded(bench_job)  # every composed config checked first (`gracecomm.config.guarded`)

if __name__ == "__main__":
    main()
