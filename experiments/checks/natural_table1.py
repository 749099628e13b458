"""Table 1 of *Natural Compression for Distributed Deep Learning* (Horvath et al. 2019): the
speedup of compressed distributed SGD over uncompressed, 32 d / (bits per iteration x T'),
with T' = omega^theta the relative number of iterations (theta = 1: few workers, the lower
end; theta = 0: many workers, the upper end), d = 10^6, q = d / 10, p = 2,
kappa = min(1, sqrt(d) 2^(1-s)), and the dithering parameter s chosen at each end to maximise
the speedup.

Columns per row: the paper's printed range, the literal recomputation of the paper's
formulas, and the same speedups from the bits per iteration *measured* from the payloads of
this library's compressors on a d-element tensor. The sparsifying rows (S_q, C_nat o S_q)
are measured with their indices packed in ceil(log2 d) bits each (DeepReduce's ``packed``
index codec applied to Top-k's indices: 32 + 20 bits per kept value at d = 10^6, against the
paper's 33 + log2 d), and in a second column as the ``topk`` compressor sends them, int32.

    python -m gracecomm.experiments.checks.natural_table1            # d = 10^6
    python -m gracecomm.experiments.checks.natural_table1 --d 100000
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gracecomm.compressor import Compressor
from gracecomm.compressors.compose import Compose
from gracecomm.compressors.deepreduce import PackedIndex
from gracecomm.compressors.dithering import NaturalDithering, StandardDithering
from gracecomm.compressors.natural import Natural
from gracecomm.compressors.none import NoneCompressor
from gracecomm.compressors.topk import TopK
from gracecomm.wire import payload_nbytes

PAPER = {"Baseline": "1", "C_nat": "3.2-3.6", "S_q": "0.6-6.0", "C_nat o S_q": "1.0-10.7",
         "D_sta": "1.8-15.9", "D_nat": "4.1-16.0"}
S_RANGE = range(1, 17)  # dithering parameter s searched at each end (standard: 2^(s-1) levels)


@dataclass(frozen=True)
class Row:
    approach: str
    paper: str
    literal: tuple[float, float]   # (theta = 1, theta = 0)
    literal_s: tuple[int, int]     # dithering s at each end (0: no s)
    measured: tuple[float, float]
    measured_s: tuple[int, int]
    measured_bits: tuple[float, float]  # bits per iteration at each end
    measured_int32: tuple[float, float] | None = None  # sparsifying rows with int32 indices


def kappa(d: int, s: int) -> float:
    return min(1.0, math.sqrt(d) * 2.0 ** (1 - s))


def omega(approach: str, d: int, q: int, s: int) -> float:
    """Second-moment factor of each approach (Table 1's T' with theta = 1)."""
    if approach.startswith("D_"):
        base = 1.0 if approach == "D_sta" else 9 / 8
        return base + kappa(d, s) * math.sqrt(d) * 2.0 ** (1 - s)
    return {"Baseline": 1.0, "C_nat": 9 / 8, "S_q": d / q, "C_nat o S_q": 9 * d / (8 * q)}[approach]


def paper_bits(approach: str, d: int, q: int, s: int) -> float:
    """Bits per iteration as printed in Table 1."""
    if approach == "D_sta":
        return 31 + d * (2 + s)
    if approach == "D_nat":
        return 31 + d * (2 + math.log2(s))
    return {"Baseline": 32 * d, "C_nat": 9 * d, "S_q": (33 + math.log2(d)) * q,
            "C_nat o S_q": (10 + math.log2(d)) * q}[approach]


def compressor_for(approach: str, d: int, q: int, s: int) -> Compressor:
    """This library's implementation of each approach (dithering with p = 2, whole tensor)."""
    if approach == "Baseline":
        return NoneCompressor()
    if approach == "C_nat":
        return Natural()
    if approach == "S_q":
        return TopK(q / d)
    if approach == "C_nat o S_q":
        return Compose([TopK(q / d), Natural()])
    if approach == "D_sta":
        return StandardDithering(levels=2 ** (s - 1))
    return NaturalDithering(levels=s)


def measured_bits(approach: str, x: torch.Tensor, q: int, s: int, packed: bool = True) -> float:
    """Bits of the approach's payload for `x`; with `packed`, int32 index tensors re-encoded
    in ceil(log2 d) bits per index (DeepReduce's packed codec)."""
    payload, _ = compressor_for(approach, x.numel(), q, s).compress(x, "table1")
    if packed:
        payload = tuple(PackedIndex().pack(t.long(), x.numel()) if t.dtype == torch.int32
                        else t for t in payload)
    return 8.0 * payload_nbytes(payload)


def best_speedup(approach: str, d: int, q: int, theta: int,
                 bits: Callable[[int], float]) -> tuple[float, int]:
    """Largest speedup over s (dithering) at one end, with the s that reaches it."""
    choices = S_RANGE if approach.startswith("D_") else [0]
    return max((32 * d / (bits(s) * omega(approach, d, q, s) ** theta), s) for s in choices)


def table1(d: int = 10**6, seed: int = 0) -> list[Row]:
    q = d // 10
    x = torch.randn(d, generator=torch.Generator().manual_seed(seed))
    rows = []
    for approach, printed in PAPER.items():
        lit = [best_speedup(approach, d, q, theta, lambda s, a=approach: paper_bits(a, d, q, s))
               for theta in (1, 0)]
        bits = functools.cache(functools.partial(measured_bits, approach, x, q))
        meas = [best_speedup(approach, d, q, theta, bits) for theta in (1, 0)]
        int32 = None
        if "S_q" in approach:
            wide = functools.partial(measured_bits, approach, x, q, packed=False)
            int32 = tuple(best_speedup(approach, d, q, theta, wide)[0] for theta in (1, 0))
        rows.append(Row(approach, printed, (lit[0][0], lit[1][0]), (lit[0][1], lit[1][1]),
                        (meas[0][0], meas[1][0]), (meas[0][1], meas[1][1]),
                        (bits(meas[0][1]), bits(meas[1][1])), int32))
    return rows


def format_rows(rows: list[Row], d: int) -> str:
    lines = [f"Table 1 (d = {d}, q = d/10, p = 2): speedup over the uncompressed baseline, "
             "theta = 1 .. theta = 0",
             f"{'approach':<12} {'paper':>10} {'literal recomputation':>28} "
             f"{'measured from payloads':>28} {'measured bits/iteration':>26} "
             f"{'measured, int32 indices':>24}"]
    for r in rows:
        s_lit = f" (s={r.literal_s[0]}..{r.literal_s[1]})" if r.literal_s[0] else ""
        s_meas = f" (s={r.measured_s[0]}..{r.measured_s[1]})" if r.measured_s[0] else ""
        lines.append(f"{r.approach:<12} {r.paper:>10} "
                     f"{f'{r.literal[0]:.2f}-{r.literal[1]:.2f}{s_lit}':>28} "
                     f"{f'{r.measured[0]:.2f}-{r.measured[1]:.2f}{s_meas}':>28} "
                     f"{f'{r.measured_bits[0]:.4g} .. {r.measured_bits[1]:.4g}':>26} "
                     + (f"{f'{r.measured_int32[0]:.2f}-{r.measured_int32[1]:.2f}':>24}"
                        if r.measured_int32 else f"{'-':>24}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=10**6, help="dimension (default 10^6)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(format_rows(table1(args.d, args.seed), args.d))


if __name__ == "__main__":
    main()
