"""Entry point of the micro-benchmarks (see `gracecomm.experiments.bench`)."""

from __future__ import annotations

import json
import os

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from grace.plugins import import_submodules
from grace.validation import check_choice
from gracecomm.experiments.bench import SUITES
from gracecomm.experiments.bench.table import format_table


@hydra.main(version_base="1.3", config_path="../../configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    import_submodules("gracecomm.experiments.bench")
    check_choice(cfg.suite, sorted(SUITES), "bench", "suite")
    torch.set_num_threads(int(cfg.get("threads", 1)))  # ratios of single-threaded CPU times
    records = SUITES[cfg.suite](cfg)
    out = os.path.join(HydraConfig.get().runtime.output_dir, "bench.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1, default=float)
    print(format_table(records, cfg.get("columns")))
    print(f"\n{len(records)} records written to {out}")


if __name__ == "__main__":
    main()
