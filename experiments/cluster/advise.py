"""Which method for this model on this cluster? (``gracecomm-advise``, configs/advise.yaml)

    gracecomm-advise                                     # ResNet-20, 4 nodes, 100 Mbit/s
    gracecomm-advise nodes=16 ranks_per_node=8 bandwidth_mbps=10000

What goes in, and where it comes from:

- **Compute per step**: one training step (forward, loss, backward) of the model on a batch
  of the data set, timed on this machine (`device`; best of `repeats`).
- **Bytes, collectives and compression cost per step**: each method's preset run on random
  tensors of the model's real gradient shapes in a world of one
  (`gracecomm.experiments.cluster.projection.traffic`), its whole pipeline step timed on
  this machine, with the decoding of every node's payload added where the communicator
  does not sum them (allgather: each rank decodes one payload per node).
- **Network** (`gracecomm.network.Network`): each node's link of `bandwidth_mbps`, a
  per-message latency, TCP's framing, ring collectives, no overlap of communication with
  the backward pass; nodes of `ranks_per_node` ranks exchange this library's methods in two
  levels (`gracecomm.network.project_hierarchies`; `ddp`, PyTorch's own exchange, flat).
- **Time to accuracy**: the projected step times the steps to the target that each method
  needed in a stored ``goal=accuracy`` netbench run (`evidence`), labelled with the model,
  data and cluster it came from: an assumption that the ratio of steps to the target
  carries over, which it need not. A method that missed the target there is flagged and
  never recommended; one the run did not include is ranked by step time after those with
  evidence, its time to the target unknown.

- **Contention** (``contention``): compute and compression are taken this many times slower
  than timed here, for ranks that share a core (the emulated cluster's 4 ranks on 2 CPUs).

``against=PATH`` checks the projection against a stored ``goal=step`` netbench result of the
emulated cluster: the cluster is that run's (nodes, ranks per node, link rate, and the
network its calibration measured: per-message latency that transfers overlap, the hosts'
rate, TCP's framing; `gracecomm.experiments.cluster.report.network_of`), the contention its
ranks' compute per step over one rank's alone (both stored), timed here as its ranks run
(one torch thread); the table then sets each method's projected step beside the measured
one, with the error.

Its last line is JSON: ``{"nodes", "ranks_per_node", "bandwidth_mbps", "ranking": [{"method",
"step_s", "time_to_target_s", "evidence"}]}``, best first (with ``against``, each entry adds
``measured_step_s``).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from gracecomm.config import guarded, instantiate
from gracecomm.experiments import presets
from gracecomm.experiments.bench.timing import best_of
from gracecomm.experiments.cluster.evidence import stored_runs
from gracecomm.experiments.cluster.projection import step_stats, traffic
from gracecomm.experiments.cluster.report import network_of
from gracecomm.experiments.workloads.tasks import make_task
from gracecomm.network import (
    TCP_OVER_ETHERNET,
    Network,
    at_world_size,
    project_hierarchies,
)
from gracecomm.validation import ConfigError, check_choice, check_range, error_line


def validate(cfg: DictConfig) -> None:
    """Every option in range, every method a preset, the evidence a readable file."""
    check_range(cfg.nodes, "advise", "nodes", 2, integer=True)
    check_range(cfg.ranks_per_node, "advise", "ranks_per_node", 1, integer=True)
    check_range(cfg.workload.batch_size, "advise", "workload.batch_size", 1, integer=True)
    check_range(cfg.repeats, "advise", "repeats", 1, integer=True)
    check_range(cfg.latency_us, "advise", "latency_us", 0.0)
    check_range(cfg.contention, "advise", "contention", 1.0, math.inf, high_open=True)
    if cfg.against is not None and not Path(cfg.against).is_file():
        raise ConfigError(f"advise: option 'against' names {cfg.against}, which is not a "
                          "file; give a goal=step netbench.json of topology=cluster, or null")
    against(cfg)
    for option in ("bandwidth_mbps", "intra_gbps"):
        value = cfg[option]
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
            raise ConfigError(f"advise: option '{option}' must be a positive, finite number "
                              f"of {'Mbit/s' if option == 'bandwidth_mbps' else 'Gbit/s'}, "
                              f"got {value!r}")
    check_choice(str(cfg.device).split(":")[0], ("cpu", "cuda"), "advise", "device")
    if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("advise: option 'device' is cuda, but torch sees no CUDA device; "
                          "use device=cpu")
    if not cfg.methods:
        raise ConfigError("advise: option 'methods' must list at least one method preset")
    presets.check([str(m) for m in cfg.methods], "advise")
    if cfg.evidence is not None and not Path(cfg.evidence).is_file():
        raise ConfigError(f"advise: option 'evidence' names {cfg.evidence}, which is not a "
                          "file; give a goal=accuracy netbench.json, or null")


def model_and_batch(cfg: DictConfig) -> tuple[torch.nn.Module, Any, Any, Any]:
    """The model (a config of configs/model/, or a class by import path built without
    arguments), one batch of the data set and its task."""
    work = cfg.workload
    by_path = "." in str(work.model)
    train = presets.train_config(f"data={work.data}",
                                 *([] if by_path else [f"model={work.model}"]))
    data = instantiate(train.data)
    model = get_class(str(work.model))() if by_path else instantiate(train.model)
    x, y = next(iter(DataLoader(data.train, batch_size=int(work.batch_size))))
    return model, x, y, make_task(data.task, data.task_options)


def compute_time(cfg: DictConfig) -> tuple[float, list[tuple[int, ...]]]:
    """Seconds of one training step of the model on this machine, and its gradients'
    shapes."""
    device = torch.device(str(cfg.device))
    model, x, y, task = model_and_batch(cfg)
    model, x, y = model.to(device), x.to(device), y.to(device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        task.loss(model(x), y).backward()

    seconds = best_of(step, int(cfg.repeats), warmup=1, cuda=device.type == "cuda")
    return seconds, [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def network(cfg: DictConfig) -> Network:
    """Each node's link, as configured, or as the run of ``against`` calibrated it."""
    if cfg.against is not None:
        return network_of(stored(cfg))
    return Network(float(cfg.bandwidth_mbps) / 1000, float(cfg.latency_us),
                   overhead=TCP_OVER_ETHERNET, intra_gbps=cfg.intra_gbps)


def stored(cfg: DictConfig) -> dict[str, Any]:
    """The netbench result of ``against``."""
    return json.loads(Path(cfg.against).read_text(encoding="utf-8"))


def against(cfg: DictConfig) -> DictConfig:
    """`cfg` with the cluster of ``against`` (module docstring): its nodes, ranks per node,
    link rate and contention; `cfg` itself without it."""
    if cfg.against is None:
        return cfg
    result = stored(cfg)
    if result.get("topology") != "cluster" or result.get("goal", "step") != "step":
        raise ConfigError(f"advise: option 'against' names {cfg.against}, which is not a "
                          "goal=step netbench result of topology=cluster")
    timed = [row["compute_s"] for row in result["runs"] if row["comm_timed"]]
    return OmegaConf.merge(cfg, {
        "nodes": result["world_size"], "ranks_per_node": result["ranks_per_node"],
        "bandwidth_mbps": result["bandwidth_mbps"],
        "contention": statistics.median(timed) / result["compute_alone_s"]})


def projected_step(cfg: DictConfig, t: dict[str, Any], compute_s: float,
                   tensors: int) -> tuple[float, str]:
    """The step time of traffic `t` on the configured cluster, and the hierarchy it was
    projected with (two levels for this library's methods on nodes of several ranks)."""
    stats = step_stats(t, compute_s, tensors)
    stats["compress_s"] = 0.0 if t["method"] == "ddp" else t["pipeline_s"]  # this machine's
    nodes, per_node, net = int(cfg.nodes), int(cfg.ranks_per_node), network(cfg)
    if per_node == 1:
        return net.project(at_world_size(stats, 1, nodes), nodes)[
            f"projected_step_s@{net.label}"], "flat"
    cell = project_hierarchies(stats, 1, net, [nodes], per_node)[nodes]
    if presets.exchange(t["method"]) == "torch":
        return cell["flat_step_s"], "flat"
    return cell["node_step_s"], "node"


def rank(cfg: DictConfig) -> dict[str, Any]:
    """Every method's projected step and time to the target, best first (module
    docstring): those with evidence that reached the target, then those without evidence,
    then those that missed it."""
    cfg = against(cfg)
    threads = torch.get_num_threads()
    if cfg.against is not None:
        torch.set_num_threads(1)  # as the cluster's ranks run
    try:
        compute_s, shapes = compute_time(cfg)
        traffics = [traffic(method, shapes, device=str(cfg.device), ranks=int(cfg.nodes))
                    for method in map(str, cfg.methods)]
    finally:
        torch.set_num_threads(threads)
    runs, label, _ = stored_runs(cfg.evidence)
    measured = ({row["method"]: row["step_s"] for row in stored(cfg)["runs"]}
                if cfg.against is not None else {})
    slowed = float(cfg.contention)
    rows = []
    for method, t in zip(map(str, cfg.methods), traffics):
        t = {**t, "pipeline_s": slowed * t["pipeline_s"]}
        step_s, hierarchy = projected_step(cfg, t, slowed * compute_s, len(shapes))
        run = runs.get(method)
        reached = run is not None and run["reached_target"]
        verdict = (f"reached the target in {run['steps_to_target']} steps" if reached else
                   "missed the target: not recommended" if run is not None else
                   "unknown: no stored run")
        rows.append({"method": method, "hierarchy": hierarchy, "step_s": step_s,
                     "time_to_target_s": step_s * run["steps_to_target"] if reached else None,
                     "verdict": verdict,
                     "evidence": f"{verdict} ({label})" if run is not None else verdict,
                     "missed": run is not None and not reached,
                     "wire_bytes": t["wire_bytes"], "compress_s": t["pipeline_s"],
                     **({"measured_step_s": measured.get(method)} if measured else {})})
    rows.sort(key=lambda r: (r["missed"], r["time_to_target_s"] is None,
                             r["time_to_target_s"] or r["step_s"]))
    return {"nodes": int(cfg.nodes), "ranks_per_node": int(cfg.ranks_per_node),
            "bandwidth_mbps": float(cfg.bandwidth_mbps), "model": str(cfg.workload.model),
            "evidence": label or None, "against": cfg.against, "contention": slowed,
            "compute_s": compute_s, "parameters": sum(math.prod(s) for s in shapes),
            "ranking": rows}


def table(result: dict[str, Any]) -> str:
    """The ranking as a Markdown table, with the setting it was projected for."""
    checked = result.get("against") is not None
    slowed = (f"; compute and compression x{result['contention']:.2f} for contention"
              if result.get("contention", 1.0) != 1.0 else "")
    lines = [f"{result['model']} ({result['parameters']:,} parameters; one step "
             f"{1e3 * result['compute_s']:.1f} ms here{slowed}) on {result['nodes']} nodes x "
             f"{result['ranks_per_node']} rank(s), {result['bandwidth_mbps']:g} Mbit/s per "
             "node", "", "| rank | method | exchange | step ms | time to target s | "
             "KB/step | compression ms | stored run |"
             + (" measured step ms | error |" if checked else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if checked else "")]
    for i, row in enumerate(result["ranking"], 1):
        tta = "-" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f}"
        line = (f"| {'-' if row['missed'] else i} | `{row['method']}` | "
                f"{row['hierarchy']} | {1e3 * row['step_s']:.1f} | {tta} | "
                f"{row['wire_bytes'] / 1000:.1f} | {1e3 * row['compress_s']:.1f} | "
                f"{row['verdict']} |")
        if checked:
            step = row.get("measured_step_s")
            line += (f" {1e3 * step:.1f} | {100 * (row['step_s'] / step - 1):+.0f}% |"
                     if step else " - | - |")
        lines.append(line)
    source = (f"Stored run: {result['evidence']} (time to target: the projected step times "
              "its steps there)." if result["evidence"] else
              "No stored goal=accuracy run (option 'evidence'): times to target unknown.")
    if checked:
        source += (f" Measured: {result['against']} (the cluster's calibrated network and "
                   "contention).")
    return "\n".join([*lines, "", source])


def render_checks(paths: list[Path]) -> str:
    """``advise.json`` of runs with ``against`` (one per link rate): each method's projected
    step beside the measured one, and the error."""
    lines = ["| link | method | projected step ms | measured step ms | error |",
             "|---|---|---|---|---|"]
    for result in sorted((json.loads(p.read_text(encoding="utf-8")) for p in paths),
                         key=lambda r: r["bandwidth_mbps"]):
        for row in result["ranking"]:
            step = row.get("measured_step_s")
            if step:
                lines.append(f"| {result['bandwidth_mbps']:g} Mbit/s | `{row['method']}` | "
                             f"{1e3 * row['step_s']:.1f} | {1e3 * step:.1f} | "
                             f"{100 * (row['step_s'] / step - 1):+.0f}% |")
    return "\n".join(lines)


def summary_line(result: dict[str, Any]) -> dict[str, Any]:
    """The last line's JSON (module docstring)."""
    keys = ("method", "step_s", "time_to_target_s", "evidence", "measured_step_s")
    return {key: result[key] for key in ("nodes", "ranks_per_node", "bandwidth_mbps")} | {
        "ranking": [{key: row[key] for key in keys if key in row}
                    for row in result["ranking"]]}


@hydra.main(version_base="1.3", config_path="../../configs", config_name="advise")
def advise_job(cfg: DictConfig) -> None:
    try:
        validate(cfg)
    except ConfigError as err:
        print(error_line(err), file=sys.stderr, flush=True)
        sys.exit(1)
    result = rank(cfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    (out_dir / "advise.json").write_text(json.dumps(result, indent=1))
    print(table(result), flush=True)
    print(json.dumps(summary_line(result)), flush=True)


main = guarded(advise_job)  # every composed config checked first (`gracecomm.config.guarded`)

if __name__ == "__main__":
    main()
