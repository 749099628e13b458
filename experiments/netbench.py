"""Real speed on a slow link: every method trains on a shaped network, and its measured step
time is printed next to dense DDP's and next to the cost model's projection (`gracecomm.network`)
for the same run and link.

    gracecomm-netbench                               # 100 Mbit/s, configs/netbench.yaml
    gracecomm-netbench bandwidth_mbps=1000 methods=[ddp,topk]

A private network namespace is created and its loopback shaped with a token bucket
(``tc qdisc ... tbf``) at ``bandwidth_mbps`` (and ``netem`` delay when ``latency_ms`` > 0).
Each method's workers (`gracecomm.experiments.train`, same model, data and seed) run inside
it on 127.0.0.1 for ``warmup_steps + steps`` steps; their per-step records give the median
step time and the cost model's projected step times, on a `gracecomm.network.Network` with the
shaped bandwidth, ``shared=True`` (all ranks' traffic crosses the one loopback) and the
per-message latency measured in the namespace by a calibration of small allreduces.

The last line of output is one JSON object:
``{"bandwidth_mbps": B, "runs": [{"method", "step_s", "dense_step_s", "measured_speedup",
"projected_speedup", ...}, ...]}``. Needs root and iproute2 (``ip``, ``tc``); the namespace
is removed when the benchmark ends, also on error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gracecomm.experiments import presets
from gracecomm.experiments.report import read_run
from gracecomm.network import Network
from gracecomm.validation import check_range

NAMESPACE_PREFIX = "gracecomm-netbench-"
CALIBRATION_ROUNDS = 200


class NetbenchError(RuntimeError):
    """The shaped link cannot be set up (no root, no iproute2, no netem) or a run failed."""


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise NetbenchError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done


def check_tools() -> None:
    """Root and iproute2 are needed; say so instead of failing half-way."""
    if os.geteuid() != 0:
        raise NetbenchError("netbench needs root: it creates a private network namespace and "
                            "shapes its loopback with tc (run it as root, e.g. sudo -E)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetbenchError(f"netbench needs iproute2's {' and '.join(missing)}: install "
                            "iproute2 (e.g. apt-get install iproute2)")


def remove_stale_namespaces() -> None:
    """Remove namespaces left by a netbench that was killed (SIGKILL cannot be caught)."""
    listed = _run("ip", "netns", "list").stdout.split()
    for name in listed:
        match = re.fullmatch(re.escape(NAMESPACE_PREFIX) + r"(\d+)", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _run("ip", "netns", "delete", name)


MTU = 1500  # Ethernet's, for the namespace's loopback (see `shaped_namespace`)


@contextlib.contextmanager
def shaped_namespace(bandwidth_mbps: float, latency_ms: float) -> Iterator[str]:
    """A network namespace whose loopback carries at most `bandwidth_mbps` in all (a token
    bucket of 2 ms of line rate, at least two Ethernet frames: a larger bucket, which refills
    while the ranks compute, let a whole step's traffic through at once at 1 Gbit/s),
    delayed by `latency_ms` per packet; removed on exit, whatever the exit. Its loopback
    takes Ethernet's MTU of 1500 bytes: a bucket must hold one packet, and loopback's own
    64 KiB packets made it 64 KiB at any rate (52 ms of line rate at 10 Mbit/s, more than a
    compressed step sends)."""
    check_tools()
    remove_stale_namespaces()
    name = f"{NAMESPACE_PREFIX}{os.getpid()}"
    _run("ip", "netns", "add", name)
    try:
        ns = ("ip", "netns", "exec", name)
        _run(*ns, "ip", "link", "set", "lo", "mtu", str(MTU), "up")
        burst = max(2 * (MTU + 14), int(bandwidth_mbps * 1e6 / 8 * 0.002))
        _run(*ns, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "tbf",
             "rate", f"{bandwidth_mbps}mbit", "burst", str(burst), "latency", "200ms")
        if latency_ms > 0:
            try:
                _run(*ns, "tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:",
                     "netem", "delay", f"{latency_ms}ms")
            except NetbenchError as err:
                raise NetbenchError(f"latency_ms={latency_ms} needs tc netem, which this "
                                    f"kernel does not offer (sch_netem); use latency_ms=0 "
                                    f"({err})") from None
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Let SIGTERM unwind like Ctrl-C, so the namespace and the runs are cleaned up."""
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _calibrate(rank: int, world_size: int, out: str) -> None:
    """Per-message latency: the median time of a one-float allreduce over 2(N-1) messages."""
    x = torch.zeros(1)
    times = []
    for _ in range(CALIBRATION_ROUNDS):
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(statistics.median(times) / (2 * (world_size - 1))))


def in_namespace(namespace: str, args: Sequence[str], timeout_s: float) -> None:
    """Run ``python args...`` inside `namespace`; its process group is killed on any exit."""
    proc = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, *args],
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode:
        raise NetbenchError(f"`python {' '.join(args)}` failed in the namespace:\n"
                            f"{output[-3000:]}")


def calibrate_latency_us(namespace: str, world_size: int, out_dir: Path) -> float:
    out = out_dir / "latency.json"
    code = ("import sys; from gracecomm.experiments.launch import spawn; "
            "from gracecomm.experiments.netbench import _calibrate; "
            f"spawn(_calibrate, {world_size}, {str(out)!r}, timeout_s=120)")
    in_namespace(namespace, ["-c", code], 180)
    return float(json.loads(out.read_text())) * 1e6


def run_method(namespace: str, overrides: Sequence[str], run_dir: Path, steps: int,
               network: Network, timeout_s: float) -> list[dict[str, Any]]:
    """Train inside `namespace` for `steps` steps; the per-step records of rank 0."""
    args = ["-m", "gracecomm.experiments.train", *overrides, f"trainer.max_steps={steps}",
            "trainer.epochs=1000", "trainer.eval_every=1000", "trainer.progress=false",
            f"trainer.timeout_s={timeout_s}", f"hydra.run.dir={run_dir}",
            f"network.bandwidth_gbps=[{network.bandwidth_gbps}]",
            f"network.latency_us={network.latency_us}", f"network.shared={network.shared}"]
    in_namespace(namespace, args, timeout_s + 60)
    run = read_run(run_dir)
    if run is None:
        raise RuntimeError(f"{run_dir}: the run wrote no summary (it did not finish)")
    return run.steps


def summarise(method: str, rounds: list[list[dict[str, Any]]],
              network: Network) -> dict[str, Any]:
    """Medians over the measured steps of every round (`rounds`: each round's step records
    after its warm-up), and the lowest and highest of the rounds' own median step times."""
    kept = [r for records in rounds for r in records]
    label = network.label
    median = lambda key: statistics.median(r[key] for r in kept)  # noqa: E731
    per_round = [statistics.median(r["step_s"] for r in records) for records in rounds]
    return {"method": method, "step_s": median("step_s"),
            "round_step_s": [min(per_round), max(per_round)],
            "projected_step_s": median(f"projected_step_s@{label}"),
            "projected_dense_step_s": median(f"dense_step_s@{label}"),
            "compute_s": median("compute_s"), "comm_timed": "comm_s" in kept[0],
            "comm_s": median("comm_s") if "comm_s" in kept[0] else 0.0,
            "wire_bytes": median("wire_bytes"), "steps": len(kept)}


def plan(cfg: DictConfig) -> list[tuple[str, list[str]]]:
    """(name, overrides) of every run, the baseline first, sync variants after their method."""
    check_range(cfg.bandwidth_mbps, "netbench", "bandwidth_mbps", 0.0, low_open=True)
    check_range(cfg.latency_ms, "netbench", "latency_ms", 0.0)
    check_range(cfg.steps, "netbench", "steps", 1, integer=True)
    check_range(cfg.warmup_steps, "netbench", "warmup_steps", 0, integer=True)
    check_range(cfg.rounds, "netbench", "rounds", 1, integer=True)
    check_range(cfg.world_size, "netbench", "world_size", 2, integer=True)
    names = presets.check([str(cfg.baseline)] + [str(m) for m in cfg.methods
                                                  if m != cfg.baseline], "netbench")
    runs = []
    for name in names:
        overrides = [*cfg.overrides, *presets.overrides(name),
                     f"trainer.world_size={cfg.world_size}"]
        runs.append((name, overrides))
        if cfg.also_sync and presets.exchange(name) == "hook":
            runs.append((f"{name}_sync", [*overrides, "trainer.exchange=hook_sync"]))
    return runs


def format_table(rows: list[dict[str, Any]], bandwidth_mbps: float) -> str:
    """The table; a run whose exchange is not timed (plain DDP, no hook) has no projection
    of its own: it is the dense baseline by definition."""
    lines = [f"shaped loopback at {bandwidth_mbps:g} Mbit/s; medians over the measured steps "
             "of every round (rounds: the lowest and highest round median)",
             f"{'method':<16}{'step ms':>9}{'rounds ms':>13}{'dense ms':>10}{'measured':>10}"
             f"{'projected':>11}{'proj. step ms':>15}{'KB/step':>9}"]
    for r in rows:
        low, high = (1e3 * t for t in r["round_step_s"])
        projected = f"{1e3 * r['projected_step_s']:>15.1f}" if r["comm_timed"] else f"{'-':>15}"
        lines.append(f"{r['method']:<16}{1e3 * r['step_s']:>9.1f}{f'{low:.1f}-{high:.1f}':>13}"
                     f"{1e3 * r['dense_step_s']:>10.1f}{r['measured_speedup']:>9.2f}x"
                     f"{r['projected_speedup']:>10.2f}x{projected}"
                     f"{r['wire_bytes'] / 1000:>9.1f}")
    return "\n".join(lines)


def benchmark(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    runs = plan(cfg)
    with sigterm_as_exit(), shaped_namespace(float(cfg.bandwidth_mbps),
                                             float(cfg.latency_ms)) as namespace:
        latency_us = calibrate_latency_us(namespace, int(cfg.world_size), out_dir)
        network = Network(float(cfg.bandwidth_mbps) / 1000, latency_us, shared=True)
        print(f"calibrated per-message latency: {latency_us:.0f} us", flush=True)
        measured: dict[str, list[list[dict[str, Any]]]] = {name: [] for name, _ in runs}
        warmup, steps = int(cfg.warmup_steps), int(cfg.steps)
        for round_ in range(int(cfg.rounds)):  # methods in turn, so load drifts hit all alike
            for name, overrides in runs:
                records = run_method(namespace, overrides, out_dir / f"{name}.{round_}",
                                     warmup + steps, network, float(cfg.timeout_s))
                measured[name].append(records[warmup:])
                step_ms = 1e3 * statistics.median(r["step_s"] for r in records[warmup:])
                print(f"round {round_ + 1}, {name}: {step_ms:.1f} ms/step", flush=True)
        rows = [summarise(name, measured[name], network) for name, _ in runs]
    dense = rows[0]["step_s"]
    for row in rows:
        row["dense_step_s"] = dense
        row["measured_speedup"] = dense / row["step_s"]
        row["projected_speedup"] = row["projected_dense_step_s"] / row["projected_step_s"]
    return {"bandwidth_mbps": float(cfg.bandwidth_mbps), "latency_ms": float(cfg.latency_ms),
            "latency_us_calibrated": latency_us, "world_size": int(cfg.world_size),
            "runs": rows}


@hydra.main(version_base="1.3", config_path="../configs", config_name="netbench")
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = benchmark(cfg, out_dir)
    except NetbenchError as err:
        print(f"netbench: {err}", file=sys.stderr)
        sys.exit(2)
    (out_dir / "netbench.json").write_text(json.dumps(result, indent=1))
    print(format_table(result["runs"], result["bandwidth_mbps"]))
    print(json.dumps({"bandwidth_mbps": result["bandwidth_mbps"],
                      "runs": [{k: r[k] for k in ("method", "step_s", "dense_step_s",
                                                  "measured_speedup", "projected_speedup")}
                               for r in result["runs"]]}))


if __name__ == "__main__":
    main()
