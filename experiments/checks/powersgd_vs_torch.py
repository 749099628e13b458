"""This library's PowerSGD next to PyTorch's own DDP hook
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``) and uncompressed training,
through the same training loop (`gracecomm.experiments.training`; the default experiment unless
overridden), PyTorch's hook with ``trainer.exchange=torch``:

    python -m gracecomm.experiments.checks.powersgd_vs_torch            # rank 2, 2 workers
    python -m gracecomm.experiments.checks.powersgd_vs_torch --rank 4 trainer.epochs=3 model=mlp

Both PowerSGD runs use PyTorch's settings (the presets ``powersgd_parity`` and
``torch_powersgd``: ``start_iter`` 2, two dense steps first, error feedback against the mean
over ranks, warm start, the same seed), so at rank 2 they train to
the same bits (tests/test_powersgd_parity.py). Bytes per step are payload bytes per rank: for
this library what its communicators count, for PyTorch's hook the tensors it hands to
``dist.all_reduce``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from gracecomm.experiments import presets
from gracecomm.experiments.reports.tables import read_run
from gracecomm.experiments.training.config import compose_config
from gracecomm.experiments.training.launch import spawn
from gracecomm.experiments.training.worker import train_worker

MODES = {  # mode -> the method preset it trains (configs/method/)
    "none": "dense",
    "gracecomm": "powersgd_parity",
    "torch hook": "torch_powersgd",
}


def compare(overrides: list[str], r: int = 2,
            modes: tuple[str, ...] = tuple(MODES)) -> list[dict[str, Any]]:
    """Train each of `modes` with the training config plus `overrides`; their summaries."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            cfg = compose_config(*presets.overrides(MODES[mode]),
                                 *([f"compressor.rank={r}"] if mode != "none" else []),
                                 "trainer.progress=false", *overrides)
            run_dir = Path(tmp) / mode.replace(" ", "_")
            run_dir.mkdir()
            spawn(train_worker, int(cfg.trainer.world_size),
                  OmegaConf.to_container(cfg, resolve=True), str(run_dir), None,
                  timeout_s=float(cfg.trainer.timeout_s))
            summary = json.loads((run_dir / "summary.json").read_text())
            run = read_run(run_dir)
            if run is None:
                raise RuntimeError(f"{mode}: the run wrote no summary (it did not finish)")
            later = [rec["wire_bytes"] for rec in run.steps if rec["step"] > 2]
            results.append({"mode": mode, **summary,
                            "bytes_per_compressed_step": sum(later) / max(1, len(later))})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD rank r (default 2)")
    parser.add_argument("overrides", nargs="*",
                        help="training config overrides, e.g. trainer.epochs=3")
    args = parser.parse_args(argv)
    rows = compare(args.overrides, args.rank)
    metric = rows[0]["metric"]
    print(f"{'mode':<11} {'steps':>6} {metric:>10} {'bytes/step':>12} "
          f"{'bytes/compressed step':>22}")
    for row in rows:
        print(f"{row['mode']:<11} {row['steps']:>6} {row[metric]:>10.4f} "
              f"{row['wire_bytes_per_step']:>12.0f} {row['bytes_per_compressed_step']:>22.0f}")


if __name__ == "__main__":
    main()
