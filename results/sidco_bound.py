"""How close can SIDCo-E come to one read of the tensor? On heavy-tailed data its first stage
(an exponential fitted to every magnitude, keeping delta_1 = 0.25 of them: 004, Sec. 3) keeps
a large share, and each later stage must sum the exceedances of the threshold before it.
This times, in one process on one thread (best of --repeats, the operations interleaved),
what any exact implementation must do before its third stage can set a threshold, in three
ways, next to one read (``t.sum()``):

- (a) stage 1 and stage 2 as passes over the tensor, then the exceedances of stage 2's
  threshold collected into the pool the later stages read, summed as they are collected;
- (b) stage 1 as a pass, then the exceedances of stage 1's threshold collected and summed,
  then filtered to stage 2's threshold and summed again (what the library does);
- (c) as (b), but with stage 1's sums taken in the collecting pass, stage 1's threshold
  given in advance: the best that collecting on a guessed threshold could reach;

and decompression of the compressor's payload, and SIDCo-E itself (compression and
decompression, with the stages it chose). The cheapest way plus decompression is a floor
for SIDCo-E: its remaining stages and the final positions come on top.

    python results/sidco_bound.py                          # 26M Student-t(3), ratio 0.001
    python results/sidco_bound.py --data laplace --ratio 0.01
"""

from __future__ import annotations

import argparse

import numba
import numpy as np
import torch

from gracecomm.compressors.shared import exceedance
from gracecomm.compressors.shared import exceedance_kernels as kernels
from gracecomm.compressors.sidco import SIDCo
from gracecomm.experiments.bench.compressors import synthetic
from gracecomm.experiments.bench.timing import best_of_each


@numba.njit(cache=True)
def one_pass(keys, floats, mask, top, lo, span, offsets, raw, bounds, counts, written,
             values, sums_lo, sums, totals):  # pragma: no cover - compiled
    """Stages 1 and 2 in one pass over the chunks: each chunk's hits collected into its
    slot of the pool and summed there (as `Pool.collect` does), then the chunk summed
    whole while it is in cache (as `exceedance.moments` does)."""
    for c in range(counts.size):
        kernels._fill_chunk(keys, mask, top, lo, span, c, offsets, raw, bounds, counts,
                            written, values, sums_lo, sums)
        kernels._moments_chunk(floats, 0.0, c, totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="student_t", help="laplace, gaussian, student_t[:dof]")
    parser.add_argument("--numel", type=int, default=26_214_400)
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = synthetic(args.data, args.numel, 0)
    sidco = SIDCo(args.ratio, backend="numba")
    payload, ctx = sidco.compress(x, "x")  # compiles the kernels and settles the stages
    stages = sidco.adapter("x").stages
    if stages < 3:
        raise SystemExit(f"SIDCo-E uses {stages} stage(s) on this data: the bound is for three "
                         "or more (heavy tails)")
    first = exceedance.moments(x, 0.0, "numba")
    eta1 = exceedance.rounded(sidco.first_threshold(first, sidco.first_stage_ratio), x.dtype)
    exceed = exceedance.moments(x, eta1, "numba")
    density = args.ratio * args.numel / first.count
    rho = (density / sidco.first_stage_ratio) ** (1.0 / max(1, stages - 1))
    eta2 = exceedance.rounded(eta1 + sidco.tail_threshold(sidco.later_model, exceed, rho),
                              x.dtype)
    above2 = exceedance.above(eta2, x.dtype)
    share2 = exceedance.moments(x, eta2, "numba").count
    lay, keys = exceedance.layout(x), exceedance._key_view(x)
    lo1, lo2 = (exceedance.threshold_key(t, x.dtype) for t in (eta1, above2))
    chunks = -(-args.numel // kernels.CHUNK)
    bounds = kernels.slot_bounds(  # sized as `Pool.collect` sizes them
        np.full(chunks, 2 * exceed.count * kernels.CHUNK // args.numel + 16))
    offsets, raw = np.empty(bounds[-1], np.int32), np.empty(bounds[-1], np.int32)
    counts, written = np.zeros(chunks, np.int64), np.zeros(chunks, np.int64)
    values, sums = raw.view(np.float32), np.zeros((chunks, 3))

    def plan_a() -> None:
        exceedance.moments(x, 0.0, "numba")
        exceedance.moments(x, eta1, "numba")
        exceedance.Pool.collect(x, above2, "numba", share2, eta2)

    def plan_b() -> None:
        exceedance.moments(x, 0.0, "numba")
        exceedance.Pool.collect(x, eta1, "numba", exceed.count, eta1).keep(above2, eta2)

    def fused() -> None:
        one_pass(keys, x.numpy(), lay.mask, lay.top, lo1, lay.inf - lo1, offsets, raw, bounds,
                 counts, written, values, eta1, sums, np.zeros((chunks, 3)))

    def plan_c() -> None:
        fused()
        kernels.keep(offsets, raw, bounds, counts, lay.mask, lay.top, lo2, lay.inf - lo2,
                     False, values, eta2, sums)

    def sidco_whole() -> None:
        sidco.decompress(*sidco.compress(x, "x"))

    rows = [("one read (t.sum())", lambda: x.sum()),
            ("(a) passes for stages 1 and 2, pool at stage 2's threshold", plan_a),
            ("(b) a pass for stage 1, pool at stage 1's threshold, filtered", plan_b),
            ("(c) as (b), stage 1 in the collecting pass, its threshold given", plan_c),
            ("decompression", lambda: sidco.decompress(payload, ctx)),
            ("SIDCo-E, compression and decompression", sidco_whole)]
    fused()
    if (written < counts).any():  # the slots are not refilled here: they must hold every hit
        raise SystemExit("a chunk held more than twice its share of stage 1's exceedances; "
                         "the one-pass bound (c) needs data without clusters")
    times = best_of_each([fn for _, fn in rows], args.repeats)
    read = times[0]
    print(f"{args.data}, {args.numel} elements, ratio {args.ratio}: stage 1 keeps "
          f"{exceed.count / args.numel:.1%}, stage 2 "
          f"{share2 / args.numel:.1%}; SIDCo-E used {stages} "
          f"stages, k_hat/k {payload[0].numel() / max(1, round(args.ratio * args.numel)):.3f}")
    print()  # a table follows a blank line (Markdown)
    print("| operation | ms | reads of the tensor |")
    print("|---|---|---|")
    for (label, _), seconds in zip(rows, times):
        print(f"| {label} | {seconds * 1e3:.2f} | {seconds / read:.2f} |")
    floor = min(times[1:4]) + times[4]
    print(f"| floor: the cheapest of (a)-(c) and decompression | {floor * 1e3:.2f} | "
          f"{floor / read:.2f} |")


if __name__ == "__main__":
    main()
