"""How far can LGC's autoencoder lower the reconstruction loss on the experiment's top-k
vectors? Records the phase-2 training vectors of an ``lgc_rar`` run of ``+experiment=lgc``
and compares the autoencoder's rho = |x_hat - x|^2 / |x|^2 with the best *linear* codes of
the same size, fitted on the first half of the steps and scored on the second:

- block PCA B -> B/4: the optimal linear transform of B consecutive entries into B/4
  coefficients, translation-invariant like the convolutional encoder (4 latent channels per
  16 inputs, so the same 4x bottleneck);
- the same bound on i.i.d. Gaussian vectors (1 - 1/4 = 0.75: nothing to exploit).

    python results/lgc_bound.py                                  # ~40 s on 2 CPU cores
    python results/lgc_bound.py model=resnet20 data.noise=4      # a network with batch norm
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gracecomm.compressors.lgc.base import SCALE_EPS
from gracecomm.compressors.lgc.layout import Plan
from gracecomm.compressors.lgc.rar import LGCRar
from gracecomm.experiments.reports.tables import read_run

REPO = Path(__file__).resolve().parent.parent


class RecordingRar(LGCRar):
    """LGC_RAR that also saves its phase-2 autoencoder inputs (T x K x mu, unscaled) to
    `record` once phase 2 ends."""

    def __init__(self, record: str, **options: Any) -> None:
        super().__init__(**options)
        self.record, self.vectors = record, []

    def train(self, plan: Plan, topk: torch.Tensor) -> None:
        self.vectors.append(topk.detach().float().cpu().clone())
        if len(self.vectors) == self.ae_train_iters:
            torch.save(torch.stack(self.vectors), self.record)
        super().train(plan, topk)


def targets(vectors: torch.Tensor) -> torch.Tensor:
    """The RAR training targets x_t = mean_k g~_k / s_t with s_t = mean_k RMS(g~_k) + 1e-12,
    as `LGCRar.train` scales them."""
    scale = LGCRar.rms(vectors).mean(1, keepdim=True) + SCALE_EPS
    return (vectors / scale).mean(1).double()


def block_pca_rho(x: torch.Tensor, block: int, keep: int) -> float:
    """rho of the best rank-`keep` linear code of `block` consecutive entries, fitted on the
    first half of the rows (steps) and scored on the second."""
    n = x.shape[1] // block * block
    half = x.shape[0] // 2
    fit = x[:half, :n].reshape(-1, block)
    test = x[half:, :n].reshape(-1, block)
    _, vecs = torch.linalg.eigh(fit.T @ fit)
    basis = vecs[:, -keep:]
    err = test - test @ basis @ basis.T
    return float(err.pow(2).sum() / test.pow(2).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="training steps (phases 1+2)")
    parser.add_argument("overrides", nargs="*", help="more gracecomm-train overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "vectors.pt"
        run = Path(tmp) / "run"
        command = [sys.executable, "-m", "gracecomm.experiments.training", "+experiment=lgc",
                   "+method=lgc_rar", "allow_any_target=true", "trainer.progress=false",
                   "compressor._target_=results.lgc_bound.RecordingRar",
                   f"+compressor.record={record}", f"trainer.max_steps={args.steps}",
                   f"hydra.run.dir={run}", *args.overrides]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the recording run failed:\n{done.stderr[-4000:]}")
        if not record.exists():
            sys.exit(f"phase 2 did not end within --steps {args.steps}: raise it to the "
                     "run's warmup_iters + ae_train_iters")
        x = targets(torch.load(record))
        recorded = read_run(run)
        if recorded is None:
            sys.exit(f"the recording run in {run} wrote no summary")
        rho = [s["lgc_rho"] for s in recorded.steps if "lgc_rho" in s]
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    a, b = x[:, :-1], x[:, 1:]
    print(f"{x.shape[0]} phase-2 vectors of mu = {x.shape[1]}; neighbour correlation "
          f"{float((a * b).sum() / (a.pow(2).sum() * b.pow(2).sum()).sqrt()):.3f}, kurtosis "
          f"{float(x.pow(4).mean() / x.pow(2).mean() ** 2):.2f} (Gaussian 3)")
    print()  # a table follows a blank line (Markdown)
    print("| code (4x bottleneck) | rho, top-k vectors | rho, i.i.d. Gaussian |")
    print("|---|---|---|")
    print(f"| LGC autoencoder, first 20 / last 50 steps | {sum(rho[:20]) / 20:.3f} / "
          f"{sum(rho[-50:]) / 50:.3f} | - |")
    for block in (b for b in (16, 64, 256) if b <= x.shape[1]):
        print(f"| block PCA {block} -> {block // 4} | {block_pca_rho(x, block, block // 4):.3f} "
              f"| {block_pca_rho(noise, block, block // 4):.3f} |")


if __name__ == "__main__":
    main()
