"""The emulated cluster (`gracecomm-netbench topology=cluster`, docs/cluster.md): the tables of
`gracecomm.experiments.cluster.report`, from the stored outputs of the `cluster_*` steps.

    <!-- render: cluster_step STEP NAME -->      a goal=step run: results/STEP/NAME.json
    <!-- render: cluster_tta STEP NAME -->       a goal=accuracy run
    <!-- render: cluster_model -->               every run of cluster_model, measured and projected
    <!-- render: cluster_collectives -->         Gloo's collectives alone against the model
    <!-- render: cluster_projection -->          past this machine, on paper
    <!-- render: cluster_hierarchy STEP NAME -->  flat beside two-level runs (hierarchies=[...])
    <!-- render: cluster_hierarchy_projection --> two levels past this machine, on paper
    <!-- render: cluster_strategies STEP -->      fixed beside auto runs (strategies=[...]),
                                                 every link rate of STEP
    <!-- render: advise_check STEP -->           gracecomm-advise's projection against the
                                                 steps a cluster step measured
    <!-- render: cluster_decision MODEL STEP... -->   which method reaches the target soonest:
                                                     measured by STEP's goal=accuracy runs,
                                                     else projected for MODEL
    cluster_model_error MBIT FORMAT                  (a value) the largest error of a projected
                                                     speedup at MBIT Mbit/s, over every node count

The reports' "Sources" lines carry the commit as netbench recorded it; netbench marks it "with
uncommitted changes" whenever the working tree differs, which it does while a step writes its
own outputs, so the blocks say what the step's stamp says instead (`stamp.py` judges which
changes could alter a number).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from gracecomm.experiments.cluster import advise
from gracecomm.experiments.cluster import report as cluster_report

if TYPE_CHECKING:
    from render import Context


def as_stamped(ctx: Context, name: str, text: str) -> str:
    """`text` with every "at commit `HASH with uncommitted changes`" of netbench's own record
    replaced by what step `name`'s stamp says of the same commit."""
    stamp = ctx.step(name).stamp
    changed = stamp.get("uncommitted") or []
    dirty = f" with uncommitted changes to {', '.join(changed)}" if changed else ""
    return re.sub(r"at commit `(\w+) with uncommitted changes`",
                  lambda m: f"at commit `{m[1]}{dirty}`", text)


def step(ctx: Context, name: str, run: str) -> str:
    return ctx.pending(name) or as_stamped(ctx, name, cluster_report.render_step(
        ctx.step(name).path(f"{run}.json")))


def tta(ctx: Context, name: str, run: str) -> str:
    return ctx.pending(name) or as_stamped(ctx, name, cluster_report.render_tta(
        ctx.step(name).path(f"{run}.json")))


def model_runs(ctx: Context) -> list:
    return sorted(ctx.step("cluster_model").folder.glob("*n_*mbit.json"))


def model(ctx: Context) -> str:
    if note := ctx.pending("cluster_model"):
        return note
    return as_stamped(ctx, "cluster_model", cluster_report.render_model(model_runs(ctx)))


def model_error(ctx: Context, mbit: str, fmt: str) -> str:
    """The largest |projected / measured - 1| of a speedup whose communication was timed, over
    the stored `cluster_model` runs at `mbit` Mbit/s (the table's "Largest error", per rate)."""
    errors = [abs(row["projected_speedup"] / row["measured_speedup"] - 1)
              for path in model_runs(ctx)
              for result in [json.loads(path.read_text(encoding="utf-8"))]
              if result["bandwidth_mbps"] == float(mbit)
              for row in result["runs"] if row["comm_timed"]]
    if not errors:
        raise ValueError(f"cluster_model has no run at {mbit} Mbit/s")
    return fmt.format(max(errors))


def collectives(ctx: Context) -> str:
    return ctx.pending("cluster_collectives") or as_stamped(
        ctx, "cluster_collectives", cluster_report.render_collectives(
            ctx.step("cluster_collectives").path("collectives.json")))


def projection(ctx: Context) -> str:
    return ctx.pending("cluster_projection") or as_stamped(
        ctx, "cluster_projection", cluster_report.render_projection(
            ctx.step("cluster_projection").path("projection.json")))


def hierarchy(ctx: Context, name: str, run: str) -> str:
    return ctx.pending(name) or as_stamped(ctx, name, cluster_report.render_hierarchies(
        ctx.step(name).path(f"{run}.json")))


def hierarchy_projection(ctx: Context) -> str:
    if note := ctx.pending("cluster_projection"):
        return note
    path = ctx.step("cluster_projection").path("projection.json")
    if "hierarchy" not in json.loads(path.read_text(encoding="utf-8"))["assumptions"]:
        return ("*Not recorded yet*: the stored projection predates the two-level exchange; "
                "`bash results/reproduce.sh cluster_projection` projects it.")
    return as_stamped(ctx, "cluster_projection",
                      cluster_report.render_hierarchy_projection(path))


def strategies(ctx: Context, name: str) -> str:
    """Every run of step `name` (``4n_*mbit.json``) with its fixed and auto strategies."""
    return ctx.pending(name) or as_stamped(ctx, name, cluster_report.render_strategies(
        sorted(ctx.step(name).folder.glob("*n_*mbit.json"))))


def advise_check(ctx: Context, name: str) -> str:
    """`gracecomm-advise against=...` of step `name` (``4n_*mbit/advise.json``): each
    method's projected step beside the measured one."""
    return ctx.pending(name) or as_stamped(ctx, name, advise.render_checks(
        sorted(ctx.step(name).folder.glob("*n_*mbit/advise.json"))))


def decision(ctx: Context, model: str, *steps: str) -> str:
    """The decision table (`cluster_report.render_decision`): the goal=accuracy runs of
    `steps` where they ran, elsewhere the stored projection of `model` with the steps to the
    target of the run it names (``tta_source``, a stored output of another step)."""
    for name in ("cluster_projection", *steps):
        if note := ctx.pending(name):
            return note
    path = ctx.step("cluster_projection").path("projection.json")
    source = json.loads(path.read_text(encoding="utf-8"))["tta_source"]
    steps_path = source and ctx.step(Path(source).parent.name).path(Path(source).name)
    runs = [run for name in steps for run in sorted(ctx.step(name).folder.glob("*n_*mbit.json"))]
    return cluster_report.render_decision(path, runs, steps_path, model)


RENDERERS = {
    "cluster_step": step,
    "cluster_tta": tta,
    "cluster_model": model,
    "cluster_model_error": model_error,
    "cluster_collectives": collectives,
    "cluster_projection": projection,
    "cluster_hierarchy": hierarchy,
    "cluster_hierarchy_projection": hierarchy_projection,
    "cluster_decision": decision,
    "advise_check": advise_check,
    "cluster_strategies": strategies,
}
