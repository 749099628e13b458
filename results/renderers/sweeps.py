"""Tables of the training sweeps (results/STEP/report.csv, written by gracecomm-report at the
end of each `gracecomm-train -m` sweep) and of the scripts that read those sweeps."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from statistics import fmean
from typing import TYPE_CHECKING

from gracecomm.experiments.training.summary import format_bytes, format_summary

if TYPE_CHECKING:
    from render import Context

Row = dict[str, str]


def parse_call(text: str) -> tuple[str, dict[str, str]]:
    """``'topk(ratio=0.01, seed=0)'`` -> ``('topk', {'ratio': '0.01', 'seed': '0'})``."""
    match = re.fullmatch(r"([^(]+)(?:\((.*)\))?", text)
    options = dict(part.split("=", 1) for part in match[2].split(", ")) if match[2] else {}
    return match[1], options


def call(name: str, options: dict[str, str]) -> str:
    return f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})" if options else name


def parse_options(text: str) -> dict[str, str]:
    """The report's ``options`` column (``'trainer.lr=0.05, seed=0'``)."""
    return dict(part.split("=", 1) for part in text.split(", ")) if text else {}


def number(text: str) -> float:
    return float(text) if text else float("nan")


def pct(text: str) -> str:
    return f"{100 * number(text):.2f}"


def times(text: str) -> str:
    return "-" if not text else f"{number(text):.2f}x"


def ms(text: str) -> str:
    return "-" if not text else f"{number(text):.2f}"


def nbytes(text: str) -> str:
    return "-" if not text else format_bytes(number(text))


def speedups(row: Row) -> list[str]:
    return [times(row[f"speedup@{net}"]) for net in ("0.1Gbps", "1Gbps", "10Gbps")]


SPEEDUP_HEAD = ["speedup@0.1Gbps", "speedup@1Gbps", "speedup@10Gbps"]


def grace_benchmark(ctx: Context) -> str:
    """Every compressor on ResNet-20; each labelled with the trainer options in which its run
    differs from most runs of the sweep (a preset's own lr or momentum)."""
    rows = ctx.step("grace_benchmark").csv()
    options = [parse_options(r["options"]) for r in rows]
    usual = {k: Counter(o[k] for o in options).most_common(1)[0][0] for k in options[0]}
    body = []
    for row, opts in zip(rows, options):
        own = [f"{k.rsplit('.', 1)[-1]} {float(v):g}" for k, v in opts.items() if v != usual[k]]
        name = parse_call(row["compressor"])[0] + (f" ({', '.join(own)})" if own else "")
        body.append([name, pct(row["test_acc"]), nbytes(row["wire_bytes/step"]),
                     times(row["compression_factor"]), ms(row["overhead_ms/step"]),
                     *speedups(row)])
    return ctx.table(["method", "test_acc", "wire_bytes/step", "compression factor",
                      "overhead_ms/step", *SPEEDUP_HEAD], body)


def sidco(ctx: Context) -> str:
    """The LSTM sweep at 1% and 0.1%; the dense run appears once (the sweep runs it at both
    densities, identically)."""
    body, seen = [], set()
    for row in ctx.step("sidco").csv():
        name, opts = parse_call(row["compressor"])
        if name == "none":
            if name in seen:
                continue
            label = "none (dense)"
        else:
            escape = opts.pop("adapt.escape", "False") == "True"
            label = call(name, opts)[:-1] + ", escape)" if escape else call(name, opts)
        seen.add(name)
        body.append([label, f"{number(row['test_ppl']):.1f}", nbytes(row["wire_bytes/step"]),
                     ms(row["overhead_ms/step"]), row["k_hat/k"] and f"{number(row['k_hat/k']):.3g}"
                     or "-", *speedups(row)])
    return ctx.table(["compressor", "test_ppl", "wire_bytes/step", "overhead_ms/step", "k_hat/k",
                      *SPEEDUP_HEAD], body)


def natural(ctx: Context) -> str:
    """Means over the sweep's seeds, per method (the compressor without its seed)."""
    groups: dict[str, list[Row]] = {}
    for row in ctx.step("natural").csv():
        name, opts = parse_call(row["compressor"])
        opts = {k: v for k, v in opts.items() if not k.endswith("seed")}
        label = ("compose(topk 1%, natural)" if name == "compose" else call(name, opts))
        groups.setdefault(label, []).append(row)
    body = []
    for label, rows in groups.items():
        acc = [100 * number(r["test_acc"]) for r in rows]
        body.append([label, f"{fmean(acc):.2f}", f"{min(acc):.2f}-{max(acc):.2f}",
                     nbytes(rows[0]["wire_bytes/step"]), times(rows[0]["compression_factor"]),
                     f"{fmean(number(r['overhead_ms/step']) for r in rows):.2f}"])
    seeds = {len(rows) for rows in groups.values()}
    return ctx.table(["method", f"test_acc (mean of {'/'.join(map(str, seeds))} seeds)",
                      "min-max", "bytes/step", "compression factor", "overhead ms/step"], body)


def deepreduce_label(compressor: str) -> str:
    """DeepReduce runs as DR(...) without the sparsifier every run of the sweep shares."""
    name, opts = parse_call(compressor)
    if name != "deepreduce":
        return "none (dense)" if name == "none" else compressor
    sparsifier = opts.pop("sparsifier")
    opts = {k: v for k, v in opts.items() if not k.startswith("sparsifier.")}
    return call("DR", opts if sparsifier == "TopK" else {"sparsifier": sparsifier, **opts})


SECTIONS = ["index_bytes/step", "value_bytes/step", "mapping_bytes/step"]


def deepreduce(ctx: Context) -> str:
    body = [[deepreduce_label(r["compressor"]), pct(r["test_acc"]), nbytes(r["wire_bytes/step"]),
             *(nbytes(r[k]) for k in (*SECTIONS, "header_bytes/step")), ms(r["overhead_ms/step"])]
            for r in ctx.step("deepreduce").csv()]
    return ctx.table(["compressor", "test_acc", "wire_bytes/step", *SECTIONS,
                      "header_bytes/step", "overhead_ms/step"], body)


SPARSE_LABELS = {"threshold(threshold=1e-30)": "nonzeros (threshold 1e-30)"}


def sparse_label(compressor: str) -> str:
    name, opts = parse_call(compressor)
    if name == "deepreduce" and opts.pop("sparsifier") == "NonZero":
        return call("DR", {"nonzeros": "", **opts}).replace("nonzeros=", "nonzeros")
    return SPARSE_LABELS.get(compressor, "none (dense)" if name == "none" else compressor)


def sparse_model(ctx: Context) -> str:
    body = [[sparse_label(r["compressor"]), f"{number(r['test_hr@10']):.4f}",
             nbytes(r["wire_bytes/step"]), times(r["compression_factor"]),
             *(nbytes(r[k]) for k in SECTIONS), ms(r["overhead_ms/step"]), *speedups(r)]
            for r in ctx.step("sparse_model").csv()]
    return ctx.table(["compressor", "test_hr@10", "wire_bytes/step", "compression factor",
                      *SECTIONS, "overhead_ms/step", *SPEEDUP_HEAD], body)


# DeepReduce's Table 2 (NCF on MovieLens-20M; Kostopoulou et al., DeepReduce,
# arXiv:2102.03112, Sec. 6.3): data volume relative to dense
# and hit rate against the baseline, per policy and value codec.
PAPER_TABLE2 = {("p0", "QSGDValues", "0.6"): ("DR^QSGD_BF-P0 (fpr 0.6)", 0.206, "-0.0001"),
                ("p2", "PolyFitValues", "0.01"): ("DR^Fit-Poly_BF-P2 (fpr 0.01)", 0.588, "+0.002")}


def sparse_model_paper(ctx: Context) -> str:
    rows = ctx.step("sparse_model").csv()
    dense = next(r for r in rows if r["compressor"] == "none")
    body = []
    for r in rows:
        name, opts = parse_call(r["compressor"])
        key = (opts.get("index.policy"), opts.get("value"), opts.get("index.fpr"))
        if name == "deepreduce" and key in PAPER_TABLE2:
            label, volume, hit = PAPER_TABLE2[key]
            ours = number(r["wire_bytes/step"]) / number(dense["wire_bytes/step"])
            diff = number(r["test_hr@10"]) - number(dense["test_hr@10"])
            body.append([label, f"{volume:.3f}", f"{ours:.3f}", hit, f"{diff:+.3f}"])
    return ctx.table(["", "paper: volume", "ours: volume", "paper: hit rate vs baseline",
                      "ours: hit@10 vs dense"], body)


def deepreduce_fpr(ctx: Context) -> str:
    """Bytes (and accuracy) per Bloom policy and false-positive rate."""
    grid: dict[str, dict[str, str]] = {}
    for r in ctx.step("deepreduce_fpr").csv():
        opts = parse_call(r["compressor"])[1]
        grid.setdefault(opts["index.policy"], {})[opts["index.fpr"]] = (
            f"{nbytes(r['wire_bytes/step'])} ({100 * number(r['test_acc']):.1f})")
    fprs = list(next(iter(grid.values())))
    return ctx.table(["policy", *(f"fpr {f}" for f in fprs)],
                     [[policy, *(cells[f] for f in fprs)] for policy, cells in grid.items()])


def every_method(ctx: Context, *names: str) -> str:
    """Every compressor by name at each seed of the sweep (or only `names`): what it brings,
    the training defaults it declares, test accuracy per seed (bold below 0.95) and the
    compression factor of seed 0."""
    runs: dict[str, list[Row]] = {}
    for r in ctx.step("every_method").csv():
        name = parse_call(r["compressor"])[0]
        if not names or name in names:
            runs.setdefault(name, []).append(r)
    rows = next(iter(runs.values()))
    seeds = [parse_options(r["options"])["seed"] for r in rows]
    options = [parse_options(r["options"]) for group in runs.values() for r in group]
    usual = {k: Counter(o[k] for o in options).most_common(1)[0][0] for k in options[0]
             if k.startswith("trainer.")}
    body = []
    for name, group in sorted(runs.items()):
        opts = parse_options(group[0]["options"])
        own = [f"{k.rsplit('.', 1)[-1]} {float(opts[k]):g}" for k in usual
               if opts[k] != usual[k]]
        acc = [number(r["test_acc"]) for r in group]
        body.append([f"`{name}`", f"{group[0]['memory']} / {group[0]['communicator']}",
                     ", ".join(own) or "-",
                     *(f"**{a:.4f}**" if a < 0.95 else f"{a:.4f}" for a in acc),
                     f"{number(group[0]['compression_factor']):.1f}x"])
    return ctx.table(["`compressor=`", "brings", "trains with (its defaults)",
                      *(f"seed {s}" for s in seeds), f"bytes ratio (seed {seeds[0]})"], body)


# The lines of a printed summary that hold times (and speedups, which come from times), and
# what in them is a timing: decimals, except the bandwidths (0.1Gbps) and the compression
# factor the last line starts with.
TIMED_LINES = ("compression / step", "communication / step", "projected speedup",
               "measured speedup", "per-step figures")
TIMING = re.compile(r"\d+\.\d+(?![\d.]*Gbps)")


def masked(line: str) -> str:
    """`line` of a printed summary with its timings as '…' (its bytes and metric kept)."""
    label = line.strip()
    if label.startswith("metrics "):
        return re.sub(r"\S+/metrics\.jsonl", "…/metrics.jsonl", line)
    if label.startswith("== compression bought") and "; " in line:
        head, tail = line.split("; ", 1)
        return f"{head}; {TIMING.sub('…', tail)}"
    if label.startswith(TIMED_LINES):
        return TIMING.sub("…", line)
    return line


def summary(ctx: Context, step: str, name: str, *lines: str) -> str:
    """What `gracecomm-train` printed at the end of the run stored as results/STEP/NAME.json
    (its summary.json), through the trainer's own `format_summary`, with the timings as '…'
    (they depend on the CPU and its load; the bytes and the test metric do not). LINES: only
    the lines that start with these labels ('==' for the first); an argument that starts
    with '$ ' is the command shown before the output (a console block)."""
    prompt = [a for a in lines if a.startswith("$ ")]
    labels = tuple(a for a in lines if not a.startswith("$ "))
    text = format_summary(ctx.step(step).json(f"{name}.json"), "…")
    out = [masked(line) for line in text.splitlines()
           if not labels or line.strip().startswith(labels)]
    return "\n".join(["```console" if prompt else "```text", *prompt, *out, "```"])


def sparse_zeros(ctx: Context) -> str:
    """The share of the sparse_model gradient's entries that are zero, from the bytes of
    sending only its nonzeros (8 per entry: value and int32 index) against dense (4)."""
    rows = {parse_call(r["compressor"])[0]: r for r in ctx.step("sparse_model").csv()}
    nonzeros = number(rows["threshold"]["wire_bytes/step"]) / 8
    return f"{1 - nonzeros / (number(rows['none']['wire_bytes/step']) / 4):.0%}"


def grid(ctx: Context, step: str, name: str, rows: str, columns: str) -> str:
    """The final test metric of a sweep's runs (results/runs.py's records in
    results/STEP/NAME.json), one row per value of the override `rows`, one column per
    combination of the overrides `columns` (comma-separated; '-': one column); a run that
    collapsed says so, and a combination the sweep did not run is '-'."""
    runs = ctx.step(step).json(f"{name}.json")
    keys = [] if columns == "-" else columns.split(",")

    def label(run: dict) -> tuple:
        return tuple(run.get(k) for k in keys)

    cols = list(dict.fromkeys(label(r) for r in runs))
    body = []
    for value in dict.fromkeys(r.get(rows) for r in runs):
        by = {label(r): r for r in runs if r.get(rows) == value}
        cells = []
        for col in cols:
            run = by.get(col)
            cells.append("-" if run is None else f"{run['final']:.3f}"
                         + (" (collapsed)" if run["collapse"] else ""))
        body.append([f"{value:g}" if isinstance(value, float) else str(value), *cells])
    heads = [", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in zip(keys, col)) or runs[0]["metric"] for col in cols]
    return ctx.table([rows, *heads], body)


def series_blocks(ctx: Context, step: str, name: str, field: str, size: str) -> str:
    """For every run of results/STEP/NAME.json (results/runs.py's records with the per-step
    series `field`): the means of `field` over consecutive blocks of `size` steps (the last
    may be shorter), and its mean over the run."""
    n, body = int(size), []
    for run in ctx.step(step).json(f"{name}.json"):
        series = [x for x in run[field] if x is not None]
        parts = [series[i:i + n] for i in range(0, len(series), n)]
        body.append([run["run"], " ".join(f"{fmean(p):.2f}" for p in parts),
                     f"{fmean(series):.2f}"])
    return ctx.table(["run", f"{field}, means over blocks of {n} steps",
                      f"{field}, mean over the run"], body)


def stored(step: str, name: str, code: bool = False) -> Callable[[Context], str]:
    """What a step's script printed (`name` in results/STEP/), as printed; in a code block
    for plain text."""

    def render(ctx: Context) -> str:
        text = ctx.step(step).text(name).strip("\n")
        return f"```text\n{text}\n```" if code else text

    render.__doc__ = f"results/{step}/{name}, as the step printed it."
    return render


RENDERERS = {
    "grace_benchmark": grace_benchmark,
    "sidco": sidco,
    "natural": natural,
    "deepreduce": deepreduce,
    "sparse_model": sparse_model,
    "sparse_model_paper": sparse_model_paper,
    "deepreduce_fpr": deepreduce_fpr,
    "every_method": every_method,
    "summary": summary,
    "grid": grid,
    "series_blocks": series_blocks,
    "sparse_zeros": sparse_zeros,
    "long_run_memory": stored("long_run", "memory.md"),
    "lgc_phases": stored("lgc", "phases.md"),
    "lgc_bound": stored("lgc", "bound.md"),
    "sidco_bound": stored("sidco_bound", "output.md"),
    "natural_table1": stored("natural_table1", "output.txt", code=True),
}
