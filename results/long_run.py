"""Compression state and peak memory over a long sweep: one markdown row per run, from the
``state_bytes`` (tensor bytes of ``Grace.state_dict()``) and ``max_rss_mb`` (peak resident
memory of rank 0) that every evaluation record of ``gracecomm.experiments.training`` carries.

    python results/long_run.py multirun/results/long_run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row(run: Path) -> str | None:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("type") == "eval"]
    if not evals:
        return None
    state = [e["state_bytes"] for e in evals]
    rss = [e["max_rss_mb"] for e in evals]
    tenth = rss[min(9, len(rss) - 1)]
    return (f"| {run.name} | {evals[-1]['step']} | {state[0]:,} | {state[-1]:,} | "
            f"{len(set(state))} | {rss[0]:.1f} | {tenth:.1f} | {rss[-1]:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path,
                        help="a multirun directory of gracecomm.experiments.training")
    sweep = parser.parse_args().sweep
    runs = sorted((p for p in sweep.iterdir() if (p / "metrics.jsonl").exists()),
                  key=lambda p: int(p.name.split("_", 1)[0]))
    print("| run | steps | state bytes, first eval | state bytes, last eval | distinct sizes "
          "| peak RSS MB, first eval | after 10 evals | last eval |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        if (line := row(run)) is not None:
            print(line)


if __name__ == "__main__":
    main()
