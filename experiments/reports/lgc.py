"""Per-phase report of LGC runs (docs/lgc.md): bytes per rank per step, compression ratios on
both of the bases the comparison needs, the autoencoder's reconstruction, timings, and
accuracy against the dense and DGC runs found next to them; then phase 3 next to the LGC
paper's Table VI.

    python -m gracecomm.experiments.reports.lgc multirun/2026-11-22/10-00-00  # a sweep directory
    python -m gracecomm.experiments.reports.lgc RUN_DIR [RUN_DIR ...] --plot recon.png

Every finished run below the given paths is read
(`gracecomm.experiments.reports.tables.read_run`).
Runs without phases (dense, Top-k, DGC) form one row each. The one-time autoencoder transfer
(``ae_sync_bytes``) is left out of the per-step means and reported on its own.

Two bases (the paper's, Sec. VI and Tables IV and VI, is the second). *Total bytes*, indices
included: ``cr_total`` = dense bytes / bytes sent, and the ratio to plain Top-k on LGC's own
partition (F dense, the same top-k values) at the same steps, with its indices DEFLATE-coded as
LGC codes them or as int32 (``lgc_topk_deflate_nbytes``, ``lgc_topk_int32_nbytes``, logged by
the compressor).
*Values only*, the paper's basis: ``cr_values`` = n / values sent (latent, innovation and
top-k values; neither indices nor the dense first layer), so that plain Top-k is 1/alpha, as
the paper's Sparse GD and DGC rows are. The first layer F goes dense every step (the
specification's partition), so this basis leaves out values every rank does send; the
phase-3 table also gives the ratio counting them, for LGC and for Top-k alike.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

from gracecomm.experiments.reports.tables import Run, load_runs

NAN = float("nan")

# Abrahamyan et al., TNNLS, Table VI (ResNet-50 and ResNet-101 on CIFAR-10, alpha = 0.1%):
# compression ratios (values only), for which Sparse GD and DGC are exactly 1/alpha = 1000x.
PAPER_TABLE_VI = {"lgc_rar": (3193, 2297), "lgc_ps leader": (5709, 8095),
                  "lgc_ps others": (8616, 17000)}
PAPER_TOPK = 1000


def accuracy(run: Run) -> float:
    """The run's final test accuracy (its summary's, else its last evaluation's)."""
    return run.summary.get("test_acc", run.evals[-1].get("test_acc", NAN) if run.evals
                           else NAN)


def run_name(run: Run) -> str:
    """The compressor's name; LGC_PS at the leader's indices and varint index streams are
    marked as such."""
    name = run.summary.get("compressor", run.path.name)
    compressor = run.config.get("compressor", {})
    if compressor.get("indices") == "leader":
        name += " indices=leader"
    if compressor.get("index_coding", {}).get("format", "int32") != "int32":
        name += f" format={compressor['index_coding']['format']}"
    return name


def _mean(steps: Sequence[dict[str, Any]], key: str) -> float:
    values = [s[key] for s in steps if key in s]
    return fmean(values) if values else NAN


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else NAN


def phase_rows(run: Run) -> list[dict[str, Any]]:
    """One row per phase (or one for a run without phases): per-step means of rank 0's
    statistics; for LGC_PS the master's view of the leader's and the others' uplink."""
    name = run_name(run)
    by_phase: dict[int, list[dict[str, Any]]] = {}
    for s in run.steps:
        by_phase.setdefault(int(s.get("lgc_phase", 0)), []).append(s)
    rows = []
    for phase, steps in sorted(by_phase.items()):
        wire = [s["wire_bytes"] - s.get("ae_sync_bytes", 0) for s in steps]
        values = [(s.get("lgc_latent_bytes", 0) + s.get("lgc_innovation_bytes", 0)
                   + s.get("lgc_values_bytes", 0)) / 4 for s in steps]
        led = [w for w, s in zip(wire, steps) if s.get("lgc_is_leader")]
        recon = [s["lgc_recon_loss"] for s in steps if "lgc_recon_loss" in s]
        # phase 2: the last 50 training steps; phase 3 (PS): every step's check at the master
        last = 50 if phase == 2 else len(steps)
        dense = _mean(steps, "dense_bytes")
        rows.append({
            "run": name, "phase": phase or "-", "steps": len(steps),
            "dense_bytes": dense, "wire_bytes": fmean(wire),
            "leader_bytes": (fmean(led) if led else _mean(steps, "lgc_leader_bytes")),
            "others_bytes": _mean(steps, "lgc_others_bytes"),
            "topk_deflate_bytes": _mean(steps, "lgc_topk_deflate_nbytes"),
            "topk_int32_bytes": _mean(steps, "lgc_topk_int32_nbytes"),
            "downlink_bytes": _mean(steps, "downlink_bytes"),
            "cr_values": _ratio(dense / 4, fmean(values)) if phase >= 2 else NAN,
            "cr_values_leader": _ratio(dense / 4, _mean(steps, "lgc_leader_values")),
            "cr_values_others": _ratio(dense / 4, _mean(steps, "lgc_others_values")),
            "first_layer_values": _mean(steps, "lgc_dense_bytes") / 4,
            "ae_ms": 1e3 * _mean(steps, "ae_s"), "step_ms": 1e3 * _mean(steps, "step_s"),
            "index_ms": 1e3 * _mean(steps, "deflate_s"),
            "recon_first": fmean(recon[:20]) if recon else NAN,
            "recon_last": fmean(recon[-50:]) if recon else NAN,
            "rho": fmean([s["lgc_rho"] for s in steps if "lgc_rho" in s][-last:] or [NAN]),
            "rho_innov": fmean([s["lgc_rho_innov"] for s in steps
                                if "lgc_rho_innov" in s][-last:] or [NAN]),
            "ae_sync_bytes": sum(s.get("ae_sync_bytes", 0) for s in steps),
            "worker_cos": _mean(steps, "lgc_worker_cos"),
            "index_overlap": _mean(steps, "lgc_index_overlap"),
            "accuracy": accuracy(run),
        })
    return rows


def fmt(x: float, spec: str = ".0f", unit: str = "") -> str:
    return "-" if math.isnan(x) else format(x, spec) + unit


def _pair(a: float, b: float, spec: str) -> str:
    """``a / b`` (PS leader / others), or `a` alone where there is no second value."""
    return fmt(a, spec) if math.isnan(b) else f"{fmt(a, spec)} / {fmt(b, spec)}"


def phase_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Every run's phases, with accuracy differences to the dense (``none``) and DGC runs."""
    acc = {r["run"]: r["accuracy"] for r in rows if r["phase"] == "-"}
    head = ("| run | phase | steps | bytes/rank/step | PS leader / others (RAR leader) | "
            "cr_total | vs top-k DEFLATE | vs top-k int32 | cr_values (PS leader / others) | "
            "downlink | AE ms | index coding ms | step ms | recon first20 -> last50 | "
            "rho (rho_innov) | "
            "accuracy | vs none | vs dgc |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        recon = (f"{fmt(r['recon_first'], '.1f')} -> {fmt(r['recon_last'], '.1f')}"
                 if not math.isnan(r["recon_first"]) else "-")
        rho = fmt(r["rho"], ".2f") + ("" if math.isnan(r["rho_innov"])
                                      else f" ({fmt(r['rho_innov'], '.2f')})")
        values = (_pair(r["cr_values_leader"], r["cr_values_others"], ".0f")
                  if not math.isnan(r["cr_values_leader"]) else fmt(r["cr_values"]))
        lines.append(
            f"| {r['run']} | {r['phase']} | {r['steps']} | {fmt(r['wire_bytes'])} | "
            f"{_pair(r['leader_bytes'], r['others_bytes'], '.0f')} | "
            f"{fmt(r['dense_bytes'] / r['wire_bytes'], '.1f', 'x')} | "
            f"{fmt(_ratio(r['topk_deflate_bytes'], r['wire_bytes']), '.2f', 'x')} | "
            f"{fmt(_ratio(r['topk_int32_bytes'], r['wire_bytes']), '.2f', 'x')} | {values} | "
            f"{fmt(r['downlink_bytes'])} | {fmt(r['ae_ms'], '.2f')} | "
            f"{fmt(r['index_ms'], '.2f')} | "
            f"{fmt(r['step_ms'], '.1f')} | {recon} | {rho} | {fmt(r['accuracy'], '.4f')} | "
            f"{fmt(100 * (r['accuracy'] - acc.get('none', NAN)), '+.1f')} | "
            f"{fmt(100 * (r['accuracy'] - acc.get('dgc', NAN)), '+.1f')} |")
    return lines


def with_first_layer(cr_values: float, n: float, first_layer_values: float) -> float:
    """A values-only ratio n / v counting the first layer's dense values too."""
    return _ratio(n, _ratio(n, cr_values) + first_layer_values)


def paper_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Phase 3 of every LGC run next to the paper's Table VI, on both bases, per sender."""
    topk_run = next((r["wire_bytes"] for r in rows if r["run"] == "topk"), NAN)
    phase2 = {r["run"]: r for r in rows if r["phase"] == 2}
    lines = ["| run | sender | cr_values | values-only, over Top-k's | paper, over Top-k/DGC "
             "(ResNet-50, ResNet-101) | bytes/step | vs top-k DEFLATE | vs top-k int32 | "
             "vs the topk run | cr_values counting F (over Top-k's) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["phase"] != 3:
            continue
        senders = ([("leader", r["leader_bytes"], r["cr_values_leader"]),
                    ("others", r["others_bytes"], r["cr_values_others"])]
                   if not math.isnan(r["cr_values_leader"])
                   else [("every rank", r["wire_bytes"], r["cr_values"])])
        # plain Top-k's values-only ratio, n / (mu + kappa) (about 1/alpha): the same run's
        # phase 2, which sends exactly the top-k values
        before = phase2.get(r["run"], {"cr_values": NAN, "first_layer_values": NAN})
        topk_values = before["cr_values"]
        n = r["dense_bytes"] / 4
        topk_with_f = with_first_layer(topk_values, n, before["first_layer_values"])
        for sender, nbytes, cr in senders:
            cr_f = with_first_layer(cr, n, r["first_layer_values"])
            key = r["run"] if sender == "every rank" else f"{r['run']} {sender}"
            paper = PAPER_TABLE_VI.get(key)
            lines.append(
                f"| {r['run']} | {sender} | {fmt(cr, '.0f', 'x')} | "
                f"{fmt(_ratio(cr, topk_values), '.2f', 'x')} | "
                + (f"{paper[0] / PAPER_TOPK:.2f}x, {paper[1] / PAPER_TOPK:.2f}x" if paper
                   else "not in the paper") + f" | {fmt(nbytes)} | "
                f"{fmt(_ratio(r['topk_deflate_bytes'], nbytes), '.2f', 'x')} | "
                f"{fmt(_ratio(r['topk_int32_bytes'], nbytes), '.2f', 'x')} | "
                f"{fmt(_ratio(topk_run, nbytes), '.2f', 'x')} | "
                f"{fmt(cr_f, '.0f', 'x')} ({fmt(_ratio(cr_f, topk_with_f), '.2f', 'x')}) |")
    return lines


def report(runs: Sequence[Run]) -> str:
    """The per-phase table, phase 3 next to the paper, the one-time transfers and the
    workers' similarity."""
    rows = [row for run in runs for row in phase_rows(run)]
    lines = phase_table(rows)
    if any(r["phase"] == 3 for r in rows):
        lines += ["", "Phase 3 against the paper's Table VI (its ratios count values only: "
                  "Sparse GD and DGC are 1/alpha, so they leave out the first layer F that "
                  "every rank sends dense; the last column counts F's values for LGC and "
                  "Top-k alike). Bytes include indices; 'top-k DEFLATE' and "
                  "'top-k int32' are plain Top-k on LGC's partition at the same steps; 'the "
                  "topk run' is the sweep's Top-k run (every layer sparsified, int32 indices).",
                  "", *paper_table(rows)]
    syncs = [f"{r['run']}: {r['ae_sync_bytes']:.0f} B" for r in rows if r["ae_sync_bytes"]]
    if syncs:
        lines.append(f"\nOne-time autoencoder transfer (rank 0's share): {', '.join(syncs)}")
    similar = [f"{r['run']}: {r['worker_cos']:.2f} / {r['index_overlap']:.2f}" for r in rows
               if not math.isnan(r["worker_cos"])]
    if similar:
        lines.append(f"\nPhase 2, the workers' top-k vectors (mean over pairs), slot-wise cosine / "
                     f"share of indices in common: {', '.join(similar)}")
    return "\n".join(lines)


def plot_reconstruction(runs: Sequence[Run], path: str) -> None:
    """The reconstruction loss of every LGC run's phase 2, step by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        points = [(s["step"], s["lgc_recon_loss"]) for s in run.steps if "lgc_recon_loss" in s]
        if points:
            ax.plot(*zip(*points), label=run_name(run))
    ax.set_xlabel("step")
    ax.set_ylabel("reconstruction loss (RMS-scaled inputs)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="run or sweep directories")
    parser.add_argument("--plot", help="write the reconstruction-loss curves to this image")
    args = parser.parse_args(argv)
    runs = load_runs(*map(Path, args.paths))
    if not runs:
        raise SystemExit(f"no finished run (metrics.jsonl with a summary) below "
                         f"{', '.join(args.paths)}")
    print(report(runs))
    if args.plot:
        plot_reconstruction(runs, args.plot)


if __name__ == "__main__":
    main()
