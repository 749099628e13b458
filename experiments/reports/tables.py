"""A sweep's runs as a table: every finished run under a directory (`load_runs`), the
columns that tell them apart (`describe`: the method with the options that vary, memory,
communicator), and the report's rows (`build_table`) as Markdown and CSV."""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from gracecomm.configstore import generated
from gracecomm.experiments.training.config import CONFIG_DIR
from gracecomm.experiments.training.summary import format_bytes

# method_defaults.*: the trainer options a run took from its compressor (the trainer options
# themselves are shown)
HIDDEN_OPTIONS = re.compile(
    r"^(logger|hydra|method_defaults|trainer\.(progress|timeout_s|collective_timeout_s))\b")
STANDARD_BYTES = {"dense_bytes", "wire_bytes", "sent_bytes", "downlink_bytes"}
ALWAYS_SHOWN = ("ratio", "fpr")  # the fraction kept by a sparsifier; a Bloom filter's rate


@dataclass
class Run:
    """One training run as its JSONL tells it (the last attempt, if the file was reused)."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    def step_mean(self, key: str) -> float | None:
        values = [s[key] for s in self.steps if isinstance(s.get(key), (int, float))]
        return sum(values) / len(values) if values else None


def _natural(path: Path) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(path))]


def read_run(run_dir: Path) -> Run | None:
    """The run whose ``metrics.jsonl`` is in `run_dir`, as its last attempt tells it (an
    attempt that reuses the file starts again at its config record); None if that attempt
    wrote no summary (it did not finish). The one reader of run files."""
    config: dict[str, Any] = {}
    summary: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        kind = record.get("type")
        if kind == "config":
            config, summary, steps, evals = record["config"], None, [], []
        elif kind == "step":
            steps.append(record)
        elif kind == "eval":
            evals.append(record)
        elif kind == "summary":
            summary = record
    return None if summary is None else Run(Path(run_dir), config, summary, steps, evals)


def load_runs(*roots: Path) -> list[Run]:
    """Every finished run under `roots` (runs without a summary record are skipped with a
    note on stderr), in natural order of their directories."""
    runs = []
    paths = {p for root in roots for p in Path(root).rglob("metrics.jsonl")}
    for path in sorted(paths, key=_natural):
        run = read_run(path.parent)
        if run is None:
            print(f"report: skipping {path.parent} (no summary: the run did not finish)",
                  file=sys.stderr)
            continue
        runs.append(run)
    return runs


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(node, list) and any(isinstance(v, dict) for v in node):  # a list of parts
        return flatten({str(i): v for i, v in enumerate(node)}, prefix)
    return {prefix: tuple(node) if isinstance(node, list) else node}


PARTS = ("compressor", "memory", "communicator")


def _varies(key: str, flats: Sequence[dict[str, Any]]) -> bool:
    return len({repr(f.get(key)) for f in flats}) > 1


def varies_among(key: str, flats: Sequence[dict[str, Any]]) -> bool:
    """Whether `key` differs among the runs that have it (a nested part's options count only
    among the runs that use that part)."""
    return _varies(key, [f for f in flats if key in f])


def varying_options(flats: Sequence[dict[str, Any]]) -> list[str]:
    """The config keys outside the compressor, memory and communicator that differ across the
    runs (logging and timeouts left out)."""
    keys = dict.fromkeys(k for f in flats for k in f)
    return [k for k in keys if not k.startswith(tuple(f"{p}." for p in PARTS))
            and not HIDDEN_OPTIONS.match(k) and _varies(k, flats)]


def option_text(key: str, value: Any) -> str:
    if key.endswith("_target_"):  # a nested part: show its class
        return f"{key.rsplit('.', 1)[0] or key}={str(value).rsplit('.', 1)[-1]}"
    return f"{key}={value}"


def _yaml_options(part: str, name: str) -> dict[str, Any]:
    """The literal options of config group entry PART=NAME (what the user gets by
    default): ``configs/PART/NAME.yaml``, else the entry generated from the class."""
    path = CONFIG_DIR / part / f"{name}.yaml"
    if path.exists():
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    else:
        node = generated(part, name) or {}
    node.pop("defaults", None)
    return {k: v for k, v in flatten(node).items() if not (isinstance(v, str) and "${" in v)}


def describe(runs: Sequence[Run]) -> list[dict[str, str]]:
    """For each run: its compressor, memory and communicator, each with its key options
    (``ratio``, the classes of nested parts, options that differ from the part's YAML file or
    vary among runs of the same name), and the other config options that vary across the
    runs (logging and timeouts left out)."""
    flats = [flatten(r.config) for r in runs]
    rest = varying_options(flats)
    out = []
    for run, flat in zip(runs, flats):
        row: dict[str, str] = {}
        for part in PARTS:
            name = run.summary.get(part, "?")
            peers = [f for r, f in zip(runs, flats) if r.summary.get(part) == name]
            defaults = _yaml_options(part, name)
            shown = []
            for key, value in flat.items():
                option = key[len(part) + 1:]
                if not key.startswith(f"{part}.") or option == "_target_":
                    continue
                if (option.rsplit(".", 1)[-1] in ALWAYS_SHOWN or option.endswith("._target_")
                        or defaults.get(option, value) != value or varies_among(key, peers)):
                    shown.append(option_text(option, value))
            row[part] = f"{name}({', '.join(shown)})" if shown else name
        row["options"] = ", ".join(option_text(k, flat.get(k)) for k in rest)
        out.append(row)
    return out


@dataclass
class Table:
    """Rows of the report, with the metric columns and network labels they hold."""

    rows: list[dict[str, Any]]
    metrics: list[str]
    networks: list[str]


def build_table(runs: Sequence[Run]) -> Table:
    """One row per run (numbers unformatted)."""
    metrics = list(dict.fromkeys(r.summary.get("metric", "test_acc") for r in runs))
    networks = list(dict.fromkeys(k.split("@", 1)[1] for r in runs for k in r.summary
                                  if k.startswith("speedup@")))
    extras = list(dict.fromkeys(
        k for r in runs for s in r.steps for k in s
        if (k.endswith("_bytes") and k not in STANDARD_BYTES and not k.startswith("coll_"))
        or k == "quality"))
    rows = []
    for run, names in zip(runs, describe(runs)):
        s = run.summary
        row: dict[str, Any] = {"run": str(run.path.name), **names}
        for metric in metrics:
            row[metric] = s.get(metric) if s.get("metric", "test_acc") == metric else None
        row.update({"steps": s.get("steps"), "wire_bytes/step": s.get("wire_bytes_per_step"),
                    "compression_factor": s.get("compression_factor")})
        if s.get("downlink_bytes_per_step"):  # a parameter server: both directions
            row.update({"downlink_bytes/step": s["downlink_bytes_per_step"],
                        "compression_factor_down": s.get("compression_factor_down")})
        row.update({"overhead_ms/step": 1e3 * s.get("overhead_s_per_step", math.nan),
                    "comm_ms/step": 1e3 * s.get("comm_s_per_step", math.nan),
                    "startup_s": s.get("startup_step_s")})
        for extra in extras:
            row[f"{extra}/step" if extra != "quality" else "k_hat/k"] = run.step_mean(extra)
        for net in networks:
            row[f"speedup@{net}"] = s.get(f"speedup@{net}")
        rows.append(row)
    return Table(rows, metrics, networks)


def cell_text(key: str, value: Any) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if key.endswith("bytes/step"):
            return format_bytes(value)
        if key.startswith(("speedup@", "compression_factor")):
            return f"{value:.2f}x"
        return f"{value:.4g}"
    return str(value)


def table_columns(table: Table) -> list[str]:
    columns = list(dict.fromkeys(k for row in table.rows for k in row))
    if not any(row.get("options") for row in table.rows):
        columns.remove("options")
    return columns


def markdown(table: Table, source: Path, plots: Sequence[Path]) -> str:
    columns = table_columns(table)
    lines = [f"# Report: {source}", "",
             f"{len(table.rows)} runs. Bytes are per rank per step (payload; with a parameter "
             "server wire_bytes is the uplink and downlink_bytes what every rank receives); "
             "compression_factor is dense bytes / bytes sent; overhead is compress + "
             "decompress + memory time per step; speedup@B is the projected step time with "
             "dense gradients on ring allreduce over the projected step time of the run, on a "
             "modelled network of bandwidth B (gracecomm.network). Per-step figures are means over "
             "the steady-state steps (all but each process's first); startup_s is that first "
             "step's time (kernels loading, buffers being built). Times depend on the CPU and "
             "its load; accuracies on the seeded data and training.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell_text(c, row.get(c)) for c in columns) + " |"
              for row in table.rows]
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_csv(table: Table, path: Path) -> None:
    columns = table_columns(table)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table.rows)

