"""An emulated cluster on one machine: one network namespace per node with its own address,
joined through veth pairs to a bridge (the switch, in a namespace of its own); each node's
link is shaped in both directions, so every node has a full-duplex NIC of
``bandwidth_mbps`` into a non-blocking switch. Each node's ranks are started by ``torchrun``
inside its namespace (``--nnodes``, ``--node-rank``, rendezvous at node 0's address,
``GLOO_SOCKET_IFNAME`` set to the node's interface), as a job is launched across machines.

    with EmulatedCluster(4, Link(100)) as cluster:          # 4 nodes at 100 Mbit/s each
        cluster.torchrun(["-m", "gracecomm.experiments.training", ...], log_dir, 900)

Layout (``P`` = ``gracecomm-cluster-<launcher pid>``): namespace ``P-switch`` holds the
bridge ``br0`` and one veth end ``p<i>`` per node; namespace ``P-n<i>`` holds the other end,
``eth0``, with address 10.99.0.<i+1>/24. Shaping (``tc``): a token bucket (``tbf``) at the
link's rate on ``eth0`` (the node's uplink) and on ``p<i>`` (its downlink), and under it,
when the link has latency, jitter or loss, ``netem`` (one-way delay per direction). A
bucket holds 2 ms of line rate (at least two Ethernet frames), as the shaped loopback of
`gracecomm.experiments.cluster.netbench` does; veth sends 64 KiB segments, which ``tbf`` splits
into frames of the interface's MTU (1500) before shaping.

Everything is removed on every exit path: the processes inside the namespaces (found by
namespace, ``ip netns pids``, so none escapes by changing its process group) are killed and
the namespaces deleted when the block ends, also on an error, Ctrl-C or SIGTERM (with
`sigterm_as_exit`); deleting a namespace removes its veth ends and bridge. A launcher killed
with SIGKILL cannot clean up: the next cluster (or `remove_stale`) removes what a dead
launcher left. Ranks follow their torchrun agent, and the agent follows this launcher
(``PR_SET_PDEATHSIG``).

CPU pinning: with ``pin_cpus``, node i's torchrun (and so its ranks) runs on CPUs
``{(i * ranks_per_node + j) mod cpus}``: with one rank per node each rank has one CPU of
its own or shares it with a fixed set of others, instead of migrating. Each rank runs one
torch thread (``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gracecomm.network import TCP_OVER_ETHERNET, Network
from gracecomm.validation import ConfigError, check_range

PREFIX = "gracecomm-cluster-"
SUBNET = "10.99.0"
MTU = 1500
MASTER_PORT = 29500
RANK_MB = 600        # resident memory of one training rank (ResNet-20, torch CPU), rounded up
AGENT_MB = 150       # torchrun's agent per node
RANKS_PER_CPU = 8    # beyond this, compute contention and Gloo's timeouts make runs useless
MAX_NODES = 254      # one /24 of node addresses


class ClusterError(RuntimeError):
    """The cluster cannot be set up (no root, no iproute2, no netem), or a node's job failed."""


def run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def check_tools(what: str = "the emulated cluster") -> None:
    """Root and iproute2 are needed; say so instead of failing half-way."""
    if os.geteuid() != 0:
        raise ClusterError(f"{what} needs root: it creates network namespaces and shapes "
                           "their links with tc (run it as root, e.g. sudo -E)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"{what} needs iproute2's {' and '.join(missing)}: install "
                           "iproute2 (e.g. apt-get install iproute2)")


@dataclass(frozen=True)
class Link:
    """One node's link to the switch, the same in both directions: `bandwidth_mbps`
    (10^6 bit/s), and with netem a one-way `latency_ms`, `jitter_ms` and `loss_pct`."""

    bandwidth_mbps: float
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        check_range(self.bandwidth_mbps, "cluster", "bandwidth_mbps", 0.0, math.inf,
                    low_open=True, high_open=True)  # tc shapes a finite rate
        check_range(self.latency_ms, "cluster", "latency_ms", 0.0, math.inf, high_open=True)
        check_range(self.jitter_ms, "cluster", "jitter_ms", 0.0)
        check_range(self.loss_pct, "cluster", "loss_pct", 0.0, 100.0, high_open=True)
        if self.jitter_ms > self.latency_ms:
            raise ConfigError(f"cluster: option 'jitter_ms' is {self.jitter_ms} but may be at "
                              f"most latency_ms ({self.latency_ms}): a delay cannot go below 0")

    @property
    def netem(self) -> list[str]:
        """netem's arguments, empty when the link needs none."""
        args = []
        if self.latency_ms > 0:
            args += ["delay", f"{self.latency_ms}ms"]
            if self.jitter_ms > 0:
                args += [f"{self.jitter_ms}ms"]
        if self.loss_pct > 0:
            args += ["loss", f"{self.loss_pct}%"]
        return args


def cluster_network(bandwidth_mbps: float, latency_us: float,
                    ranks_per_node: int = 1) -> Network:
    """The cost model's view of this cluster (`gracecomm.network`): a link of
    `bandwidth_mbps` per node into a switch, TCP's framing, Gloo's binomial broadcast, and a
    per-message latency that each message's transfer overlaps (`Network.overlap`)."""
    return Network(bandwidth_mbps / 1000, latency_us, overhead=TCP_OVER_ETHERNET,
                   broadcast="tree", ranks_per_node=ranks_per_node, overlap=True)


def memory_available_mb() -> float:
    """MemAvailable of /proc/meminfo, in MiB (inf where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def capacity(ranks_per_node: int) -> tuple[int, str]:
    """The most nodes of `ranks_per_node` ranks this machine can hold, and why that many:
    the memory available, ``RANKS_PER_CPU`` ranks per CPU, and one /24 of addresses."""
    cpus = len(os.sched_getaffinity(0))
    limits = {
        f"{memory_available_mb():.0f} MiB of memory available at about {RANK_MB} MiB per "
        f"rank and {AGENT_MB} MiB per node's torchrun":
            int(memory_available_mb() // (ranks_per_node * RANK_MB + AGENT_MB)),
        f"{cpus} CPUs at most {RANKS_PER_CPU} ranks each":
            cpus * RANKS_PER_CPU // ranks_per_node,
        "one /24 of node addresses": MAX_NODES,
    }
    reason = min(limits, key=lambda k: limits[k])
    return limits[reason], reason


def check_size(nodes: int, ranks_per_node: int) -> None:
    """Refuse, before anything is made, a cluster this machine cannot hold."""
    check_range(nodes, "cluster", "world_size (nodes)", 2, integer=True)
    check_range(ranks_per_node, "cluster", "ranks_per_node", 1, integer=True)
    most, reason = capacity(ranks_per_node)
    if nodes > most:
        raise ConfigError(f"cluster: option 'world_size' is {nodes} nodes of {ranks_per_node} "
                          f"rank(s), but this machine holds at most {most} ({reason}); use "
                          f"world_size <= {most}")


def namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def kill_namespace_processes(namespace: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in `namespace` until none is left (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while (pids := namespace_pids(namespace)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def remove_namespaces(names: Sequence[str]) -> None:
    """Kill the processes of `names`, then delete them (nodes first, the switch last)."""
    for name in names:
        kill_namespace_processes(name)
    for name in names:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def remove_stale(prefix: str = PREFIX) -> None:
    """Remove the namespaces (and their processes) of clusters whose launcher is dead (a
    launcher killed with SIGKILL cannot remove its own)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    stale = []
    for name in (line.split()[0] for line in done.stdout.splitlines() if line.strip()):
        match = re.fullmatch(re.escape(prefix) + r"(\d+)-.*", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            stale.append(name)
    remove_namespaces(sorted(stale, key=lambda n: n.endswith("-switch")))


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Let SIGTERM unwind like Ctrl-C, so that the cluster and its runs are removed."""
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the cluster is made or removed, so that a second
    Ctrl-C cannot leave half of it behind; they are delivered afterwards."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def die_with_launcher() -> None:
    """In a child process (a node's, netbench's compute run), before exec: SIGKILL when the
    launcher dies (PR_SET_PDEATHSIG), so that a launcher killed with SIGKILL or SIGTERM
    takes its torchrun agents (and they their ranks, which follow their agent) with it."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class EmulatedCluster:
    """`nodes` namespaces on a bridge, each link shaped to `link` (module docstring); use
    as a context manager. ``addresses[i]`` is node i's address; `torchrun` runs one job."""

    def __init__(self, nodes: int, link: Link, ranks_per_node: int = 1,
                 pin_cpus: bool = True) -> None:
        check_size(nodes, ranks_per_node)
        self.nodes, self.link, self.ranks_per_node = nodes, link, ranks_per_node
        self.pin_cpus = pin_cpus
        self.name = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.name}-switch"
        self.namespaces = [f"{self.name}-n{i}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self._made: list[str] = []

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def __enter__(self) -> EmulatedCluster:
        check_tools()
        remove_stale()
        with signals_held():
            try:
                self._make()
            except BaseException:
                self._remove()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        with signals_held():
            self._remove()

    def _add_namespace(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self._made.append(name)

    def _make(self) -> None:
        self._add_namespace(self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses)):
            self._add_namespace(ns)
            port = f"p{i}"
            run("ip", "-n", self.switch, "link", "add", port, "mtu", str(MTU), "type", "veth",
                "peer", "name", "eth0", "mtu", str(MTU), "netns", ns)
            run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
            self._shape(ns, "eth0")             # uplink: node -> switch
            self._shape(self.switch, port)      # downlink: switch -> node

    def _shape(self, namespace: str, device: str) -> None:
        rate = self.link.bandwidth_mbps
        burst = max(2 * (MTU + 14), int(rate * 1e6 / 8 * 0.002))
        run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root",
            "handle", "1:", "tbf", "rate", f"{rate}mbit", "burst", str(burst), "latency",
            "200ms")
        if self.link.netem:
            try:
                run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device,
                    "parent", "1:1", "handle", "10:", "netem", *self.link.netem)
            except ClusterError as err:
                raise ClusterError(
                    f"latency_ms, jitter_ms and loss_pct need tc's netem, which this kernel "
                    f"does not offer (sch_netem); set them to 0 ({err})") from None

    def _remove(self) -> None:
        nodes = [n for n in self._made if n != self.switch]
        remove_namespaces([*nodes, *(n for n in self._made if n == self.switch)])
        self._made.clear()

    def link_bytes(self) -> int:
        """Bytes every node's uplink has sent so far (``tc -s``: as the token bucket counts
        them, Ethernet header included): each byte that crossed the switch, counted once,
        by the link it left on."""
        total = 0
        for ns in self.namespaces:
            shown = run("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", "eth0")
            total += int(re.search(r"Sent (\d+) bytes", shown).group(1))
        return total

    def cpus(self, node: int) -> list[int]:
        """The CPUs node `node`'s ranks are pinned to (module docstring)."""
        available = sorted(os.sched_getaffinity(0))
        first = node * self.ranks_per_node
        return sorted({available[(first + j) % len(available)]
                       for j in range(self.ranks_per_node)})

    def node_command(self, node: int, args: Sequence[str], log_dir: Path) -> list[str]:
        """The command that starts node `node`'s part of ``torchrun ARGS`` in its namespace.
        torchrun's own files go under `log_dir` (without ``--log-dir`` each torchrun leaves a
        ``torchelastic_*`` directory in the system's temporary folder)."""
        cmd = ["ip", "netns", "exec", self.namespaces[node]]
        if self.pin_cpus:
            cmd += ["taskset", "-c", ",".join(map(str, self.cpus(node)))]
        return [*cmd, sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={self.nodes}", f"--nproc-per-node={self.ranks_per_node}",
                f"--node-rank={node}", f"--master-addr={self.addresses[0]}",
                f"--master-port={MASTER_PORT}", "--max-restarts=0",
                f"--log-dir={log_dir / f'torchelastic{node}'}", *args]

    def environment(self) -> dict[str, str]:
        threads = 1
        return {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": str(threads),
                "PYTHONUNBUFFERED": "1"}

    def torchrun(self, args: Sequence[str], log_dir: Path, timeout_s: float) -> None:
        """Run ``torchrun ARGS`` on every node (node i's output in ``log_dir/node<i>.log``)
        and wait for all; the first node that fails, or the timeout, stops every node and
        raises `ClusterError` with that node's last output."""
        log_dir.mkdir(parents=True, exist_ok=True)
        procs, logs = [], []
        try:
            for node in range(self.nodes):
                log = open(log_dir / f"node{node}.log", "w")  # noqa: SIM115 - closed below
                logs.append(log)
                procs.append(subprocess.Popen(
                    self.node_command(node, args, log_dir), stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.environment(), start_new_session=True,
                    preexec_fn=die_with_launcher))
            failed = self._wait(procs, timeout_s)
        finally:
            self._stop(procs)
            for log in logs:
                log.close()
        if failed is not None:
            node, why = failed
            tail = (log_dir / f"node{node}.log").read_text(errors="replace")[-3000:]
            raise ClusterError(f"node {node} ({self.addresses[node]}) {why}; its torchrun "
                               f"said:\n{tail}")

    @staticmethod
    def _wait(procs: list[subprocess.Popen], timeout_s: float) -> tuple[int, str] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            for node, code in enumerate(codes):
                if code:
                    return node, f"failed with exit code {code}"
            if all(code == 0 for code in codes):
                return None
            time.sleep(0.1)
        return 0, f"did not finish within {timeout_s:g} s (timeout)"

    def _stop(self, procs: list[subprocess.Popen]) -> None:
        """Kill every process of every node (running or not) and reap the agents."""
        for ns in self.namespaces:
            kill_namespace_processes(ns)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
