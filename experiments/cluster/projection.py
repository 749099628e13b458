"""Past this machine, on paper: the cost model (`gracecomm.network`), validated on the
emulated cluster at 2-8 nodes (docs/cluster.md), projects the step time and the time to
accuracy of each method at 16 to 1024 nodes and 1 to 100 Gbit/s per node, for the gradients
of ResNet-50 and BERT-base.

    python -m gracecomm.experiments.cluster.projection results/cluster_projection/projection.json \\
        --tta results/cluster_tta/4n_100mbit.json --plot results/cluster_projection/projection.png

What goes in, and where it comes from:

- **Gradient shapes** from the models' definitions: ResNet-50 (He et al. 2016, Table 1;
  torchvision's layout, 25,557,032 parameters) and BERT-base (Devlin et al. 2019: 12
  layers, hidden 768, feed-forward 3072, 30,522 word pieces, 512 positions, 2 segment
  types, with the pooler; 109,482,240 parameters).
- **Bytes and collectives per step**: this library's compressors (each method's preset of
  configs/method/) run on random tensors of those shapes in a world of one; a payload's
  size depends on the shapes only for these methods (Top-k and Random-k keep their k, DGC
  nearly). One exchange per DDP bucket (25 MB, the first 1 MB, as DDP buckets them):
  allreduce methods one allreduce per bucket (PowerSGD two), allgather methods one
  allgather per bucket (and one of the payload sizes where they vary).
- **Compute per step, published measurements** (not measured here): ResNet-50 v1.5 at 893
  images/s on one V100 16 GB with mixed precision, batch 256 per GPU (NVIDIA
  DeepLearningExamples, PyTorch ResNet50 v1.5 README, "Training performance: NVIDIA
  DGX1-16G", 1 GPU; main.py's default batch 256): 0.287 s. BERT-base is derived, not
  measured: BERT-Large's published SQuAD fine-tuning throughput, 39.10 sequences of 384
  tokens per second on one V100 16 GB with mixed precision (NVIDIA DeepLearningExamples,
  TensorFlow2 BERT README, "Fine-tuning training performance for SQuAD v1.1 on NVIDIA
  DGX-1 V100 (8x V100 16GB)"), scaled to BERT-base by non-embedding parameters (compute per
  token about 6x those parameters, Kaplan et al. 2020: 12 x 12 x 768^2 against
  24 x 12 x 1024^2), for a step of 32 sequences of 128 tokens: 0.077 s.
- **Compression cost**: this library's whole pipeline step (compress, memory, decompress)
  measured on this CPU in reads of the gradient (`t.sum()` of every tensor, same run),
  times one read of the gradient on a V100 (900 GB/s of HBM2): an assumption that a GPU
  implementation costs the same number of passes over memory.
- **Network** (`gracecomm.network.Network`): per-node links of 1, 10 and 100 Gbit/s, a
  per-message latency of 25 us, TCP's framing (`TCP_OVER_ETHERNET`), ring allreduce and
  allgather (NCCL's ring, also Gloo's; NCCL's trees would pay less latency at 1024
  nodes), no overlap of communication with the backward pass (DDP overlaps: this favours
  the methods that send less), one rank per node.
- **Nodes of 8 GPUs** (``hierarchy`` in the JSON): the same statistics on nodes of 8
  ranks, the flat exchange (every rank's payload through its node's link) against the
  two-level one (`gracecomm.network.project_hierarchies`: dense inside the node, one payload
  per node across), inside each node a V100's NVLink: 300 GB/s over both directions (NVIDIA
  Tesla V100 datasheet, SXM2), 1200 Gbit/s each way, and a latency of 3.4 us per message
  (NCCL's tuning model, `src/graph/tuning.cc`: the ring's Simple protocol on NVLink).
- **Time to accuracy**: the projected step time times the steps each method needed to
  reach the target on the emulated cluster (``--tta``, a ``goal=accuracy`` netbench
  result; ResNet-20 on the prototypes data): an assumption that the ratio of steps to
  target carries over to these models and node counts, which it need not (the global
  batch grows with the nodes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from gracecomm.config import instantiate
from gracecomm.experiments import presets
from gracecomm.experiments.bench.timing import best_of_each
from gracecomm.experiments.reports.plots import save_figure
from gracecomm.experiments.training.config import build_grace
from gracecomm.network import (
    TCP_OVER_ETHERNET,
    Network,
    at_world_size,
    bytes_key,
    calls_key,
    project_hierarchies,
)

METHODS = ("ddp", "fp16", "powersgd", "randomk", "topk", "dgc", "natural", "qsgd",
           "efsignsgd")
NODES = (16, 32, 64, 128, 256, 512, 1024)
BANDWIDTHS_GBPS = (1.0, 10.0, 100.0)
LATENCY_US = 25.0
HBM_BYTES_PER_S = 900e9  # V100
RANKS_PER_NODE = 8  # GPUs per node of the two-level projection
NVLINK_GBPS, NVLINK_LATENCY_US = 1200.0, 3.4  # V100 NVLink each way; NCCL's ring on NVLink
BUCKET_BYTES, FIRST_BUCKET_BYTES = 25 * 2**20, 2**20  # DDP's bucket_cap_mb and first bucket
COMPUTE = {
    "resnet50": {"step_s": 256 / 893.09, "source": (
        "published: ResNet-50 v1.5, 893.09 images/s on 1x V100 16GB, mixed precision, "
        "batch 256 (NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README)")},
    "bert_base": {"step_s": 32 * 128 / (39.10 * 384 / ((12 * 12 * 768**2) / (24 * 12 * 1024**2))),
                  "source": (
        "derived: BERT-Large SQuAD fine-tuning, 39.10 sequences of 384 tokens/s on 1x V100 "
        "16GB, mixed precision (NVIDIA DeepLearningExamples, TensorFlow2 BERT README), "
        "scaled by non-embedding parameters (Kaplan et al. 2020) to BERT-base, 32 "
        "sequences of 128 tokens per step")},
}


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of ResNet-50 (He et al. 2016, Table 1: bottleneck stages of 3, 4, 6
    and 3 blocks of widths 64-512, expansion 4; batch norm weight and bias per
    convolution; a 1000-way classifier)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for blocks, width in ((3, 64), (4, 128), (6, 256), (3, 512)):
        for block in range(blocks):
            out = 4 * width
            for conv in ((width, inplanes, 1, 1), (width, width, 3, 3), (out, width, 1, 1)):
                shapes += [conv, (conv[0],), (conv[0],)]
            if block == 0:  # projection shortcut
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return shapes + [(1000, 2048), (1000,)]


def bert_base_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of BERT-base (Devlin et al. 2019: L = 12, H = 768, feed-forward
    4H, 30,522 word pieces, 512 positions, 2 segment types, layer norms, the pooler)."""
    h, ff = 768, 3072
    shapes: list[tuple[int, ...]] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4  # query, key, value, attention output
        shapes += [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,)]


MODELS = {"resnet50": resnet50_shapes, "bert_base": bert_base_shapes}


def buckets(dense_bytes: int) -> int:
    """DDP's buckets for a model of `dense_bytes`: the first of 1 MiB, then 25 MiB each."""
    return 1 + math.ceil(max(0, dense_bytes - FIRST_BUCKET_BYTES) / BUCKET_BYTES)


def traffic(method: str, shapes: list[tuple[int, ...]], seed: int = 0,
            device: str = "cpu", ranks: int = 1) -> dict[str, Any]:
    """Per-step statistics of `method` on gradients of `shapes` (module docstring): payload
    bytes per rank, the collectives' kind and calls, and the pipeline's cost in reads of the
    gradient and in seconds (this process's CPU time; on a CUDA `device`, its time there).

    The pipeline runs in a world of one. Where its communicator does not sum payloads
    (allgather, broadcast, a parameter server's server), a rank of `ranks` checks and
    decodes every rank's payload, not one: the time of that for `ranks` copies of this
    rank's payloads, less for one, is added (`Communicator.aggregate_items`)."""
    torch.manual_seed(seed)
    named = [(f"p{i}", torch.randn(s, device=device)) for i, s in enumerate(shapes)]
    dense = 4 * sum(t.numel() for _, t in named)
    cfg = presets.compose(method)
    grace = build_grace(cfg)
    compressor = instantiate(cfg.compressor)
    comm = grace.communicator
    kind = comm.registry_name
    grace.step_many(named)  # warm-up: buffers, kernels, PowerSGD's Q
    grace.metrics.pop()
    cuda = torch.device(device).type == "cuda"
    step_s, read_s = best_of_each([lambda: grace.step_many(named),
                                   lambda: [t.sum() for _, t in named]], repeats=2, warmup=0,
                                  cuda=cuda)
    wire = grace.metrics.pop()["wire_bytes"] / 2
    if ranks > 1 and not comm.sums_payloads:
        items = [(*grace.compressor.compress(t, name), name) for name, t in named]
        own = [payload for payload, _, _ in items]
        one, every = best_of_each([lambda: comm.aggregate_items(items, [own]),
                                   lambda: comm.aggregate_items(items, [own] * ranks)],
                                  repeats=3, cuda=cuda)
        step_s += max(0.0, every - one)
        grace.metrics.pop()
    rounds = 2 if (compressor.registry_name == "powersgd"
                   or (kind == "allgather" and not compressor.capabilities().fixed_size)) else 1
    return {"method": method, "communicator": kind, "wire_bytes": wire, "dense_bytes": dense,
            "calls_per_bucket": rounds, "reads": step_s / read_s, "pipeline_s": step_s}


def step_stats(t: dict[str, Any], compute_s: float, tensors: int) -> dict[str, float]:
    """Per-step statistics of traffic `t` in a world of one rank (`gracecomm.network`'s
    keys): one collective per bucket (two where `t` needs them), the pipeline's cost in
    reads of the gradient on a V100 as its compression time."""
    exchanges = buckets(t["dense_bytes"])
    kind = "allgather" if t["communicator"] == "allgather" else "allreduce"
    overhead = t["reads"] * t["dense_bytes"] / HBM_BYTES_PER_S if t["method"] != "ddp" else 0.0
    return {calls_key(kind): exchanges * t["calls_per_bucket"], bytes_key(kind): t["wire_bytes"],
            "dense_bytes": t["dense_bytes"], "exchanges": exchanges, "tensors": tensors,
            "compute_s": compute_s, "compress_s": overhead}


def step_time(t: dict[str, Any], compute_s: float, nodes: int, net: Network) -> float:
    """Projected seconds per step of traffic `t` at `nodes` nodes of one rank on `net`."""
    stats = at_world_size(step_stats(t, compute_s, 0), 1, nodes)
    return net.project(stats, nodes)[f"projected_step_s@{net.label}"]


def hierarchy_grid(methods: dict[str, dict[str, Any]], compute_s: float,
                   tensors: int) -> dict[str, dict[str, dict[str, float]]]:
    """``nodes@Gbit/s`` -> method -> the flat and two-level projection at nodes of
    `RANKS_PER_NODE` ranks with NVLink inside (`gracecomm.network.project_hierarchies`)."""
    grid: dict[str, dict[str, dict[str, float]]] = {}
    for bw in BANDWIDTHS_GBPS:
        net = Network(bw, LATENCY_US, overhead=TCP_OVER_ETHERNET, intra_gbps=NVLINK_GBPS,
                      intra_latency_us=NVLINK_LATENCY_US)
        for method, t in methods.items():
            cells = project_hierarchies(step_stats(t, compute_s, tensors), 1, net, NODES,
                                        RANKS_PER_NODE)
            for nodes, cell in cells.items():
                grid.setdefault(f"{nodes}@{bw:g}", {})[method] = cell
    return grid


def reached(result: dict[str, Any], key: str) -> dict[str, float]:
    """method -> `key` of each run of a ``goal=accuracy`` netbench result that reached the
    target: a run that missed it has no time or steps to the target."""
    return {r["method"]: r[key] for r in result["runs"] if r["reached_target"]}


def steps_to_target(path: Path | None) -> dict[str, float]:
    """method -> steps to the target of a ``goal=accuracy`` netbench result (reached only)."""
    if path is None:
        return {}
    return reached(json.loads(Path(path).read_text()), "steps_to_target")


def grid_cell(methods: dict[str, dict[str, Any]], compute_s: float, steps: dict[str, float],
              nodes: int, bandwidth_gbps: float) -> dict[str, dict[str, float]]:
    """One cell of the grid: each method's projected step time at `nodes` nodes of one rank
    on links of `bandwidth_gbps` (``step_s``), and its time to accuracy where `steps` holds
    its steps to the target (``tta_s``)."""
    net = Network(bandwidth_gbps, LATENCY_US, overhead=TCP_OVER_ETHERNET)
    step = {m: step_time(t, compute_s, nodes, net) for m, t in methods.items()}
    return {"step_s": step, "tta_s": {m: step[m] * steps[m] for m in step if m in steps}}


def project(tta: Path | None = None) -> dict[str, Any]:
    """Every method's projected step time (and time to accuracy, where `tta` holds its
    steps) for every model, node count and bandwidth."""
    steps = steps_to_target(tta)
    out: dict[str, Any] = {
        "assumptions": {"latency_us": LATENCY_US, "overhead": TCP_OVER_ETHERNET,
                        "hbm_bytes_per_s": HBM_BYTES_PER_S, "algorithms": "ring",
                        "overlap": False, "ranks_per_node": 1,
                        "hierarchy": {"ranks_per_node": RANKS_PER_NODE,
                                      "intra_gbps": NVLINK_GBPS,
                                      "intra_latency_us": NVLINK_LATENCY_US}},
        "nodes": list(NODES), "bandwidths_gbps": list(BANDWIDTHS_GBPS),
        "load_before": list(os.getloadavg()), "tta_source": str(tta) if tta else None,
        "models": {}}
    for model, shapes_of in MODELS.items():
        shapes = shapes_of()
        compute = COMPUTE[model]["step_s"]
        methods = {m: traffic(m, shapes) for m in METHODS}
        grid = {f"{nodes}@{bw:g}": grid_cell(methods, compute, steps, nodes, bw)
                for bw in BANDWIDTHS_GBPS for nodes in NODES}
        out["models"][model] = {
            "parameters": sum(math.prod(s) for s in shapes),
            "compute_s": compute, "compute_source": COMPUTE[model]["source"],
            "methods": methods, "grid": grid,
            "hierarchy": hierarchy_grid(methods, compute, len(shapes))}
    out["load_after"] = list(os.getloadavg())
    return out


class Fastest(NamedTuple):
    """The method of least time among several, and its margins: another's time over its own."""

    method: str
    over_ddp: float | None  # None where plain DDP has no time
    runner_up: str | None  # None where it is the only method
    over_runner_up: float | None


def fastest(times: dict[str, float]) -> Fastest | None:
    """The method of least time in `times` (method -> seconds), with its margins over
    ``ddp`` and over the runner-up; None where `times` is empty."""
    if not times:
        return None
    best, *rest = sorted(times, key=times.get)
    second = rest[0] if rest else None
    return Fastest(best, times["ddp"] / times[best] if "ddp" in times else None, second,
                   times[second] / times[best] if second else None)


def winners(projection: dict[str, Any], model: str, key: str = "step_s"
            ) -> dict[tuple[int, float], tuple[str, float]]:
    """(nodes, Gbit/s) -> (fastest method, its speedup over ddp) by `key`; where the
    projection carries time-to-accuracy evidence, a method that missed the target there
    never wins, however short its step."""
    out = {}
    for cell, values in projection["models"][model]["grid"].items():
        nodes, bw = cell.split("@")
        times = values[key]
        if projection["tta_source"]:
            times = {m: t for m, t in times.items() if m in values["tta_s"]}
        found = fastest(times)
        if found is not None and found.over_ddp is not None:
            out[(int(nodes), float(bw))] = (found.method, found.over_ddp)
    return out


def plot(projection: dict[str, Any], path: Path) -> None:
    """Where each method wins: per model (and per goal: step time, time to accuracy where
    known), the fastest method at every node count and bandwidth, with its speedup."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = ["step_s"] + (["tta_s"] if projection["tta_source"] else [])
    models = list(projection["models"])
    fig, axes = plt.subplots(len(keys), len(models), figsize=(6 * len(models), 3.2 * len(keys)),
                             squeeze=False)
    names = sorted({w[0] for m in models for k in keys for w in winners(projection, m, k).values()})
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    nodes, bws = projection["nodes"], projection["bandwidths_gbps"]
    for row, key in enumerate(keys):
        for col, model in enumerate(models):
            ax = axes[row][col]
            cells = winners(projection, model, key)
            for (n, bw), (name, speedup) in cells.items():
                x, y = nodes.index(n), bws.index(bw)
                ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color=colors[name],
                                           alpha=0.75))
                ax.text(x, y, f"{name}\n{speedup:.1f}x", ha="center", va="center", fontsize=7)
            ax.set_xlim(-0.5, len(nodes) - 0.5)
            ax.set_ylim(-0.5, len(bws) - 0.5)
            ax.set_xticks(range(len(nodes)), [str(n) for n in nodes])
            ax.set_yticks(range(len(bws)), [f"{b:g}" for b in bws])
            ax.set_xlabel("nodes (one rank each)")
            ax.set_ylabel("Gbit/s per node")
            what = "step time" if key == "step_s" else "time to accuracy"
            ax.set_title(f"{model}: fastest by {what} (x: over DDP)", fontsize=9)
    fig.suptitle("Projected, not measured: cost model validated at 2-8 nodes "
                 "(assumptions in docs/cluster.md)", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSON file of the projection")
    parser.add_argument("--tta", type=Path, help="a goal=accuracy netbench.json (its steps)")
    parser.add_argument("--plot", type=Path, help="PNG: where each method wins")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = project(args.tta)
    args.out.write_text(json.dumps(result, indent=1))
    for model, data in result["models"].items():
        print(f"{model}: {data['parameters']:,} parameters, compute {data['compute_s']:.3f} "
              f"s/step ({data['compute_source']})")
        for (nodes, bw), (name, speedup) in sorted(winners(result, model).items()):
            step = data["grid"][f"{nodes}@{bw:g}"]["step_s"][name]
            print(f"  {nodes:>5} nodes, {bw:>5g} Gbit/s: {name} {speedup:.2f}x over ddp "
                  f"(step {step:.3f} s)")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
