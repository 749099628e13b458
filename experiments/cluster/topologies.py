"""The networks ``gracecomm-netbench`` trains on (``topology=``): `Loopback`, one network
namespace whose loopback is shaped (`shaped_namespace`: ``tc tbf`` and ``netem``), and
`Cluster`, the emulated cluster of `gracecomm.experiments.cluster.emulation`; each measures
its per-message latency (``calibrate``) and runs a training run on itself (``train``)."""

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
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from gracecomm.experiments.cluster.emulation import (
    EmulatedCluster,
    Link,
    cluster_network,
)
from gracecomm.network import Network

NAMESPACE_PREFIX = "gracecomm-netbench-"
CALIBRATION_ROUNDS = 200
CALIBRATION_BYTES = 2**20  # the cluster's allreduce that calibrates the hosts' rate


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


def hosts_rate(net: Network, ranks: int, nbytes: int, seconds: float) -> float | None:
    """`Network.host_gbps` from an allreduce of `nbytes` among `ranks` ranks that took
    `seconds`: the payload bytes its hosts moved over the time that `net` (without a hosts'
    rate) leaves unexplained; None where `net` explains it all."""
    excess = seconds - replace(net, host_gbps=None).time("allreduce", nbytes, ranks)
    _, factor = net.terms("allreduce", ranks)
    # factor counts wire bytes; the hosts' rate is per payload byte
    return 8 * factor / net.overhead * nbytes / excess / 1e9 if excess > 0 else None


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


def train_args(overrides: Sequence[str], run_dir: Path, timeout_s: float) -> list[str]:
    """``python -m gracecomm.experiments.training`` arguments of one measured run."""
    return ["-m", "gracecomm.experiments.training", *overrides, "trainer.progress=false",
            f"trainer.timeout_s={timeout_s}", f"hydra.run.dir={run_dir}"]


class Loopback:
    """Every rank in one namespace, its loopback shaped (`shaped_namespace`); its runs'
    bytes are not counted (``train`` returns None)."""

    counts_links = False

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.ranks = int(cfg.world_size)
        self.namespace = ""

    @contextlib.contextmanager
    def up(self) -> Iterator[None]:
        with shaped_namespace(float(self.cfg.bandwidth_mbps),
                              float(self.cfg.latency_ms)) as self.namespace:
            yield

    def overrides(self) -> list[str]:
        return [f"trainer.world_size={self.ranks}"]

    def calibrate(self, out_dir: Path) -> Network:
        """The shared link, with the per-message latency measured in the namespace."""
        out = out_dir / "latency.json"
        code = ("from gracecomm.experiments.training.launch import spawn; "
                "from gracecomm.experiments.cluster.topologies import _calibrate; "
                f"spawn(_calibrate, {self.ranks}, {str(out)!r}, timeout_s=120)")
        in_namespace(self.namespace, ["-c", code], 180)
        latency_us = float(json.loads(out.read_text())) * 1e6
        return Network(float(self.cfg.bandwidth_mbps) / 1000, latency_us, shared=True)

    def train(self, overrides: Sequence[str], run_dir: Path, timeout_s: float) -> None:
        in_namespace(self.namespace, train_args(overrides, run_dir, timeout_s), timeout_s + 60)


class Cluster:
    """One namespace per node on a bridge, ranks started by torchrun (`EmulatedCluster`);
    ``train`` returns the bytes the nodes' links carried during the run
    (`EmulatedCluster.link_bytes`)."""

    counts_links = True

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.link = Link(float(cfg.bandwidth_mbps), float(cfg.latency_ms),
                         float(cfg.jitter_ms), float(cfg.loss_pct))
        self.nodes, self.per_node = int(cfg.world_size), int(cfg.ranks_per_node)
        self.ranks = self.nodes * self.per_node
        self.cluster: EmulatedCluster | None = None

    @contextlib.contextmanager
    def up(self) -> Iterator[None]:
        with EmulatedCluster(self.nodes, self.link, self.per_node,
                             bool(self.cfg.pin_cpus)) as self.cluster:
            yield

    def overrides(self) -> list[str]:
        return []

    def calibrate(self, out_dir: Path) -> Network:
        """The cluster's network: per-message latency from small allreduces
        (`gracecomm.experiments.cluster.probe`), which a message's transfer overlaps, and the
        hosts' rate (`Network.host_gbps`) from the part of a 1 MiB allreduce's time that the
        latency and any link leave unexplained (none where they explain it all). With nodes of
        several ranks that allreduce runs inside each node, on the unshaped loopback, where
        only the hosts bound it; across nodes, a slow link explains nearly all of its time and
        leaves too little to measure the rate by."""
        assert self.cluster is not None
        out = out_dir / "calibration.json"
        inside = self.per_node > 1
        self.cluster.torchrun(["-m", "gracecomm.experiments.cluster.probe", "rank", str(out),
                               "--node-allreduce" if inside else "--allreduce",
                               str(CALIBRATION_BYTES)], out_dir / "calibration", 600)
        probe = json.loads(out.read_text())
        link = cluster_network(float(self.cfg.bandwidth_mbps), probe["latency_s"] * 1e6,
                               self.per_node)
        net, ranks = (link.intra_node, self.per_node) if inside else (link, self.ranks)
        measured = probe["node_allreduce" if inside else "allreduce"][str(CALIBRATION_BYTES)]
        return replace(link, host_gbps=hosts_rate(net, ranks, CALIBRATION_BYTES, measured))

    def train(self, overrides: Sequence[str], run_dir: Path, timeout_s: float) -> int:
        assert self.cluster is not None
        before = self.cluster.link_bytes()
        self.cluster.torchrun(train_args(overrides, run_dir, timeout_s), run_dir / "nodes",
                              timeout_s + 120)
        return self.cluster.link_bytes() - before


TOPOLOGY = {"loopback": Loopback, "cluster": Cluster}
