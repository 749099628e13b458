"""The emulated cluster (`gracecomm-netbench topology=cluster`, docs/cluster.md): the tables of
`gracecomm.experiments.cluster.report`, from the stored outputs of the `cluster_*` steps.

    <!-- render: cluster_step STEP NAME -->      a goal=step run: results/STEP/NAME.json
    <!-- render: cluster_tta STEP NAME -->       a goal=accuracy run
    <!-- render: cluster_model -->               every run of cluster_model, measured and projected
    <!-- render: cluster_collectives -->         Gloo's collectives alone against the model
    <!-- render: cluster_projection -->          past this machine, on paper
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gracecomm.experiments.cluster import report as cluster_report

if TYPE_CHECKING:
    from render import Context


def step(ctx: Context, name: str, run: str) -> str:
    return ctx.pending(name) or cluster_report.render_step(ctx.step(name).path(f"{run}.json"))


def tta(ctx: Context, name: str, run: str) -> str:
    return ctx.pending(name) or cluster_report.render_tta(ctx.step(name).path(f"{run}.json"))


def model(ctx: Context) -> str:
    if note := ctx.pending("cluster_model"):
        return note
    stored = ctx.step("cluster_model")
    return cluster_report.render_model(sorted(p for p in stored.folder.glob("*n_*mbit.json")))


def collectives(ctx: Context) -> str:
    return ctx.pending("cluster_collectives") or cluster_report.render_collectives(
        ctx.step("cluster_collectives").path("collectives.json"))


def projection(ctx: Context) -> str:
    return ctx.pending("cluster_projection") or cluster_report.render_projection(
        ctx.step("cluster_projection").path("projection.json"))


RENDERERS = {
    "cluster_step": step,
    "cluster_tta": tta,
    "cluster_model": model,
    "cluster_collectives": collectives,
    "cluster_projection": projection,
}
