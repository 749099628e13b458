"""Real speed on a slow link: every method trains on a shaped network, and its measured step
time (``goal=step``) or its time to a target accuracy (``goal=accuracy``) is printed next to
plain DDP's and next to the cost model's projection (`gracecomm.network`) for the same run
and link.

    gracecomm-netbench                                   # 100 Mbit/s, configs/netbench.yaml
    gracecomm-netbench bandwidth_mbps=1000 'methods=[ddp,topk]'
    gracecomm-netbench topology=cluster world_size=4     # 4 nodes, each its own 100 Mbit/s link
    gracecomm-netbench topology=cluster goal=accuracy bandwidth_mbps=10 'methods=[ddp,topk]'

Topologies:

- ``loopback``: one private network namespace whose loopback is shaped with a token bucket
  (``tc qdisc ... tbf``) at ``bandwidth_mbps`` (and ``netem`` delay when ``latency_ms`` >
  0); the ``world_size`` ranks of each method (`gracecomm.experiments.training`'s local
  workers) run inside it on 127.0.0.1, every byte of every rank through the one bucket.
  Projected with ``shared=True`` (a hub).
- ``cluster``: ``world_size`` nodes, each a namespace with its own address and a link of
  ``bandwidth_mbps`` in each direction to a bridge (`gracecomm.experiments.cluster.emulation`), each
  node's ``ranks_per_node`` ranks started by ``torchrun`` in its namespace. Projected on
  switched links with Gloo's algorithms (binomial broadcast), TCP's framing
  (`gracecomm.network.TCP_OVER_ETHERNET`) and a latency per message that its transfer
  overlaps (`gracecomm.network.Network.overlap`: the wait for the receiving rank to be
  scheduled on this machine's shared CPUs).

Methods are presets of ``configs/method/`` (`gracecomm.experiments.presets`). The per-message
latency is measured on the shaped network by a calibration of small allreduces.

``hierarchies`` (``flat``, ``node``; default ``[flat]``): each method runs once per
hierarchy, the ``node`` run with ``exchange.hierarchy=node`` (dense inside a node,
compressed across nodes; ``topology=cluster`` only) and named ``METHOD@node``, except for
methods that run PyTorch's own exchange (``ddp``, ``torch_*``: flat only); a ``flat``
run passes nothing (flat is the trainer's default) and keeps the method's name.
``strategies`` (``fixed``, ``auto``; default ``[fixed]``) likewise: an ``auto`` run passes
``exchange.strategy=auto`` (each tensor sent compressed, in fp16 or dense as the cost model
chooses, `gracecomm.strategy`) and is named ``METHOD@auto`` (``METHOD@node@auto`` with both).
Each run carries its ``hierarchy`` and ``strategy`` in the JSON, and an ``auto`` run in
``netbench.json`` its last ``decision`` (tensors per form, the probed link, the seconds its
decisions took). On the
cluster, every run's ``cross_node_bytes_per_step`` is counted by the links themselves: the
bytes the nodes' uplinks sent (``tc -s``, `gracecomm.experiments.cluster.emulation.
EmulatedCluster.link_bytes`, framing included), less those of a run of the same method of
``warmup_steps`` steps (at least 1: start-up, DDP's first broadcast and the final
evaluation, which both runs share), over the steps the longer run had in addition; with
``goal=accuracy`` that includes its evaluations.

``goal=step``: each method trains ``warmup_steps + steps`` steps, ``rounds`` times in turn;
the table holds the median step time and the speedup over the baseline, measured and
projected. ``goal=accuracy``: the target is ``accuracy.target_accuracy``, or else
``accuracy.target_fraction`` of the baseline's final test accuracy after
``accuracy.max_steps`` steps (a reference run without shaping: the link changes the time of
a step, not its arithmetic); each method then trains until its test accuracy, evaluated
every ``accuracy.eval_every_steps`` steps, reaches the target, or ``accuracy.max_steps``.
Its time to target is the training wall-clock time at that evaluation (from its first step,
evaluations excluded); a run that misses says so (``reached_target: false``, its
``time_to_target_s`` then the whole run's time, a lower bound). With ``accuracy.rounds``
above 1 the methods train to the target that often, in turn, round r with the training
seed plus r (the steps to a target move with the initialisation and the data order as much
as between methods that send near-exact gradients), and each row is the method's median
round (by time to target; of an even count, the faster middle one), with every round's
``time_to_target_s``, ``steps_to_target`` and ``reached_target`` in ``rounds``.
A plot of test accuracy against wall-clock time, every method on one figure (its median
round), is written next to ``netbench.json``.

The last line of output is one JSON object: ``{"bandwidth_mbps", "topology", "world_size",
"runs": [{"method", "hierarchy", "strategy", "step_s", "dense_step_s", "measured_speedup",
"projected_speedup", "cross_node_bytes_per_step" (cluster only)}, ...]}``,
with ``goal=accuracy`` each run adding ``time_to_target_s``, ``target_accuracy``,
``final_accuracy``, ``reached_target``, ``steps_to_target`` (and ``tta_speedup`` where the
baseline reached the target). Needs root and iproute2 (``ip``, ``tc``); namespaces, links
and processes are removed when the benchmark ends, also on an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from gracecomm.config import guarded
from gracecomm.experiments import presets
from gracecomm.experiments.cluster.emulation import (
    ClusterError,
    Link,
    check_size,
    die_with_launcher,
    sigterm_as_exit,
)
from gracecomm.experiments.cluster.report import plot_accuracy
from gracecomm.experiments.cluster.topologies import (
    TOPOLOGY,
    NetbenchError,
    train_args,
)
from gracecomm.experiments.reports.tables import Run, read_run
from gracecomm.experiments.training.launch import torchrun_standalone
from gracecomm.hierarchy import HIERARCHIES
from gracecomm.network import (
    COLLECTIVE_KEYS,
    LEVEL_KEYS,
    NODE_COLLECTIVE_KEYS,
    OVERHEAD_KEYS,
    Network,
)
from gracecomm.strategy import FORMS, STRATEGIES
from gracecomm.validation import ConfigError, check_choice, check_range

TOPOLOGIES = ("loopback", "cluster")
# per-step medians kept with each run, to project it elsewhere (experiments/cluster/report.py)
STAT_KEYS = (*COLLECTIVE_KEYS, *NODE_COLLECTIVE_KEYS, *LEVEL_KEYS, *OVERHEAD_KEYS, "compute_s",
             "comm_s", "step_s", "dense_bytes", "exchanges", "tensors", "wire_bytes")
GOALS = ("step", "accuracy")


def step_overrides(steps: int) -> list[str]:
    """``goal=step``: `steps` steps, no evaluation until the end."""
    return [f"trainer.max_steps={steps}", "trainer.epochs=1000", "trainer.eval_every=1000"]


# the options that run each method once per value: (option, exchange key, values), the
# first value the trainer's default, which a run's name does not show (``METHOD@node@auto``)
VARIANTS = (("hierarchies", "hierarchy", HIERARCHIES), ("strategies", "strategy", STRATEGIES))


def variant_of(name: str, values: tuple[str, ...]) -> str:
    """Which of `values` run `name` has (its ``@`` tags; none: the first, the default)."""
    return next((tag for tag in name.split("@")[1:] if tag in values), values[0])


def setup_steps(cfg: DictConfig) -> int:
    """Steps of the run whose link bytes every run of a method less (module docstring)."""
    return max(1, int(cfg.warmup_steps))


def per_step(total: int | None, setup: int | None, steps: int, cfg: DictConfig) -> float | None:
    """Link bytes per step of a run of `steps` steps that carried `total`, less the `setup`
    of a run of `setup_steps` (module docstring); None where not counted."""
    extra = steps - setup_steps(cfg)
    if total is None or setup is None or extra < 1:
        return None
    return (total - setup) / extra


def finished(run_dir: Path) -> Run:
    run = read_run(run_dir)
    if run is None:
        raise NetbenchError(f"{run_dir}: the run wrote no summary (it did not finish)")
    return run


def summarise(method: str, rounds: list[list[dict[str, Any]]], network: Network,
              ranks: int) -> dict[str, Any]:
    """Medians over the measured steps of every round (`rounds`: each round's step records
    after its warm-up) and of each step's projection on `network` at `ranks` ranks, and the
    lowest and highest of the rounds' own median step times."""
    kept = [r for records in rounds for r in records]
    median = lambda key: statistics.median(r[key] for r in kept)  # noqa: E731
    projected = [network.project(r, ranks) for r in kept]
    label = network.label
    per_round = [statistics.median(r["step_s"] for r in records) for records in rounds]
    comm_timed = "comm_s" in kept[0]
    return {"method": method, **{key: variant_of(method, values) for _, key, values in VARIANTS},
            "step_s": median("step_s"),
            "round_step_s": [min(per_round), max(per_round)],
            "projected_step_s": statistics.median(p[f"projected_step_s@{label}"]
                                                  for p in projected),
            "projected_dense_step_s": statistics.median(p[f"dense_step_s@{label}"]
                                                        for p in projected),
            "compute_s": median("compute_s"), "comm_timed": comm_timed,
            "comm_s": median("comm_s") if comm_timed else 0.0,
            "overhead_s": statistics.median(sum(r.get(k, 0.0) for k in (
                "compress_s", "decompress_s", "memory_s")) for r in kept),
            "wire_bytes": median("wire_bytes"), "steps": len(kept),
            "stats": {key: median(key) for key in STAT_KEYS if key in kept[0]}}


def check_options(cfg: DictConfig) -> None:
    """Every option's value, before any namespace is made."""
    check_choice(cfg.topology, TOPOLOGIES, "netbench", "topology")
    check_choice(cfg.goal, GOALS, "netbench", "goal")
    check_range(cfg.bandwidth_mbps, "netbench", "bandwidth_mbps", 0.0, math.inf,
                low_open=True, high_open=True)  # tc shapes a finite rate
    check_range(cfg.latency_ms, "netbench", "latency_ms", 0.0, math.inf, high_open=True)
    check_range(cfg.steps, "netbench", "steps", 1, integer=True)
    check_range(cfg.warmup_steps, "netbench", "warmup_steps", 0, integer=True)
    check_range(cfg.rounds, "netbench", "rounds", 1, integer=True)
    check_range(cfg.world_size, "netbench", "world_size", 2, integer=True)
    for option, key, values in VARIANTS:
        check_variants(cfg, option, key, values)
    if "node" in cfg.hierarchies and cfg.topology != "cluster":
        raise ConfigError("netbench: option 'hierarchies' may hold node only with "
                          "topology=cluster (topology=loopback runs every rank on one node)")
    if cfg.topology == "cluster":
        Link(float(cfg.bandwidth_mbps), float(cfg.latency_ms), float(cfg.jitter_ms),
             float(cfg.loss_pct))
        check_size(int(cfg.world_size), int(cfg.ranks_per_node))
    elif cfg.jitter_ms or cfg.loss_pct or cfg.ranks_per_node != 1:
        raise ConfigError("netbench: jitter_ms, loss_pct and ranks_per_node are options of "
                          "topology=cluster; topology=loopback takes world_size ranks and "
                          "latency_ms")
    acc = cfg.accuracy
    check_range(acc.max_steps, "netbench", "accuracy.max_steps", 1, integer=True)
    check_range(acc.eval_every_steps, "netbench", "accuracy.eval_every_steps", 1,
                integer=True)
    check_range(acc.rounds, "netbench", "accuracy.rounds", 1, integer=True)
    check_range(acc.target_fraction, "netbench", "accuracy.target_fraction", 0.0, 1.0,
                low_open=True)
    if acc.target_accuracy is not None:
        check_range(acc.target_accuracy, "netbench", "accuracy.target_accuracy", 0.0, 1.0,
                    low_open=True)


def check_variants(cfg: DictConfig, option: str, key: str, allowed: tuple[str, ...]) -> None:
    """`option` (``hierarchies``, ``strategies``): a list of distinct `allowed` values, and
    the exchange's `key` chosen there, not in ``overrides``."""
    values = list(cfg[option]) if OmegaConf.is_list(cfg[option]) else None
    if not values or len(set(map(str, values))) < len(values):
        raise ConfigError(f"netbench: option '{option}' must list distinct {option} of "
                          f"{', '.join(allowed)}, got {cfg[option]}")
    for value in values:
        check_choice(str(value), allowed, "netbench", option)
    if any(str(o).lstrip("+~").startswith(f"exchange.{key}") for o in cfg.overrides):
        raise ConfigError(f"netbench: option 'overrides' sets exchange.{key}; choose it "
                          f"with '{option}' instead (e.g. '{option}=[{','.join(allowed)}]')")


def plan(cfg: DictConfig) -> list[tuple[str, list[str]]]:
    """(name, overrides) of every run, the baseline first, sync variants after their method
    (``goal=step`` only), each once per hierarchy and strategy (``METHOD@node@auto``)."""
    check_options(cfg)
    names = presets.check([str(cfg.baseline)] + [str(m) for m in cfg.methods
                                                  if m != cfg.baseline], "netbench")
    topology = TOPOLOGY[str(cfg.topology)](cfg)
    runs = []
    for name in names:
        overrides = [*cfg.overrides, *presets.overrides(name), *topology.overrides()]
        variants = [(name, overrides)]
        if cfg.also_sync and cfg.goal == "step" and presets.exchange(name) == "hook":
            variants.append((f"{name}_sync", [*overrides, "trainer.exchange=hook_sync"]))
        # PyTorch's own exchange (plain DDP, its hooks) is flat and fixed: not repeated
        for option, key, values in VARIANTS:
            chosen = [str(v) for v in cfg[option]
                      if v == values[0] or presets.exchange(name) != "torch"]
            variants = [(variant, overrides) if v == values[0] else
                        (f"{variant}@{v}", [*overrides, f"exchange.{key}={v}"])
                        for variant, overrides in variants for v in chosen]
        runs += variants
    return runs


def validate_runs(runs: list[tuple[str, list[str]]]) -> None:
    """Compose and check every run's training config as the trainer will (bad options fail
    here, before any namespace exists)."""
    from gracecomm.experiments.training.config import validate
    for name, overrides in runs:
        try:
            validate(presets.train_config(*overrides))
        except ConfigError as err:
            raise ConfigError(f"netbench: method '{name}': {err}") from None


def setup_bytes(cfg: DictConfig, topology: Any, runs: list[tuple[str, list[str]]],
                out_dir: Path) -> dict[str, int | None]:
    """Per run: the link bytes of a run of `setup_steps` steps (module docstring), where the
    topology counts them."""
    if not topology.counts_links:
        return {name: None for name, _ in runs}
    return {name: topology.train([*overrides, *step_overrides(setup_steps(cfg))],
                                 out_dir / f"{name}.setup", float(cfg.timeout_s))
            for name, overrides in runs}


def measure_steps(cfg: DictConfig, topology: Any, runs: list[tuple[str, list[str]]],
                  network: Network, out_dir: Path) -> list[dict[str, Any]]:
    """``goal=step``: every run `rounds` times in turn, summarised."""
    measured: dict[str, list[list[dict[str, Any]]]] = {name: [] for name, _ in runs}
    counted: dict[str, list[int | None]] = {name: [] for name, _ in runs}
    decided: dict[str, dict[str, Any]] = {}  # the last round's decision, per run
    warmup, steps = int(cfg.warmup_steps), int(cfg.steps)
    setup = setup_bytes(cfg, topology, runs, out_dir)
    for round_ in range(int(cfg.rounds)):  # methods in turn, so load drifts hit all alike
        for name, overrides in runs:
            run_dir = out_dir / f"{name}.{round_}"
            counted[name].append(topology.train([*overrides, *step_overrides(warmup + steps)],
                                                run_dir, float(cfg.timeout_s)))
            run = finished(run_dir)
            records = run.steps[warmup:]
            measured[name].append(records)
            decided[name] = decision_fields(run)
            step_ms = 1e3 * statistics.median(r["step_s"] for r in records)
            print(f"round {round_ + 1}, {name}: {step_ms:.1f} ms/step", flush=True)
    rows = []
    for name, _ in runs:
        total = None if None in counted[name] else statistics.median(counted[name])
        rows.append({**summarise(name, measured[name], network, topology.ranks),
                     **link_fields(per_step(total, setup[name], warmup + steps, cfg)),
                     **decided[name]})
    return rows


def decision_fields(run: Run) -> dict[str, Any]:
    """An ``exchange.strategy=auto`` run's last decision (`gracecomm.strategy`): how many
    tensors went in each form, the probed link and the seconds the decisions took."""
    decided = run.summary.get("strategy")
    if not decided:
        return {}
    return {"decision": {"forms": {form: sum(b[form] for b in decided["buckets"])
                                   for form in FORMS},
                         "buckets": len(decided["buckets"]), "link": decided["link"],
                         "step_penalty": decided.get("step_penalty"),
                         "decide_s": sum(r.get("decide_s", 0.0) for r in run.steps)}}


def link_fields(bytes_per_step: float | None) -> dict[str, float]:
    """``cross_node_bytes_per_step`` where the links counted it."""
    return {} if bytes_per_step is None else {"cross_node_bytes_per_step": bytes_per_step}


def reference_accuracy(cfg: DictConfig, runs: list[tuple[str, list[str]]], ranks: int,
                       out_dir: Path) -> dict[str, Any]:
    """The baseline's final test accuracy after ``accuracy.max_steps`` steps, from a run of
    `ranks` local workers on the unshaped loopback (the same arithmetic as on the cluster:
    the link changes how long a step takes, not what it computes)."""
    name, overrides = runs[0]
    run_dir = out_dir / f"reference_{name}"
    args = train_args([*overrides, *accuracy_overrides(cfg, None),
                       f"trainer.world_size={ranks}"], run_dir, float(cfg.timeout_s))
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=float(cfg.timeout_s) + 60, preexec_fn=die_with_launcher)
    if done.returncode:
        raise NetbenchError(f"the reference run of {name} failed:\n{done.stdout[-2000:]}"
                            f"{done.stderr[-2000:]}")
    run = finished(run_dir)
    metric = run.summary["metric"]
    final = float(run.summary[metric])
    print(f"reference: {name} reaches test accuracy {final:.4f} after "
          f"{cfg.accuracy.max_steps} steps (unshaped, {ranks} ranks)", flush=True)
    return {"method": name, "final_accuracy": final, "steps": run.summary["steps"],
            "curve": [[e["step"], e[metric]] for e in run.evals]}


def compute_alone(cfg: DictConfig, out_dir: Path) -> float:
    """The median compute time of a step of one rank alone on this machine (the dense
    preset, unshaped, ``warmup_steps + steps`` steps, started by torchrun with one torch
    thread as the cluster's ranks are): what each rank's compute takes without the others
    contending for the CPUs."""
    run_dir = out_dir / "alone"
    args = train_args([*cfg.overrides, *presets.overrides("dense"),
                       *step_overrides(int(cfg.warmup_steps) + int(cfg.steps))],
                      run_dir, float(cfg.timeout_s))
    done = subprocess.run([*torchrun_standalone(1, run_dir / "torchelastic"), *args],
                          capture_output=True, text=True,
                          timeout=float(cfg.timeout_s) + 60, preexec_fn=die_with_launcher,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise NetbenchError(f"the single-rank compute run failed:\n{done.stdout[-2000:]}"
                            f"{done.stderr[-2000:]}")
    records = finished(run_dir).steps[int(cfg.warmup_steps):]
    return statistics.median(r["compute_s"] for r in records)


def accuracy_overrides(cfg: DictConfig, target: float | None) -> list[str]:
    acc = cfg.accuracy
    return [f"trainer.max_steps={acc.max_steps}", "trainer.epochs=100000",
            "trainer.eval_every=100000", f"trainer.eval_every_steps={acc.eval_every_steps}",
            *([f"trainer.stop_at={target}"] if target is not None else [])]


def time_to_target(run: Run, target: float, warmup: int) -> dict[str, Any]:
    """The first evaluation at or above `target`: its training time and step; a run that
    never reached it reports its whole training time and steps, with ``reached_target``
    false."""
    metric = run.summary["metric"]
    evals = [e for e in run.evals if "train_time_s" in e]
    hit = next((e for e in evals if e[metric] >= target), None)
    last = evals[-1]
    measured = run.steps[warmup:] or run.steps
    return {"reached_target": hit is not None,
            "time_to_target_s": (hit or last)["train_time_s"],
            "steps_to_target": (hit or last)["step"],
            "final_accuracy": float(last[metric]), "target_accuracy": target,
            "curve": [[e["train_time_s"], e[metric], e["step"]] for e in evals],
            "step_records": measured}


def measure_accuracy(cfg: DictConfig, topology: Any, runs: list[tuple[str, list[str]]],
                     network: Network, target: float, out_dir: Path) -> list[dict[str, Any]]:
    """``goal=accuracy``: every run until `target` or the step limit, ``accuracy.rounds``
    times in turn (so load drifts hit all alike), round r with the run's seed plus r (every
    method a round's initialisation and data order); each run's row is its median round."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in runs}
    warmup, count = int(cfg.warmup_steps), int(cfg.accuracy.rounds)
    setup = setup_bytes(cfg, topology, runs, out_dir)
    seeds = {name: int(presets.train_config(*overrides).seed) for name, overrides in runs}
    for round_ in range(count):
        for name, overrides in runs:
            run_dir = out_dir / (name if count == 1 else f"{name}.{round_}")
            total = topology.train([*overrides, *accuracy_overrides(cfg, target),
                                    f"seed={seeds[name] + round_}"], run_dir,
                                   float(cfg.timeout_s))
            run = finished(run_dir)
            tta = time_to_target(run, target, warmup)
            records = tta.pop("step_records")
            rounds[name].append({**summarise(name, [records], network, topology.ranks), **tta,
                                 **link_fields(per_step(total, setup[name], len(run.steps),
                                                        cfg)),
                                 **decision_fields(run)})
            print(f"{'' if count == 1 else f'round {round_ + 1}, '}{name}: "
                  f"{'reached' if tta['reached_target'] else 'missed'} {target:.4f} "
                  f"after {tta['steps_to_target']} steps, {tta['time_to_target_s']:.1f} s "
                  f"(final {tta['final_accuracy']:.4f})", flush=True)
    return [median_round(rounds[name]) for name, _ in runs]


def median_round(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of the median round by time to target (of an even count, the faster middle
    one), with every round's time, steps and whether it reached the target in ``rounds``
    where there were several."""
    if len(rows) == 1:
        return rows[0]
    ranked = sorted(rows, key=lambda row: row["time_to_target_s"])
    return {**ranked[(len(rows) - 1) // 2],
            "rounds": [{key: row[key] for key in ("time_to_target_s", "steps_to_target",
                                                  "reached_target")} for row in rows]}


def provenance() -> dict[str, Any]:
    """What produced the numbers: the command line, the commit, the machine's load."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True,
                                  cwd=here).stdout.strip()
        except OSError:  # no git: an installed package
            return ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " with uncommitted changes"
    return {"command": " ".join(["gracecomm-netbench", *sys.argv[1:]]), "commit": commit,
            "cpus": len(os.sched_getaffinity(0)), "load_before": list(os.getloadavg()),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def benchmark(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    runs = plan(cfg)
    validate_runs(runs)
    topology = TOPOLOGY[str(cfg.topology)](cfg)
    result: dict[str, Any] = {"provenance": provenance()}
    target = None
    if cfg.goal == "accuracy":
        reference = None
        target = cfg.accuracy.target_accuracy
        if target is None:
            reference = reference_accuracy(cfg, runs, topology.ranks, out_dir)
            target = float(cfg.accuracy.target_fraction) * reference["final_accuracy"]
            reference["target_fraction"] = float(cfg.accuracy.target_fraction)
        result["reference"] = reference
    alone = compute_alone(cfg, out_dir)
    print(f"compute of one rank alone: {1e3 * alone:.1f} ms/step", flush=True)
    with sigterm_as_exit(), topology.up():
        network = topology.calibrate(out_dir)
        latency_us = network.latency_us
        host = (f"; the hosts move {network.host_gbps:.3g} Gbit/s of payload"
                if network.host_gbps else "")
        print(f"calibrated per-message latency: {latency_us:.0f} us{host}", flush=True)
        if target is None:
            rows = measure_steps(cfg, topology, runs, network, out_dir)
        else:
            rows = measure_accuracy(cfg, topology, runs, network, float(target), out_dir)
    base = rows[0]
    for row in rows:
        row["dense_step_s"] = base["step_s"]
        row["measured_speedup"] = base["step_s"] / row["step_s"]
        row["projected_speedup"] = row["projected_dense_step_s"] / row["projected_step_s"]
        if target is not None and base["reached_target"]:
            row["tta_speedup"] = base["time_to_target_s"] / row["time_to_target_s"]
    result["provenance"]["load_after"] = list(os.getloadavg())
    result.update({"bandwidth_mbps": float(cfg.bandwidth_mbps),
                   "latency_ms": float(cfg.latency_ms), "topology": str(cfg.topology),
                   "goal": str(cfg.goal), "world_size": int(cfg.world_size),
                   **{option: [str(v) for v in cfg[option]] for option, _, _ in VARIANTS},
                   "ranks_per_node": int(cfg.ranks_per_node), "ranks": topology.ranks,
                   "latency_us_calibrated": latency_us, "compute_alone_s": alone,
                   "network": {"overhead": network.overhead, "broadcast": network.broadcast,
                               "shared": network.shared, "host_gbps": network.host_gbps,
                               "overlap": network.overlap, "intra_gbps": network.intra_gbps,
                               "intra_latency_us": network.intra_latency_us},
                   "runs": rows})
    if target is not None:
        result["target_accuracy"] = float(target)
    return result


def format_table(result: dict[str, Any]) -> str:
    """The step-time table, or with ``goal=accuracy`` the time-to-accuracy table. A run
    whose exchange is not timed (plain DDP) has no projected step or compute time of its
    own (``-``): the projection of its speedup is the dense baseline by definition."""
    rows = result["runs"]
    contention = ""
    if "compute_alone_s" in result:
        timed = [r["compute_s"] for r in rows if r["comm_timed"]]
        cpus = result.get("provenance", {}).get("cpus", "?")
        contention = (f"\n{result['ranks']} ranks on {cpus} CPUs: compute per step "
                      f"{1e3 * min(timed, default=math.nan):.1f}-"
                      f"{1e3 * max(timed, default=math.nan):.1f} ms (the slowest rank's) against "
                      f"{1e3 * result['compute_alone_s']:.1f} ms for one rank alone"
                      if timed else "")
    where = (f"{result['world_size']} nodes x {result['ranks_per_node']} rank(s), each node "
             f"its own link of {result['bandwidth_mbps']:g} Mbit/s"
             if result.get("topology") == "cluster" else
             f"shaped loopback at {result['bandwidth_mbps']:g} Mbit/s")
    if result.get("goal") == "accuracy":
        lines = [f"{where}; time to test accuracy {result['target_accuracy']:.4f} (training "
                 f"wall-clock, evaluations excluded){contention}",
                 f"{'method':<16}{'reached':>8}{'steps':>7}{'time s':>9}{'speedup':>9}"
                 f"{'final acc':>10}{'step ms':>9}{'compute ms':>11}{'KB/step':>9}"]
        for r in rows:
            time_s = f"{'>' if not r['reached_target'] else ''}{r['time_to_target_s']:.1f}"
            speedup = (f"{'<' if not r['reached_target'] else ''}{r['tta_speedup']:.2f}x"
                       if "tta_speedup" in r else "-")
            lines.append(f"{r['method']:<16}{'yes' if r['reached_target'] else 'no':>8}"
                         f"{r['steps_to_target']:>7}{time_s:>9}{speedup:>9}"
                         f"{r['final_accuracy']:>10.4f}{1e3 * r['step_s']:>9.1f}"
                         + (f"{1e3 * r['compute_s']:>11.1f}" if r["comm_timed"] else
                            f"{'-':>11}") + f"{r['wire_bytes'] / 1000:>9.1f}")
        return "\n".join(lines)
    lines = [f"{where}; medians over the measured steps of every round (rounds: the lowest "
             f"and highest round median){contention}",
             f"{'method':<16}{'step ms':>9}{'rounds ms':>13}{'dense ms':>10}{'measured':>10}"
             f"{'projected':>11}{'proj. step ms':>15}{'compute ms':>11}{'KB/step':>9}"]
    for r in rows:
        low, high = (1e3 * t for t in r["round_step_s"])
        timed = r["comm_timed"]
        projected = f"{1e3 * r['projected_step_s']:>15.1f}" if timed else f"{'-':>15}"
        compute = f"{1e3 * r['compute_s']:>11.1f}" if timed else f"{'-':>11}"
        lines.append(f"{r['method']:<16}{1e3 * r['step_s']:>9.1f}{f'{low:.1f}-{high:.1f}':>13}"
                     f"{1e3 * r['dense_step_s']:>10.1f}{r['measured_speedup']:>9.2f}x"
                     f"{r['projected_speedup']:>10.2f}x{projected}{compute}"
                     f"{r['wire_bytes'] / 1000:>9.1f}")
    return "\n".join(lines)


JSON_KEYS = ("method", "hierarchy", "strategy", "step_s", "dense_step_s", "measured_speedup",
             "projected_speedup", "cross_node_bytes_per_step")
TTA_KEYS = ("time_to_target_s", "target_accuracy", "final_accuracy", "reached_target",
            "steps_to_target", "tta_speedup")


def last_line(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON object of the last output line (module docstring)."""
    keys = JSON_KEYS + (TTA_KEYS if result.get("goal") == "accuracy" else ())
    return {"bandwidth_mbps": result["bandwidth_mbps"], "topology": result["topology"],
            "world_size": result["world_size"],
            "runs": [{k: r[k] for k in keys if k in r} for r in result["runs"]]}


def said(err: Exception) -> str:
    """The one line an error ends netbench with, ``netbench:`` first (once)."""
    text = str(err)
    return text if text.startswith("netbench") else f"netbench: {text}"


@hydra.main(version_base="1.3", config_path="../../configs", config_name="netbench")
def netbench_job(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = benchmark(cfg, out_dir)
    except ConfigError as err:
        print(said(err), file=sys.stderr)
        sys.exit(1)
    except (NetbenchError, ClusterError) as err:
        print(said(err), file=sys.stderr)
        sys.exit(2)
    (out_dir / "netbench.json").write_text(json.dumps(result, indent=1))
    print(format_table(result))
    if result["goal"] == "accuracy":
        plot_accuracy(result, out_dir / "accuracy_vs_time.png")
        print(f"plot: {out_dir / 'accuracy_vs_time.png'}")
    print(json.dumps(last_line(result)))


main = guarded(netbench_job)  # every composed config checked first (`gracecomm.config.guarded`)

if __name__ == "__main__":
    main()
