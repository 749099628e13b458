"""Tables of the micro-benchmarks (results/STEP/*.json: the records gracecomm-bench and
gracecomm-netbench write) and of the other measuring scripts."""

from __future__ import annotations

import math
from statistics import median
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from render import Context

Record = dict[str, Any]


def g3(x: Any) -> str:
    """Three significant digits; '-' where the record has none."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def f(spec: str, x: Any, unit: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else (
        f"{x:{spec}}{unit}")


def sidco_bench(ctx: Context) -> str:
    """The compressors suite on 26M elements: time, estimation quality, reads and
    torch.topk ratios, every record."""
    body = [[r["method"], r["dist"], f"{r['ratio']:g}", f(".1f", 1e3 * r["compress_s"]),
             g3(r["quality"]), g3(r["quality_first"]), g3(r["quality_first10"]),
             r["stages"] if r["stages"] is not None else "-", g3(r["x_read"]),
             g3(r["x_read_total"]), g3(r["topk_speedup"]), g3(r["topk_speedup_total"])]
            for r in ctx.step("bench_sidco").json()]
    return ctx.table(["method", "data", "ratio", "compress ms", "k_hat/k (2nd half)",
                      "k_hat/k (first call)", "k_hat/k (first 10)", "stages", "x one read",
                      "x one read, with decompress", "x faster than torch.topk",
                      "same, with decompress"], body)


DISTS = {"laplace": "Laplace", "student_t": "Student-t(3)", "gaussian": "Gaussian"}
SPEED_ROWS = [("laplace", 0.001, "topk", "Top-k (exact)"), ("laplace", 0.001, "sidco_e", "SIDCo-E"),
              ("laplace", 0.001, "sidco_gamma_gp", "SIDCo-gamma-GP"),
              ("laplace", 0.001, "dgc", "DGC"), ("laplace", 0.01, "sidco_e", "SIDCo-E"),
              ("laplace", 0.01, "dgc", "DGC"), ("student_t", 0.001, "sidco_e", "SIDCo-E"),
              ("student_t", 0.001, "dgc", "DGC")]


def sidco_speed(ctx: Context) -> str:
    """The methods docs/sparsifiers.md compares, from the same records."""
    by = {(r["dist"], r["ratio"], r["method"]): r for r in ctx.step("bench_sidco").json()}
    body = []
    for dist, ratio, method, label in SPEED_ROWS:
        r = by[(dist, ratio, method)]
        quality = f"{r['quality']:.3f}" + (f" (M = {r['stages']})" if r["stages"] else "")
        body.append([f"{DISTS[dist]}, {ratio:g}", label, f(".1f", 1e3 * r["compress_s"], " ms"),
                     f(".1f", r["x_read"]), f(".1f", r["x_read_total"]),
                     f(".1f", r["topk_speedup"]), f(".1f", r["topk_speedup_total"]), quality])
    return ctx.table(["data, ratio", "method", "compress", "× read", "× read, with decompress",
                      "× faster than `torch.topk`", "same, with decompress", "k̂/k"], body)


def quantizers(ctx: Context, name: str = "bench.json") -> str:
    """The quantizers suite: compress + decompress of one 26M-element tensor, next to one
    read of it timed just before (`name`: bench.json with the numba kernels,
    torch_paths.json without)."""
    body = [[f"`{r['method']}`", f(".1f", 1e3 * r["total_s"], " ms"),
             f(".1f", r["x_read_total"], "x"), f(".3f", r["bits_per_element"])]
            for r in ctx.step("bench_quantizers").json(name)]
    return ctx.table(["method", "compress + decompress", "vs one `t.sum()`", "bits/element"],
                     body)


QUALITY_DISTS = {"laplace": "Laplace", "gaussian": "Gaussian", "student_t": "Student-t(3)",
                 "grad:ResNet20": "ResNet-20 gradients"}
QUALITY_METHODS = ("sidco_e", "sidco_gp", "dgc", "redsync", "gaussiank")


def sidco_quality(ctx: Context, ratio: str = "0.001") -> str:
    """Estimation quality k_hat/k at one ratio, every source and size of the default run:
    the first call -> the mean of the second half of the calls, and
    SIDCo's final number of stages."""
    by = {(r["dist"], r["numel"], r["method"]): r for r in ctx.step("bench_quality").json()
          if math.isclose(r["ratio"], float(ratio))}
    cases = sorted({(d, n) for d, n, _ in by}, key=lambda c: (list(QUALITY_DISTS).index(c[0]),
                                                               -c[1]))
    body = []
    for dist, numel in cases:
        cells = []
        for method in QUALITY_METHODS:
            r = by[(dist, numel, method)]
            cells.append(f"{r['quality_first']:.3g} → {r['quality']:.3f} ({r['stages']})"
                         if method.startswith("sidco") else f"{r['quality']:.3f}")
        body.append([QUALITY_DISTS[dist], f"{numel / 1e6:.2g}M", *cells])
    return ctx.table([f"data, ratio {ratio}", "size", "SIDCo-E first → adapted (M)",
                      "SIDCo-GP first → adapted (M)", "DGC", "RedSync", "GaussianKSGD"], body)


RECEIVE_LABELS = {"signsgd": "`signsgd` (majority vote)"}


def receive(ctx: Context) -> str:
    """Each quantizer's cost of one more rank on the receiving side."""
    body = [[RECEIVE_LABELS.get(r["method"], f"`{r['method']}`"), f(".2f", r["x_read_total"]),
             f(".1f", 1e3 * r["decompress_s"]), f(".2f", r["receive_x_read"])]
            for r in ctx.step("bench_receive").json()]
    return ctx.table(["method", "compress + decompress, x one read", "decompress ms",
                      "per extra rank, x one read"], body)


# The targets of the hook's own cost (results page, section 7): field, limit, what it means.
# ``none`` is the name runs before the method presets gave the dense hook.
HOOK_TARGETS = {**dict.fromkeys(("dense", "none"),
                                ("over_ddp_ms", 1.5, "at most +1.5 ms over plain DDP")),
                "fp16": ("over_torch_ms", 1.5, "at most PyTorch's + 1.5 ms"),
                **dict.fromkeys(("powersgd", "powersgd_parity"),
                                ("x_torch", 1.5, "at most 1.5x PyTorch's added cost"))}
HOOK_RUNS = ("run1", "run2", "run3")


def hook_runs(ctx: Context) -> dict[str, list[Record]]:
    """Each method's records over the step's runs. PowerSGD with its own defaults has no
    PyTorch twin (`torch_powersgd` runs the `powersgd_parity` settings); its added cost is
    set against `torch_powersgd`'s in the same run (``x_torch``), as the hook's own cost."""
    step = ctx.step("hook")
    by: dict[str, list[Record]] = {}
    for run in HOOK_RUNS:
        records = {r["method"]: r for r in step.json(f"{run}.json")}
        twin = records.get("torch_powersgd", {}).get("over_ddp_ms")
        for method, r in records.items():
            if method == "powersgd" and "x_torch" not in r and twin:
                r = {**r, "x_torch": r["over_ddp_ms"] / twin}
            by.setdefault(method, []).append(r)
    return by


def hook(ctx: Context) -> str:
    """CPU time per step in every run, and the medians the targets are judged on."""
    body = []
    for method, runs in hook_runs(ctx).items():
        added = [r.get("over_ddp_ms") for r in runs]
        torch_ = [r.get("over_torch_ms") for r in runs]
        ratio = [r.get("x_torch") for r in runs]
        cells = [f"`{method}`", " / ".join(f"{r['cpu_ms']:.2f}" for r in runs),
                 "-" if method == "ddp" else f(("+.2f"), median(added), " ms"),
                 f("+.2f", median(torch_), " ms") if None not in torch_ else "-",
                 f(".2f", median(ratio), "x") if None not in ratio else "-"]
        target = HOOK_TARGETS.get(method)
        if target:
            field, limit, what = target
            value = median(r[field] for r in runs if r.get(field) is not None)
            cells.append(f"{what}: {'met' if value <= limit else 'missed'}")
        else:
            cells.append("")
        body.append(cells)
    return ctx.table(["method", "CPU ms per step, runs 1 / 2 / 3", "over plain DDP (median)",
                      "over PyTorch's hook (median)", "added cost over PyTorch's (median)",
                      "target"], body)


def variance(ctx: Context) -> str:
    """The second moments and variances of the natural-compression suite, against the
    values expected from Horváth et al., *Natural Compression for Distributed Deep Learning*
    (arXiv:1905.10988), Theorems 1 and 4 (Sec. 3.1 and 4)."""
    expected = {("natural", "(4/3) 2^k"): "1.1250 ± 0.0025", ("natural", "gaussian"): "1.0818",
                ("natural_dithering s=8", "gaussian"): "variance 0.99",
                ("standard_dithering s=8", "gaussian"): "variance 30.5",
                ("standard_dithering s=128", "gaussian"): "variance 0.99",
                ("natural_dithering s=16 p=inf", "gaussian"): "variance 0.081",
                ("standard_dithering s=16 p=inf", "gaussian"): "variance 0.013"}
    data = {"gaussian": "Gaussian", "(4/3) 2^k": "(4/3)·2^k, the worst case"}
    body = [[r["method"].replace(" s=", ", s = ").replace(" p=", ", p = "), data[r["data"]],
             f"{r['second_moment']:.4g} ({r['second_moment_std']:.2g})",
             f"{r['omega_bound']:.4g}", f"{r['variance']:.3g}",
             expected[(r["method"], r["data"])]]
            for r in ctx.step("variance").json()]
    return ctx.table(["method", "data", "second moment (sd over draws)", "bound ω", "variance",
                      "expected (Horváth et al., Sec. 3.1 and 4)"], body)


GRACE_LABELS = {"topk 0.01": "topk 1%", "topk 0.001": "topk 0.1%", "randomk 0.01": "randomk 1%",
                "randomk 0.001": "randomk 0.1%", "dgc 0.01": "dgc 1%", "dgc 0.001": "dgc 0.1%",
                "threshold": "threshold (2.0)", "qsgd": "qsgd (127 levels, buckets of 128)"}


def grace_reference(ctx: Context) -> str:
    """Every method GRACE implements that times on its own, ours against GRACE's."""
    body = [[GRACE_LABELS.get(r["method"], r["method"]), f(".1f", 1e3 * r["total_s"], " ms"),
             g3(r["x_read_total"]), g3(r["bits_per_element"]),
             f(".1f", 1e3 * r["grace_total_s"], " ms"), g3(r["grace_x_read_total"]),
             g3(r["grace_bits_per_element"]), f(".1f", r["x_faster_than_grace"], "x")]
            for r in ctx.step("grace_reference").json()
            if r["method"] != "none" and r.get("skipped") is None]
    return ctx.table(["method", "ours: compress + decompress", "x one read", "bits/element",
                      "GRACE's", "x one read", "bits/element", "ours faster"], body)


def grace_dgc(ctx: Context) -> str:
    """DGC against Top-k in GRACE's code and in ours, from the same run."""
    by = {r["method"]: r for r in ctx.step("grace_reference").json()}
    ratios = ("0.01", "0.001")

    def cells(key: str, field: str, spec: str, against: str | None = None) -> list[str]:
        out = []
        for ratio in ratios:
            t = by[f"{key} {ratio}"][field]
            text = f"{1e3 * t:{spec}} ms"
            if against:
                base = by[f"{against} {ratio}"][field]
                text += (f" ({base / t:.1f}x faster than its Top-k)" if t < base
                         else f" ({t / base:.1f}x slower than our Top-k)")
            out.append(text)
        return out

    return ctx.table(["", "1%", "0.1%"], [
        ["GRACE's Top-k (`torch.topk`)", *cells("topk", "grace_total_s", ".0f")],
        ["GRACE's DGC", *cells("dgc", "grace_total_s", ".0f", "topk")],
        ["our Top-k (exact: sampled threshold, fused pass, exact pick)",
         *cells("topk", "total_s", ".1f")],
        ["our DGC", *cells("dgc", "total_s", ".1f", "topk")]])


def _netbench(ctx: Context, name: str) -> dict[str, Record]:
    return {r["method"]: r for r in ctx.step("netbench").json(f"{name}.json")["runs"]}


def _step(r: Record) -> str:
    low, high = r["round_step_s"]
    return f"{1e3 * r['step_s']:.1f} ({1e3 * low:.1f}-{1e3 * high:.1f})"


def netbench(ctx: Context) -> str:
    """Measured against projected speedups at 100 Mbit/s and 1 Gbit/s."""
    slow, fast = _netbench(ctx, "100mbit"), _netbench(ctx, "1000mbit")
    body = [[f"`{m}`", _step(r), f"{r['measured_speedup']:.2f}x",
             f"{r['projected_speedup']:.2f}x", _step(fast[m]),
             f"{fast[m]['measured_speedup']:.2f}x", f"{fast[m]['projected_speedup']:.2f}x"]
            for m, r in slow.items()]
    return ctx.table(["method", "100 Mbit/s ms (rounds)", "measured", "projected",
                      "1 Gbit/s ms (rounds)", "measured", "projected"], body)


def netbench_buckets(ctx: Context) -> str:
    """Each asynchronous method next to its synchronous variant, with several buckets."""
    runs = _netbench(ctx, "buckets")
    body = []
    for m, r in runs.items():
        if m.endswith("_sync"):
            continue
        sync = runs.get(f"{m}_sync")
        if sync is None:
            body.append([f"`{m}`", _step(r), "", f"{r['measured_speedup']:.2f}x",
                         f"{r['projected_speedup']:.2f}x"])
        else:
            body.append([f"`{m}` / `{m}_sync`", f"{_step(r)} / {_step(sync)}",
                         f"{r['step_s'] / sync['step_s']:.2f}",
                         f"{r['measured_speedup']:.2f}x / {sync['measured_speedup']:.2f}x",
                         f"{r['projected_speedup']:.2f}x / {sync['projected_speedup']:.2f}x"])
    return ctx.table(["method", "step ms (rounds)", "asynchronous / synchronous", "measured",
                      "projected"], body)


BENCH_STEP_RUNS = ("run1", "run2")


def bench_step(ctx: Context) -> str:
    """One whole pipeline step of each method with its default memory, world of one, 26M
    elements, in reads of the tensor, next to compress + decompress alone; both runs."""
    if note := ctx.pending("bench_step"):
        return note
    step = ctx.step("bench_step")
    runs = [{r["method"]: r for r in step.json(f"{run}.json")} for run in BENCH_STEP_RUNS]
    body = [[f"`{m}`", *(" / ".join(f(".1f", run[m][k]) for run in runs)
                         for k in ("x_read_total", "step_x_read", "receive_x_read"))]
            for m in runs[0]]
    return ctx.table(["method", "compress + decompress, x one read (runs 1 / 2)",
                      "whole step with its memory, x one read", "per extra rank, x one read"],
                     body)


BUFFER_ROUNDS = ("1", "2")


def bench_buffers(ctx: Context) -> str:
    """Decompression into fresh pages (recycling off) and into recycled buffers, both
    rounds."""
    if note := ctx.pending("bench_buffers"):
        return note
    step = ctx.step("bench_buffers")
    fresh = [{r["method"]: r for r in step.json(f"fresh{i}.json")} for i in BUFFER_ROUNDS]
    kept = [{r["method"]: r for r in step.json(f"recycled{i}.json")} for i in BUFFER_ROUNDS]
    body = [[f"`{m}`", " / ".join(f(".1f", 1e3 * run[m]["decompress_s"]) for run in fresh),
             " / ".join(f(".1f", 1e3 * run[m]["decompress_s"]) for run in kept),
             f(".1f", min(run[m]["decompress_s"] for run in fresh)
               / min(run[m]["decompress_s"] for run in kept), "x")]
            for m in fresh[0]]
    return ctx.table(["method", "decompress, fresh pages, ms (rounds 1 / 2)",
                      "recycled buffers, ms", "fresh / recycled (best of each)"], body)


def powersgd_vs_torch(ctx: Context) -> str:
    """The comparison table the script prints last."""
    lines = ctx.step("powersgd_vs_torch").text("output.txt").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    return "```text\n" + "\n".join(lines[start:]).rstrip() + "\n```"


RENDERERS = {
    "bench_sidco": sidco_bench,
    "sidco_speed": sidco_speed,
    "bench_receive": receive,
    "sidco_quality": sidco_quality,
    "quantizers": quantizers,
    "hook": hook,
    "variance": variance,
    "grace_reference": grace_reference,
    "grace_dgc": grace_dgc,
    "netbench": netbench,
    "netbench_buckets": netbench_buckets,
    "powersgd_vs_torch": powersgd_vs_torch,
    "bench_step": bench_step,
    "bench_buffers": bench_buffers,
}
