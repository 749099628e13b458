"""Per-phase report of LGC runs (docs/lgc.md): bytes per rank per step, compression ratios
against dense and against plain Top-k, the autoencoder's reconstruction loss, timings, and
accuracy against the dense and DGC runs found next to them.

    python -m gracecomm.experiments.lgc_report multirun/2026-11-22/10-00-00          # a sweep directory
    python -m gracecomm.experiments.lgc_report RUN_DIR [RUN_DIR ...] --plot recon.png

Every run directory below the given paths with a ``metrics.jsonl`` is read. Runs without
phases (dense, Top-k, DGC) form one row each. The one-time autoencoder transfer
(``ae_sync_bytes``) is left out of the per-step means and reported on its own.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any


def read_run(run_dir: Path) -> dict[str, Any]:
    """The config, the step records and the summary of one run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = next((r for r in records if r["type"] == "summary"), {})
    config = next((r["config"] for r in records if r["type"] == "config"), {})
    evals = [r for r in records if r["type"] == "eval"]
    return {"dir": run_dir, "config": config, "steps": [r for r in records if r["type"] == "step"],
            "summary": summary, "accuracy": summary.get("test_acc", evals[-1].get("test_acc")
                                                        if evals else float("nan"))}


def run_name(run: dict[str, Any]) -> str:
    """The compressor's name; LGC_PS at the leader's indices is marked as such."""
    name = run["summary"].get("compressor", run["dir"].name)
    if run["config"].get("compressor", {}).get("indices") == "leader":
        name += " indices=leader"
    return name


def _mean(steps: Sequence[dict[str, Any]], key: str) -> float:
    values = [s[key] for s in steps if key in s]
    return fmean(values) if values else float("nan")


def phase_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per phase (or one for a run without phases): per-step means of rank 0's
    statistics; for LGC_PS the master's view of the leader's and the others' uplink."""
    name = run_name(run)
    by_phase: dict[int, list[dict[str, Any]]] = {}
    for s in run["steps"]:
        by_phase.setdefault(int(s.get("lgc_phase", 0)), []).append(s)
    rows = []
    for phase, steps in sorted(by_phase.items()):
        wire = [s["wire_bytes"] - s.get("ae_sync_bytes", 0) for s in steps]
        values = [(s.get("lgc_latent_bytes", 0) + s.get("lgc_innovation_bytes", 0)
                   + s.get("lgc_values_bytes", 0)) / 4 for s in steps]
        led = [w for w, s in zip(wire, steps) if s.get("lgc_is_leader")]
        recon = [s["lgc_recon_loss"] for s in steps if "lgc_recon_loss" in s]
        rows.append({
            "run": name, "phase": phase or "-", "steps": len(steps),
            "dense_bytes": _mean(steps, "dense_bytes"), "wire_bytes": fmean(wire),
            "leader_bytes": (fmean(led) if led else _mean(steps, "lgc_leader_bytes")),
            "others_bytes": _mean(steps, "lgc_others_bytes"),
            "downlink_bytes": _mean(steps, "downlink_bytes"),
            "cr_values": (_mean(steps, "dense_bytes") / 4 / fmean(values)
                          if phase >= 2 and fmean(values) else float("nan")),
            "ae_ms": 1e3 * _mean(steps, "ae_s"), "step_ms": 1e3 * _mean(steps, "step_s"),
            "recon_first": fmean(recon[:20]) if recon else float("nan"),
            "recon_last": fmean(recon[-50:]) if recon else float("nan"),
            "rho_last": fmean([s["lgc_rho"] for s in steps if "lgc_rho" in s][-50:] or [
                float("nan")]),
            "ae_sync_bytes": sum(s.get("ae_sync_bytes", 0) for s in steps),
            "worker_cos": _mean(steps, "lgc_worker_cos"),
            "index_overlap": _mean(steps, "lgc_index_overlap"),
            "accuracy": run["accuracy"],
        })
    return rows


def find_runs(paths: Iterable[str]) -> list[dict[str, Any]]:
    files = sorted({f for p in paths for f in Path(p).rglob("metrics.jsonl")})
    return [read_run(f.parent) for f in files]


def report(runs: Sequence[dict[str, Any]]) -> str:
    """A markdown table of every run's phases; ratios against dense (cr_total), against the
    Top-k run's mean bytes (if one is among `runs`), and accuracy differences to the dense
    (``none``) and DGC runs."""
    rows = [row for run in runs for row in phase_rows(run)]
    ref = {row["run"]: row for row in rows if row["phase"] == "-"}
    topk = ref.get("topk", {}).get("wire_bytes")
    acc = {name: row["accuracy"] for name, row in ref.items()}
    head = ("| run | phase | steps | bytes/rank/step | PS leader / others (RAR leader) | "
            "cr_total | vs top-k | cr_values | downlink | AE ms | step ms | "
            "recon first20 -> last50 (rho) | accuracy | vs none | vs dgc |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def fmt(x: float, spec: str = ".0f") -> str:
        return "-" if x != x else format(x, spec)

    for r in rows:
        leader = (f"{fmt(r['leader_bytes'])} / {fmt(r['others_bytes'])}"
                  if r["leader_bytes"] == r["leader_bytes"] else "-")
        recon = (f"{fmt(r['recon_first'], '.1f')} -> {fmt(r['recon_last'], '.1f')} "
                 f"({fmt(r['rho_last'], '.2f')})" if r["recon_first"] == r["recon_first"] else "-")
        lines.append(
            f"| {r['run']} | {r['phase']} | {r['steps']} | {fmt(r['wire_bytes'])} | {leader} | "
            f"{fmt(r['dense_bytes'] / r['wire_bytes'], '.1f')}x | "
            f"{fmt(topk / r['wire_bytes'] if topk else float('nan'), '.2f')}x | "
            f"{fmt(r['cr_values'], '.0f')} | {fmt(r['downlink_bytes'])} | "
            f"{fmt(r['ae_ms'], '.2f')} | "
            f"{fmt(r['step_ms'], '.1f')} | {recon} | {fmt(r['accuracy'], '.4f')} | "
            f"{fmt(100 * (r['accuracy'] - acc.get('none', float('nan'))), '+.1f')} | "
            f"{fmt(100 * (r['accuracy'] - acc.get('dgc', float('nan'))), '+.1f')} |")
    syncs = [f"{r['run']}: {r['ae_sync_bytes']:.0f} B" for r in rows if r["ae_sync_bytes"]]
    if syncs:
        lines.append(f"\nOne-time autoencoder transfer (rank 0's share): {', '.join(syncs)}")
    similar = [f"{r['run']}: {r['worker_cos']:.2f} / {r['index_overlap']:.2f}" for r in rows
               if r["worker_cos"] == r["worker_cos"]]
    if similar:
        lines.append(f"\nPhase 2, the workers' top-k vectors (mean over pairs), slot-wise cosine / "
                     f"share of indices in common: {', '.join(similar)}")
    return "\n".join(lines)


def plot_reconstruction(runs: Sequence[dict[str, Any]], path: str) -> None:
    """The reconstruction loss of every LGC run's phase 2, step by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        points = [(s["step"], s["lgc_recon_loss"]) for s in run["steps"] if "lgc_recon_loss" in s]
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
    runs = find_runs(args.paths)
    if not runs:
        raise SystemExit(f"no metrics.jsonl below {', '.join(args.paths)}")
    print(report(runs))
    if args.plot:
        plot_reconstruction(runs, args.plot)


if __name__ == "__main__":
    main()
