"""Tables and plots of the emulated-cluster results, from the stored outputs that
``bash results/reproduce.sh cluster_*`` writes into ``results/cluster_*/``. The results page
renders its tables with the ``render_*`` functions (``results/renderers/cluster.py``), so it
shows exactly what those files hold; ``plot_crossover`` draws the scaling crossover
(and ``plot_accuracy`` a netbench run's accuracy against time):

    python -m gracecomm.experiments.cluster.report crossover.png 2n.json 4n.json 8n.json

Each ``render_*`` function takes stored outputs and returns one Markdown table (with the
command, commit and load that produced it).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gracecomm.experiments.cluster.projection import Fastest, fastest, grid_cell, reached
from gracecomm.experiments.reports.plots import save_figure
from gracecomm.network import TCP_OVER_ETHERNET, Network, at_world_size
from gracecomm.strategy import FORMS

ALLGATHER_SPARSIFIERS = ("topk", "dgc")
ALLREDUCE_METHODS = ("powersgd_parity", "fp16", "randomk")
CLUSTER_NODES = (2, 4, 8)  # the emulated cluster's sizes: the decision table's first rows
DECISION_MBIT = (10, 100, 1000, 10_000, 100_000)  # the decision table's columns


def load(path: Path | str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def source(result: dict[str, Any]) -> str:
    """The line under a table: what produced it."""
    p = result.get("provenance", {})
    load_text = ", ".join(f"{x:.1f}" for x in p.get("load_before", [])[:1]
                          + p.get("load_after", [])[:1])
    return (f"`{p.get('command', '?')}` at commit `{p.get('commit', '?')}`, "
            f"{p.get('date', '?')}, {p.get('cpus', '?')} CPUs, load average before / after "
            f"{load_text}")


def network_of(result: dict[str, Any]) -> Network:
    """The calibrated network a netbench result was projected on."""
    stored = result.get("network", {})
    return Network(result["bandwidth_mbps"] / 1000, result["latency_us_calibrated"],
                   shared=stored.get("shared", False),
                   overhead=stored.get("overhead", TCP_OVER_ETHERNET),
                   broadcast=stored.get("broadcast", "tree"),
                   ranks_per_node=result.get("ranks_per_node", 1),
                   host_gbps=stored.get("host_gbps"), overlap=stored.get("overlap", False),
                   intra_gbps=stored.get("intra_gbps"),
                   intra_latency_us=stored.get("intra_latency_us"))


def flat(row: dict[str, Any]) -> bool:
    """Whether a netbench run exchanged flat (runs stored before hierarchies did)."""
    return row.get("hierarchy", "flat") == "flat"


def pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.0f}%"


def hosts(r: dict[str, Any]) -> str:
    """The hosts' calibrated rate (`gracecomm.network.Network.host_gbps`), if any."""
    host = r.get("network", {}).get("host_gbps")
    return f", the hosts' rate {host:.3g} Gbit/s of payload" if host else ""


def contention(r: dict[str, Any]) -> str:
    """The compute per step of the timed runs (the slowest rank's) against one rank's
    alone: what sharing this machine's CPUs costs each rank."""
    timed = [row["compute_s"] for row in r["runs"] if row["comm_timed"]]
    if not timed or "compute_alone_s" not in r:
        return ""
    cpus = r.get("provenance", {}).get("cpus", "?")
    return (f"; {r['ranks']} ranks on {cpus} CPUs: compute {1e3 * min(timed):.1f}-"
            f"{1e3 * max(timed):.1f} ms per step (the slowest rank's) against "
            f"{1e3 * r['compute_alone_s']:.1f} ms for one rank alone")


def setting(r: dict[str, Any]) -> str:
    """The cluster a result ran on, in words."""
    return (f"{r['world_size']} nodes x {r['ranks_per_node']} rank, {r['bandwidth_mbps']:g} "
            f"Mbit/s per node ({r['topology']})")


def render_step(path: Path | str) -> str:
    """A ``goal=step`` netbench result: measured and projected step time and speedup per
    method, compute per step (the slowest rank's, under the contention of this machine),
    and this library's hooks next to PyTorch's."""
    r = load(path)
    lines = [f"{setting(r)}; calibrated latency {r['latency_us_calibrated']:.0f} us per "
             f"message{hosts(r)}{contention(r)}", "",
             "| method | step ms (rounds) | measured speedup | projected speedup | error | "
             "compute ms | KB/step |", "|---|---|---|---|---|---|---|"]
    for row in r["runs"]:
        low, high = (1e3 * t for t in row["round_step_s"])
        timed = row["comm_timed"]
        error = pct(row["projected_speedup"], row["measured_speedup"]) if timed else "-"
        lines.append(f"| `{row['method']}` | {1e3 * row['step_s']:.1f} ({low:.1f}-{high:.1f}) | "
                     f"{row['measured_speedup']:.2f}x | "
                     f"{row['projected_speedup']:.2f}x | {error} | "
                     f"{1e3 * row['compute_s']:.1f} | {row['wire_bytes'] / 1000:.1f} |"
                     if timed else
                     f"| `{row['method']}` | {1e3 * row['step_s']:.1f} ({low:.1f}-{high:.1f}) | "
                     f"{row['measured_speedup']:.2f}x | - | - | - | "
                     f"{row['wire_bytes'] / 1000:.1f} |")
    by = {row["method"]: row for row in r["runs"]}
    pairs = [(ours, theirs) for ours, theirs in (("fp16", "torch_fp16"),
                                                 ("powersgd_parity", "torch_powersgd"))
             if ours in by and theirs in by]
    if pairs:
        lines += ["", "This library's step against PyTorch's hook on the same settings: " +
                  "; ".join(f"`{o}` {pct(by[o]['step_s'], by[t]['step_s'])} of `{t}`"
                            for o, t in pairs) + "."]
    return "\n".join([*lines, "", source(r)])


def render_tta(path: Path | str) -> str:
    """A ``goal=accuracy`` netbench result: time and steps to the target, final accuracy,
    speedup in time to target over the baseline; a miss says so."""
    r = load(path)
    ref = r.get("reference")
    target = (f"{r['target_accuracy']:.4f} ({ref.get('target_fraction', '?')} of "
              f"`{ref['method']}`'s final {ref['final_accuracy']:.4f} after "
              f"{ref['steps']} steps, unshaped)" if ref else
              f"{r['target_accuracy']:.4f} (given)")
    lines = [f"{setting(r)}; target test accuracy {target}{contention(r)}", "",
             "| method | reached | steps | time to target s | speedup | final accuracy | "
             "step ms | KB/step |", "|---|---|---|---|---|---|---|---|"]
    for row in r["runs"]:
        hit = row["reached_target"]
        time_s = f"{row['time_to_target_s']:.1f}" if hit else f"> {row['time_to_target_s']:.1f}"
        speedup = (f"{'' if hit else '< '}{row['tta_speedup']:.2f}x"
                   if "tta_speedup" in row else "-")
        lines.append(f"| `{row['method']}` | {'yes' if hit else 'no'} | "
                     f"{row['steps_to_target']} | {time_s} | {speedup} | "
                     f"{row['final_accuracy']:.4f} | {1e3 * row['step_s']:.1f} | "
                     f"{row['wire_bytes'] / 1000:.1f} |")
    return "\n".join([*lines, "", source(r)])


def render_model(paths: Sequence[Path | str]) -> str:
    """Measured against projected speedup over plain DDP, per method, at every node count
    and bandwidth of `paths` (``goal=step`` results), with the error of the projection."""
    results = sorted((load(p) for p in paths), key=lambda r: (r["bandwidth_mbps"],
                                                              r["world_size"]))
    cases = [f"{r['world_size']}n {r['bandwidth_mbps']:g} Mbit/s" for r in results]
    methods = [row["method"] for row in results[0]["runs"] if row["comm_timed"]]
    lines = ["Measured / projected speedup over plain DDP (error of the projection)", "",
             "| method | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    for method in methods:
        cells = []
        for r in results:
            row = next((x for x in r["runs"] if x["method"] == method), None)
            cells.append("-" if row is None else
                         f"{row['measured_speedup']:.2f} / {row['projected_speedup']:.2f} "
                         f"({pct(row['projected_speedup'], row['measured_speedup'])})")
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    worst = max((abs(row["projected_speedup"] / row["measured_speedup"] - 1), row["method"],
                 f"{r['world_size']}n {r['bandwidth_mbps']:g}")
                for r in results for row in r["runs"] if row["comm_timed"])
    lines += ["", f"Largest error: {100 * worst[0]:.0f}% (`{worst[1]}`, {worst[2]} Mbit/s).",
              "", "Sources: " + "; ".join(source(r) for r in results[:1]) +
              f" (and {len(results) - 1} more runs of the same step)"]
    return "\n".join(lines)


def render_collectives(path: Path | str) -> str:
    """Gloo's allreduce and allgather measured on the cluster against the model."""
    r = load(path)
    lines = ["| nodes | Mbit/s | latency us | allreduce 1.08 MB ms (model) | allreduce 539 KB ms "
             "(model) | allreduce 10.9 KB ms (model) | allgather 21.7 KB/rank ms (model) | "
             "load |", "|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        def cell(kind: str, nbytes: str) -> str:
            m, p = c[kind][nbytes], c["model"][kind][nbytes]
            return f"{1e3 * m:.1f} ({1e3 * p:.1f}, {pct(p, m)})"
        lines.append(f"| {c['nodes']} | {c['bandwidth_mbps']:g} | {1e6 * c['latency_s']:.0f} | "
                     f"{cell('allreduce', '1078888')} | {cell('allreduce', '539444')} | "
                     f"{cell('allreduce', '10868')} | {cell('allgather', '21688')} | "
                     f"{c['load'][0]:.1f} |")
    return "\n".join([*lines, "", f"`{r.get('command', '?')}`"])


def render_projection(path: Path | str) -> str:
    """Projected speedup over plain DDP per method, in step time and in time to accuracy,
    at a few node counts and bandwidths, for each model (``experiments/cluster/projection.py``;
    assumptions stated there). Time to accuracy takes each method's steps to target from the
    emulated cluster's run; a method that did not reach the target there has none."""
    r = load(path)
    lines = [f"Each cell: the projected speedup over `ddp` in step time / in time to accuracy "
             f"(steps to target from `{r['tta_source']}`; `-`: the method did not reach the "
             f"target there).", ""]
    for model, data in r["models"].items():
        lines += [f"**{model}** ({data['parameters']:,} parameters; compute "
                  f"{1e3 * data['compute_s']:.0f} ms per step, {data['compute_source']})", "",
                  "| nodes @ Gbit/s | " + " | ".join(f"`{m}`" for m in data["methods"]) + " |",
                  "|---|" + "---|" * len(data["methods"])]
        for cell, values in data["grid"].items():
            steps, tta = values["step_s"], values.get("tta_s", {})
            lines.append(f"| {cell} | " + " | ".join(
                f"{steps['ddp'] / steps[m]:.2f}x / "
                + (f"{tta['ddp'] / tta[m]:.2f}x" if m in tta and "ddp" in tta else "-")
                for m in data["methods"]) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def render_hierarchies(path: Path | str) -> str:
    """A netbench result with ``hierarchies=[flat,node]``: each method's flat run beside its
    two-level run (``METHOD@node``): step time, the bytes the shaped links carried per step
    (``tc``), their ratio, and the two-level step's projection and its error."""
    r = load(path)
    by = {row["method"]: row for row in r["runs"]}
    lines = [f"{setting(r)}{hosts(r)}{contention(r)}", "",
             "| method | flat step ms | two-level step ms | speedup | flat link KB/step | "
             "two-level link KB/step | ratio | two-level projected ms | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in by.items():
        node = by.get(f"{name}@node")
        if not flat(row) or node is None:
            continue
        flat_kb, node_kb = (x.get("cross_node_bytes_per_step") for x in (row, node))
        traffic = (f"{flat_kb / 1000:.1f} | {node_kb / 1000:.1f} | {node_kb / flat_kb:.2f}x"
                   if flat_kb and node_kb is not None else "- | - | -")
        projected = (f"{1e3 * node['projected_step_s']:.1f} | "
                     f"{pct(node['projected_step_s'], node['step_s'])}"
                     if node["comm_timed"] else "- | -")
        lines.append(f"| `{name}` | {1e3 * row['step_s']:.1f} | {1e3 * node['step_s']:.1f} | "
                     f"{row['step_s'] / node['step_s']:.2f}x | {traffic} | {projected} |")
    return "\n".join([*lines, "", source(r)])


def render_strategies(paths: Sequence[Path | str]) -> str:
    """Netbench results with ``strategies=[fixed,auto]`` (one per link rate): each method's
    fixed run beside its ``METHOD@auto`` run and plain DDP, by step time, or by time to the
    target for ``goal=accuracy``; the auto run's ratio to the faster of DDP and the fixed
    method, its speedup over the fixed method, the tensors it sent in each form (compressed /
    fp16 / dense) and the seconds its decision took."""
    results = [load(p) for p in paths]
    accuracy = results[0].get("goal") == "accuracy"
    key = "time_to_target_s" if accuracy else "step_s"
    unit = "time to target s" if accuracy else "step ms"
    scale = 1.0 if accuracy else 1e3
    lines = [f"| link | method | {unit}: ddp / fixed / auto | auto / faster of the two | "
             "auto speedup over fixed | tensors compressed / fp16 / dense | decision s |"
             + (" final accuracy fixed / auto |" if accuracy else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if accuracy else "")]
    for r in sorted(results, key=lambda r: r["bandwidth_mbps"]):
        by = {row["method"]: row for row in r["runs"]}
        ddp = by[r.get("baseline", "ddp")]
        for name, fixed in by.items():
            auto = by.get(f"{name}@auto")
            if auto is None:
                continue
            shown = [ddp, fixed, auto]
            times = " / ".join(f"{scale * x[key]:.1f}" + spread(x) + (
                "" if x.get("reached_target", True) else " (missed)") for x in shown)
            forms = auto.get("decision", {})
            counts = " / ".join(str(forms["forms"][f]) for f in FORMS) if forms else "-"
            line = (f"| {r['bandwidth_mbps']:g} Mbit/s | `{name}` | {times} | "
                    f"{auto[key] / min(ddp[key], fixed[key]):.2f}x | "
                    f"{fixed[key] / auto[key]:.2f}x | {counts} | "
                    + (f"{forms['decide_s']:.2f}" if forms else "-") + " |")
            if accuracy:
                line += f" {fixed['final_accuracy']:.4f} / {auto['final_accuracy']:.4f} |"
            lines.append(line)
    first = results[0]
    rounds = {len(row["rounds"]) for r in results for row in r["runs"] if "rounds" in row}
    median = (f"; each time the median of {max(rounds)} rounds run in turn, [the fastest - "
              "the slowest]" if rounds else "")
    return "\n".join([f"{first['world_size']} nodes x {first['ranks_per_node']} rank"
                      f"{contention(first)}{median}", "", *lines, "",
                      *(f"- {source(r)}" for r in results)])


def spread(row: dict[str, Any]) -> str:
    """`` [fastest-slowest]`` of a netbench row's rounds (``accuracy.rounds``), if several."""
    times = [r["time_to_target_s"] for r in row.get("rounds", [])]
    return f" [{min(times):.1f}-{max(times):.1f}]" if times else ""


def render_hierarchy_projection(path: Path | str) -> str:
    """The projection's nodes of several GPUs (``experiments/cluster/projection.py``,
    ``hierarchy``): per model, the two-level step's speedup over the flat step and the
    bytes per node link per step it leaves, per method, at every node count and bandwidth."""
    r = load(path)
    setup = r["assumptions"]["hierarchy"]
    lines = [f"Each cell: the projected speedup of the two-level exchange over the flat one "
             f"/ the two-level exchange's bytes on each node's link as a fraction of the "
             f"flat one's; nodes of {setup['ranks_per_node']} ranks, "
             f"{setup['intra_gbps']:g} Gbit/s and {setup['intra_latency_us']:g} us inside "
             f"a node.", ""]
    for model, data in r["models"].items():
        methods = list(data["methods"])
        lines += [f"**{model}**", "", "| nodes @ Gbit/s | " + " | ".join(
            f"`{m}`" for m in methods) + " |", "|---|" + "---|" * len(methods)]
        for cell, values in data["hierarchy"].items():
            lines.append(f"| {cell} | " + " | ".join(
                f"{values[m]['speedup']:.2f}x / "
                f"{values[m]['node_link_bytes'] / values[m]['flat_link_bytes']:.2f}"
                for m in methods) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def decision_cells(projection: dict[str, Any], model: str, runs: Sequence[dict[str, Any]],
                   steps: dict[str, float]
                   ) -> dict[tuple[int, int], tuple[Fastest | None, bool]]:
    """(nodes, Mbit/s) -> (the method that reaches the target soonest, with its margins;
    None without evidence) and whether that is measured, at `CLUSTER_NODES` and the
    projection's node counts, at `DECISION_MBIT`. Measured: the ``goal=accuracy`` result of
    `runs` at that cell, its times to the target. Projected: `model`'s cell of the stored
    projection, or one computed from its stored statistics with the same cost model
    (`projection.grid_cell`), each method's step time times its `steps` to the target. Only
    the projection's methods compete; one that missed the target in the run a cell rests on
    (or has no `steps`) is left out of it."""
    data = projection["models"][model]
    measured = {(r["world_size"], r["bandwidth_mbps"]): r for r in runs}
    cells = {}
    for nodes in (*CLUSTER_NODES, *projection["nodes"]):
        for mbit in DECISION_MBIT:
            run = measured.get((nodes, mbit))
            if run is not None:
                times = {m: t for m, t in reached(run, "time_to_target_s").items()
                         if m in data["methods"]}
            else:
                bw = mbit / 1000
                cell = data["grid"].get(f"{nodes}@{bw:g}") or grid_cell(
                    data["methods"], data["compute_s"], steps, nodes, bw)
                times = cell["tta_s"]
            cells[(nodes, mbit)] = (fastest(times), run is not None)
    return cells


def rate(mbit: float) -> str:
    """A link rate in words: Mbit/s up to 1000, Gbit/s above."""
    return f"{mbit:g} Mbit/s" if mbit <= 1000 else f"{mbit / 1000:g} Gbit/s"


def factor(x: float) -> str:
    """A ratio of times, to three significant digits up to 100x."""
    return f"{x:.{2 if x < 10 else 1 if x < 100 else 0}f}x"


def verdict(found: Fastest | None, measured: bool) -> str:
    """A decision cell: the method and its margins over plain DDP and over the runner-up
    (``-`` without evidence), in bold where measured."""
    if found is None:
        return "-"
    margins = ([] if found.method == "ddp" else
               ["no DDP time" if found.over_ddp is None else f"{factor(found.over_ddp)} vs DDP"])
    if found.runner_up == "ddp":
        margins[-1] += " (the runner-up)"
    elif found.runner_up:
        margins.append(f"{factor(found.over_runner_up)} over `{found.runner_up}`")
    text = f"`{found.method}` {', '.join(margins)}".strip()
    return f"**{text}** (measured)" if measured else text


def render_decision(projection_path: Path | str, run_paths: Sequence[Path | str],
                    steps_path: Path | str | None, model: str) -> str:
    """Which method reaches the target accuracy soonest at each node count and link rate
    (`decision_cells`): measured where one of the ``goal=accuracy`` results of `run_paths`
    (one rank per node) ran, else projected for `model` with the steps to the target of the
    result at `steps_path`; under the table, what each cell rests on (`decision_notes`)."""
    r = load(projection_path)
    runs = sorted((x for x in map(load, run_paths)
                   if "target_accuracy" in x and x.get("ranks_per_node", 1) == 1),
                  key=lambda x: (x["world_size"], x["bandwidth_mbps"]))
    source = load(steps_path) if steps_path else None
    cells = decision_cells(r, model, runs, reached(source, "steps_to_target") if source else {})
    lines = ["| nodes | " + " | ".join(map(rate, DECISION_MBIT)) + " |",
             "|---|" + "---|" * len(DECISION_MBIT)]
    for nodes in dict.fromkeys(n for n, _ in cells):
        lines.append(f"| {nodes} | " + " | ".join(
            verdict(*cells[(nodes, mbit)]) for mbit in DECISION_MBIT) + " |")
    return "\n\n".join(["\n".join(lines), *decision_notes(r, model, runs, source)])


def where(run: dict[str, Any]) -> str:
    """The cell a netbench result ran at, in words."""
    return f"{run['world_size']} nodes at {run['bandwidth_mbps']:g} Mbit/s"


def decision_notes(projection: dict[str, Any], model: str, runs: Sequence[dict[str, Any]],
                   source: dict[str, Any] | None) -> list[str]:
    """What the decision table's cells rest on: the measured runs, the projection and the
    run of its steps to the target, the methods that compete and those left out for
    missing the target."""
    data = projection["models"][model]
    nodes, bws = projection["nodes"], projection["bandwidths_gbps"]
    measured = "; ".join(f"{where(x)} (target accuracy {x['target_accuracy']:.4f})"
                         for x in runs) or "none"
    steps = f"the run at {where(source)}" if source else "no run (so no projected cell has any)"
    notes = [f"Measured (bold): {measured}; each method's time to the target as it ran. "
             f"Projected (every other cell): {model} ({data['parameters']:,} parameters, "
             f"compute {1e3 * data['compute_s']:.0f} ms per step), the projection's step time "
             f"(as stored at {min(nodes)}-{max(nodes)} nodes and {min(bws):g}-{max(bws):g} "
             "Gbit/s, elsewhere computed from its stored statistics with the same cost model) "
             f"times each method's steps to the target in {steps}."]
    candidates = list(data["methods"])
    others = sorted({row["method"] for x in runs for row in x["runs"]} - set(candidates))
    notes.append("Competing: the projection's methods, " + ", ".join(
        f"`{m}`" for m in candidates) + (f" (not the runs' {', '.join(f'`{m}`' for m in others)})"
                                         if others else "") + ".")
    missed: dict[str, list[str]] = {}
    for run in {where(x): x for x in [*runs, *([source] if source else [])]}.values():
        for row in run["runs"]:
            if row["method"] in candidates and not row["reached_target"]:
                missed.setdefault(row["method"], []).append(where(run))
    if missed:
        notes.append("Left out of every cell that rests on a run where it missed the target: "
                     + "; ".join(f"`{m}` (missed at {', '.join(at)})"
                                 for m, at in missed.items()) + ".")
    return notes


def crossover(paths: Sequence[Path | str], max_nodes: int = 1024) -> dict[str, Any]:
    """Measured step times at every node count of `paths` (``goal=step`` results at one
    bandwidth) and projected ones from 2 to `max_nodes` nodes: each method's smallest
    cluster's per-step statistics (its compute with the least contention) at N ranks
    (`gracecomm.network.at_world_size`), on per-node links. The crossover is the first
    node count at which the fastest allreduce method beats the fastest allgather
    sparsifier."""
    results = sorted((load(p) for p in paths), key=lambda r: r["world_size"])
    smallest = results[0]
    net = network_of(smallest)
    nodes = [2 ** k for k in range(1, int(math.log2(max_nodes)) + 1)]
    measured: dict[str, dict[int, float]] = {}
    projected: dict[str, dict[int, float]] = {}
    for r in results:
        for row in r["runs"]:
            measured.setdefault(row["method"], {})[r["world_size"]] = row["step_s"]
    for row in smallest["runs"]:
        if not row["comm_timed"] or "stats" not in row or not flat(row):
            continue
        projected[row["method"]] = {
            n: net.project(at_world_size(row["stats"], smallest["ranks"], n), n)[
                f"projected_step_s@{net.label}"] for n in nodes}

    def first_loss(times: dict[str, dict[int, float]]) -> int | None:
        sparse = [m for m in ALLGATHER_SPARSIFIERS if m in times]
        dense = [m for m in ALLREDUCE_METHODS if m in times]
        if not sparse or not dense:
            return None
        for n in sorted(times[sparse[0]]):
            if min(times[m].get(n, math.inf) for m in dense) < min(
                    times[m].get(n, math.inf) for m in sparse):
                return n
        return None

    return {"bandwidth_mbps": smallest["bandwidth_mbps"], "measured": measured,
            "projected": projected, "crossover_measured": first_loss(measured),
            "crossover_projected": first_loss(projected)}


def plot_crossover(paths: Sequence[Path | str], out: Path | str) -> dict[str, Any]:
    """Step time against node count, measured (points) and projected (lines), for the
    allgather sparsifiers and the allreduce methods; the crossover marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = crossover(paths)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, method in enumerate(m for m in (*ALLGATHER_SPARSIFIERS, *ALLREDUCE_METHODS, "ddp")
                               if m in data["measured"]):
        color = plt.cm.tab10(i)
        style = "-" if method in ALLGATHER_SPARSIFIERS else "--"
        if method in data["projected"]:
            xs = sorted(data["projected"][method])
            ax.plot(xs, [1e3 * data["projected"][method][n] for n in xs], style, color=color,
                    label=f"{method} (projected)")
        ms = sorted(data["measured"][method])
        ax.plot(ms, [1e3 * data["measured"][method][n] for n in ms], "o", color=color,
                label=f"{method} (measured)")
    for key, label in (("crossover_projected", "projected"), ("crossover_measured",
                                                              "measured")):
        if data[key]:
            ax.axvline(data[key], color="grey", linestyle=":" if label == "projected" else "-",
                       linewidth=1, label=f"crossover, {label}: {data[key]} nodes")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes (one rank each)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"Allgather sparsifiers against allreduce methods, "
                 f"{data['bandwidth_mbps']:g} Mbit/s per node")
    ax.legend(fontsize=6, ncol=2)
    save_figure(fig, out)
    return data


def plot_accuracy(result: dict[str, Any], path: Path) -> None:
    """Test accuracy against training wall-clock time, every method on one figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab10").colors
    for i, row in enumerate(result["runs"]):  # past 10 methods: the colours again, dashed
        times, accs = [c[0] for c in row["curve"]], [c[1] for c in row["curve"]]
        cycle = i // len(colors)
        ax.plot(times, accs, color=colors[i % len(colors)], linestyle=("-", "--", ":")[cycle % 3],
                marker=(".", "x", "+")[cycle % 3], label=row["method"])
    ax.axhline(result["target_accuracy"], color="grey", linestyle="--", linewidth=1,
               label=f"target {result['target_accuracy']:.3f}")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # they overlap
    ax.set_xlabel("training wall-clock time (s, log scale; evaluations excluded)")
    ax.set_ylabel("test accuracy")
    where = ("cluster" if result["topology"] == "cluster" else "loopback")
    ax.set_title(f"{where}: {result['world_size']} x {result['ranks_per_node']} rank(s), "
                 f"{result['bandwidth_mbps']:g} Mbit/s")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw the scaling crossover of cluster runs "
                                                 "at one bandwidth and several node counts.")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("runs", nargs="+", type=Path,
                        help="netbench.json of goal=step cluster runs (one per node count)")
    args = parser.parse_args(argv)
    data = plot_crossover(args.runs, args.out)
    print(f"crossover at {data['bandwidth_mbps']:g} Mbit/s: measured "
          f"{data['crossover_measured']}, projected {data['crossover_projected']} nodes")


if __name__ == "__main__":
    main()
