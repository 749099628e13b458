"""LGC's phase 3 against plain Top-k: in training (step lgc_phase3, lgc_report's table), without
the model (suite lgc, step bench_lgc) and on a shaped link (step netbench_lgc)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from render import Context


def lgc_phase3(ctx: Context) -> str:
    """Phase 3 of the 800-step runs, int32 and varint index streams, and the Top-k run."""
    rows = ctx.step("lgc_phase3").tables("phases.md")[0]
    body = [[r["run"], r["step ms"], r["AE ms"], r["index coding ms"],
             f"{r['bytes/rank/step']} ({r['PS leader / others (RAR leader)']})"
             if r["PS leader / others (RAR leader)"] != "-" else r["bytes/rank/step"]]
            for r in rows if r["phase"] in ("3", "-")]
    return ctx.table(["run", "phase-3 ms/step", "AE ms", "index coding ms",
                      "bytes/rank/step (RAR leader)"], body)


def bench_lgc(ctx: Context) -> str:
    """Top-k's step and LGC's phase-3 steps, int32 and varint index streams."""
    step = ctx.step("bench_lgc")
    body = []
    for coding in ("int32", "varint"):
        for r in step.json(f"{coding}.json"):
            if r["method"] == "topk" and coding != "int32" or "phase 2" in r["method"]:
                continue
            label = r["method"] if r["method"] == "topk" else f"{r['method']}, {coding}"
            body.append([label, *(f"{1e3 * r[k]:.1f}" if r[k] else "-"
                                  for k in ("step_s", "compress_s", "decompress_s", "ae_s",
                                            "deflate_s")), f"{r['payload_bytes']:,.0f}"])
    return ctx.table(["method", "step ms", "compress ms", "decompress ms", "AE ms",
                      "DEFLATE ms", "payload B"], body)


def netbench_lgc(ctx: Context) -> str:
    """Top-1% and LGC-RAR's phase 3 on a shaped link, per step."""
    step = ctx.step("netbench_lgc")
    body = []
    for name in ("100mbit", "10mbit"):
        data = step.json(f"{name}.json")
        by = {r["method"]: r for r in data["runs"]}
        top, lgc = by["topk"], by["lgc_rar"]
        body.append([f"{data['bandwidth_mbps']:g} Mbit/s", f"{1e3 * top['step_s']:.1f}",
                     f"{1e3 * lgc['step_s']:.1f}", f"{top['wire_bytes'] / 1e3:.1f}",
                     f"{lgc['wire_bytes'] / 1e3:.1f}"])
    return ctx.table(["link", "Top-1% ms/step", "LGC-RAR ms/step", "Top-1% KB/step",
                      "LGC-RAR KB/step"], body)


RENDERERS = {"lgc_phase3": lgc_phase3, "bench_lgc": bench_lgc, "netbench_lgc": netbench_lgc}
