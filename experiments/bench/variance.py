"""Suite ``variance``: the second moments the natural-compression paper proves (Horvath et al.,
"Natural Compression for Distributed Deep Learning", Theorems 1 and 4; QSGD's bound for
standard dithering), measured on this library's compressors:

    gracecomm-bench suite=variance
    gracecomm-bench suite=variance +variance.numel=1000000 +variance.draws=20

For each method and input, ``draws`` independent compressions of one seeded vector of
``numel`` elements: the normalised second moment E|C(x)|^2 / |x|^2 (the class B(omega) of the
paper: unbiased with second moment at most omega |x|^2), its spread over the draws, the
normalised variance E|C(x) - x|^2 / |x|^2 (= second moment - 1 for an unbiased C), and the
bound omega each theorem gives. Inputs: a Gaussian vector, and for natural compression the
worst case of its Theorem 1, +-(4/3) 2^k, where the bound 9/8 is attained. Options under
``variance``: ``numel`` (default 100,000, the size of the paper's variance study),
``draws`` (default 100, its box plots' count).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig

from gracecomm.experiments.bench import Record, suite, suite_options
from gracecomm.metrics import Metrics
from gracecomm.registry import COMPRESSORS

# (label, registry name, options, p); p = None for natural compression (Theorem 1)
METHODS: list[tuple[str, str, dict[str, Any], Any]] = [
    ("natural", "natural", {}, None),
    ("natural_dithering s=8", "natural_dithering", {"levels": 8}, 2),
    ("standard_dithering s=8", "standard_dithering", {"levels": 8}, 2),
    ("standard_dithering s=128", "standard_dithering", {"levels": 128}, 2),
    ("natural_dithering s=16 p=inf", "natural_dithering", {"levels": 16, "p": "inf"}, math.inf),
    ("standard_dithering s=16 p=inf", "standard_dithering", {"levels": 16, "p": "inf"},
     math.inf),
]


def omega_bound(name: str, levels: int, p: float | None, d: int) -> float:
    """The second-moment bound: 9/8 for C_nat (Theorem 1); natural dithering with s levels,
    9/8 + d^(1/r) 2^(1-s) min(1, d^(1/r) 2^(1-s)) (Theorem 4, r = min(p, 2)); standard
    dithering with s levels, 1 + d^(1/r)/s min(1, d^(1/r)/s) (QSGD, Alistarh et al. 2017,
    Lemma 3.1, for p = 2; the same form with r = min(p, 2))."""
    if p is None:
        return 9 / 8
    root = d ** (1 / min(p, 2))
    if name == "natural_dithering":
        step = root * 2.0 ** (1 - levels)
        return 9 / 8 + step * min(1.0, step)
    step = root / levels
    return 1 + step * min(1.0, step)


def worst_case(numel: int, seed: int) -> torch.Tensor:
    """+-float32(4/3) 2^k with random signs and k in {-1, 0, 1}: Theorem 1's bound is tight
    there (|t| = (4/3) 2^k, p = 1/3)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(-1, 2, (numel,), generator=gen).double()
    sign = torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * torch.exp2(k) * float(torch.tensor(4 / 3, dtype=torch.float32))).float()


def moments(compressor: Any, x: torch.Tensor, draws: int) -> tuple[float, float, float]:
    """Mean and standard deviation over `draws` compressions of |C(x)|^2 / |x|^2, and the mean
    of |C(x) - x|^2 / |x|^2."""
    compressor.bind(None, Metrics())
    norm = float(x.double().pow(2).sum())
    second, variance = [], []
    for _ in range(draws):
        payload, ctx = compressor.compress(x, "variance")
        out = compressor.decompress(payload, ctx).double()
        second.append(float(out.pow(2).sum()) / norm)
        variance.append(float((out - x.double()).pow(2).sum()) / norm)
    t = torch.tensor(second, dtype=torch.float64)
    return float(t.mean()), float(t.std()) if draws > 1 else 0.0, sum(variance) / draws


@suite("variance")
def run(cfg: DictConfig) -> list[Record]:
    opts = suite_options(cfg, "variance")
    numel, draws = int(opts.get("numel", 100_000)), int(opts.get("draws", 100))
    gaussian = torch.randn(numel, generator=torch.Generator().manual_seed(int(cfg.seed)))
    inputs = [("gaussian", gaussian)]
    records: list[Record] = []
    for label, name, options, p in METHODS:
        data = inputs + ([("(4/3) 2^k", worst_case(numel, int(cfg.seed)))] if p is None else [])
        for source, x in data:
            mean, std, variance = moments(COMPRESSORS.get(name)(**options), x, draws)
            bound = omega_bound(name, options.get("levels", 0), p, numel)
            records.append({"method": label, "data": source, "numel": numel, "draws": draws,
                            "second_moment": mean, "second_moment_std": std,
                            "variance": variance, "omega_bound": bound,
                            "within_bound": mean <= bound + 4 * std / math.sqrt(draws)})
            print(f"{label:>30} {source:>10}: E|C(x)|^2/|x|^2 = {mean:.5f} (sd {std:.5f}), "
                  f"variance {variance:.4f}, bound {bound:.4f}", flush=True)
    return records
