"""DeepReduce's tables: Fig. 10 and the thesis's bits-per-index rows (suite deepreduce_fig10),
and the Bloom filter's targets (suite deepreduce)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from render import Context

Record = dict[str, Any]


def percent(x: float | None, digits: int = 3) -> str:
    if x is None or math.isnan(x):
        return "-"
    return "0" if x == 0 else f"{100 * x:.{digits}g}%"


def fig10(ctx: Context) -> str:
    """Fig. 10's combinations on one ResNet-20 layer: volumes relative to the dense tensor."""
    body = []
    for r in ctx.step("bench_fig10").json():
        if "index_vs_dense" not in r:
            continue  # the thesis rows
        per = "-" if r["per"] is None or math.isnan(r["per"]) else f"{r['per']:.3g}"
        body.append([r["method"], *(percent(r[k]) for k in ("index_vs_dense", "value_vs_dense",
                                                             "mapping_vs_dense",
                                                             "total_vs_dense")),
                     f"{r['vs_topk']:.3f}", f"{r['rel_error']:.3g}", per,
                     f"{1e3 * r['compress_s']:.2f}", "" if r["paper"] == "-" else r["paper"]])
    return ctx.table(["method", "index / dense", "value / dense", "mapping / dense",
                      "total / dense", "vs Top-r", "rel. error", "PER", "compress ms",
                      "paper (text)"], body)


def fig10_thesis(ctx: Context) -> str:
    """The thesis's Tables 2-5 rows next to ours on the same gradient."""
    body = []
    for r in ctx.step("bench_fig10").json():
        if "final_over_initial" not in r:
            continue
        formula = r.get("m_over_r (formula)")
        body.append([r["method"], "-" if formula is None else f"{formula:.4g}",
                     f"{r['bits_per_index (measured)']:.4g}",
                     percent(r["final_over_initial"], 4),
                     percent(r["thesis_final_over_initial"], 4), percent(r["per"]),
                     percent(r["thesis_per"]), r.get("note") or ""])
    return ctx.table(["method", "m/r (formula)", "bits / index (measured)", "Final/Initial",
                      "thesis", "PER", "thesis PER", "note"], body)


def bloom_targets(ctx: Context) -> str:
    """The targets the deepreduce suite checks, from its records: Bloom P0 (numba kernels,
    and the torch code without its position table) against pybloom-live on the same index
    set, its index bytes, and the curve fits' containers."""
    by = {r["method"]: r for r in ctx.step("bench_deepreduce").json()}
    p0, torch0 = by["bloom-p0 numba kernels"], by["bloom-p0 torch, table_slices=0"]
    pybloom = by["bloom-p0 pybloom-live"]
    poly, dexp = by["raw32 + polyfit"], by["raw32 + dexp"]
    r = round(p0["payload_bytes"] / p0["index_vs_int32"] / 4)
    return ctx.table(["target", "measured"], [
        [f"Bloom P0 (fpr 0.001, d = {p0['numel']:,}, r = {p0['ratio']:.0%}) encode + decode "
         "vs pybloom-live on the same index set, >= 50x",
         f"{p0['compress_s'] + p0['decompress_s']:.3f} s vs "
         f"{pybloom['compress_s'] + pybloom['decompress_s']:.2f} s: "
         f"**{p0['speedup_vs_pybloom']:.0f}x** ({torch0['speedup_vs_pybloom']:.1f}x in torch "
         "code without the position table, `kernel: python`)"],
        ["Bloom P0 (fpr 0.001) index bytes <= 50% of int32",
         f"{p0['payload_bytes']:,} of {4 * r:,} bytes: **{100 * p0['index_vs_int32']:.1f}%** "
         f"({8 * p0['payload_bytes'] / r:.1f} bits per index)"],
        [f"Fit-Poly container <= 65% of Top-1%'s 8r bytes (Laplace, {poly['numel']:,} elements)",
         f"**{100 * poly['vs_topk']:.1f}%**, relative error {100 * poly['rel_error']:.1f}%"],
        ["Fit-DExp container <= 55% of Top-1%'s 8r bytes",
         f"**{100 * dexp['vs_topk']:.1f}%**, relative error {100 * dexp['rel_error']:.1f}%"]])


RENDERERS = {"fig10": fig10, "fig10_thesis": fig10_thesis, "bloom_targets": bloom_targets}
