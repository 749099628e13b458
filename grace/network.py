"""Network cost model: the time the collectives of one step would take on a network of given
bandwidth and latency, so runs on one machine project to clusters (alpha-beta model, Hockney
1994; collective algorithms as in Thakur, Rabenseifner and Gropp 2005 and NCCL's ring).

With N ranks, latency alpha (s), bandwidth B (bytes/s) and message size n (bytes, as the
communicators record it, see `gracecomm.exchange.Link`):

| kind | algorithm | n | time |
|---|---|---|---|
| ``allreduce`` | ring: reduce-scatter + allgather | the vector | 2(N-1) alpha + 2(N-1)/N n/B |
| ``allgather`` | ring | all N blocks | (N-1) alpha + (N-1)/N n/B |
| ``broadcast`` | pipelined ring | the vector | (N-1) alpha + n/B |
| ``reduce`` | ring reduce-scatter, then gather at the root | the vector | N alpha + 2(N-1)/N n/B |
| ``ps_push`` | workers -> server | what the server receives | alpha + n/B |
| ``ps_pull`` | server -> workers | what the server sends | alpha + n/B |

(n in bytes; a parameter server's link carries all the pushes and pulls. ``reduce`` to one
rank is Gloo's, `gloo/reduce.cc`: a ring reduce-scatter of N-1 messages, then each rank sends
its reduced chunk to the root, whose link receives (N-1)/N n in one more message.)

That is the switched case: every rank has a full-duplex link of bandwidth B of its own (a
cluster). Gloo, PyTorch's CPU backend, runs these algorithms for allreduce (a ring of
reduce-scatter and allgather, `gloo/allreduce.cc`) and allgather, but broadcasts along a
binomial tree (`gloo/broadcast.cc`: the root sends the whole message to ceil(log2 N)
peers, each receiver forwards it on): with ``broadcast="tree"`` a broadcast costs
ceil(log2 N) (alpha + n/B), and so does a parameter server's reply (``ps_pull``, one
broadcast of n/(N-1) bytes per receiver).

With ``ranks_per_node`` R > 1 the N ranks sit on N/R nodes, each node one link: a ring's
neighbours on one node talk over the node's loopback, and each node's link carries one
ring stream each way, as with one rank per node (the ring's time is unchanged, with N the
number of ranks); a parameter server's link carries the traffic of the N - R ranks on
other nodes only.

With ``shared=True`` every rank's traffic crosses one link of bandwidth B (a hub, or the one
loopback interface that `gracecomm.experiments.cluster.netbench` shapes on a single machine): the
bandwidth term is then the bytes all ranks send, N times the switched term for the ring
collectives (each rank sends 2(N-1)/N n for an allreduce, (N-1)/N n for an allgather, and
N-1 ranks forward a broadcast), and unchanged for the parameter server, whose link already
carries everything.

``overhead`` is the bytes a link carries per payload byte: 1 counts payload only. Over TCP
on Ethernet with a 1500-byte MTU (`TCP_OVER_ETHERNET`), a frame of 1514 bytes (as a shaper
counts it: Ethernet header, IP and TCP headers with timestamps) carries 1448 payload bytes;
the acknowledgements a link sends for what it receives add little more, as the receiver
coalesces segments before acknowledging them (the emulated cluster's links carried 1.047
to 1.049 bytes per payload byte of Gloo's ring allreduce at 2 and 4 nodes:
``python -m gracecomm.experiments.cluster.probe sweep``, ``wire_per_payload``).

``host_gbps`` is what moving the bytes costs the hosts: Gloo copies and reduces every
segment on the ranks' CPUs and the kernel carries every frame, and where CPUs are scarce
(many ranks sharing few cores, as on the emulated cluster) a collective takes longer than
its link needs, most at high link rates. Each payload byte then costs 8 / host_gbps ns on
top of the link's time; `gracecomm.experiments.cluster.netbench` calibrates it on the cluster from
one allreduce of 1 MiB (the time the link and the latency do not explain): inside each node
where nodes have several ranks (the loopback, which the hosts alone bound), else across
nodes.

With ``overlap=True`` a message costs max(alpha, its bytes / B) instead of their sum: alpha
is then a floor per message that overlaps with its transfer. That is the emulated cluster
(`gracecomm.experiments.cluster.emulation`), where N ranks share this machine's few CPUs:
each step of Gloo's ring waits until the receiving rank is scheduled, however small the
message, while a message long enough to outlast that wait hides it (the socket buffers take
the bytes meanwhile). At 8 nodes and 100 Mbit/s the calibrated latency was 1.5 ms; an allreduce of
10.9 KB, whose bytes need 1.6 ms on the links, took 20.4 ms (14 messages: 21.0 modelled),
and one of 1.08 MB took 168 ms (158 modelled, bandwidth-bound), by
``python -m gracecomm.experiments.cluster.probe sweep`` (``bash results/reproduce.sh
cluster_collectives``). The messages of one kind in a step are taken as equal: each of
`calls` calls moves ``nbytes / calls``.

A step with several collectives of a kind adds their times; since each time is linear in n,
the sum is calls x latency term + (bandwidth factor) x total bytes / B (with ``overlap``,
calls x messages x max(alpha, bytes per message / B)). The projected step
time is ``compute + compression overhead + modelled communication``, where compute is the
measured step time less the measured (local) communication and compression; the baseline is
the same compute with the dense gradients on ring allreduce (one allreduce per exchange) and
no compression, and ``speedup = baseline / projected``.

Two levels (``exchange.hierarchy=node``): the N ranks sit on M = N/R nodes of R =
``ranks_per_node`` ranks. Each tensor is reduced dense to an owning local rank inside the
node, the owner compresses it and exchanges it with its peers on the other nodes (the ranks
of the same local rank on every node: R groups of M ranks, running at once), and then
broadcasts the mean inside the node. The statistics of such a step say so: the intra-node
collectives are recorded as ``node_coll_<kind>_calls`` / ``node_coll_<kind>_bytes`` (a group
of R ranks), the cross-node ones under the flat keys ``coll_<kind>_*`` (a group of M ranks,
this rank's share of the tensors). With T_k the flat table's time of kind k:

| level | link | time |
|---|---|---|
| inside a node | ``intra_gbps``, ``intra_latency_us`` | sum_k T_k(``node_coll_k``; N = R) |
| across nodes | ``bandwidth_gbps``, ``latency_us`` | sum_k T_k(``coll_k``; N = M; R n/B) |

The two levels run one after the other, so their times add. Across nodes, the R groups'
messages go at once, so a call's latency is paid once, but all of them cross the node's one
link: its bandwidth term carries R times a rank's recorded bytes (the local ranks' shares
taken as equal). The hosts' term (``host_gbps``) stays a rank's own bytes, the ranks' CPUs
working in parallel; ``overhead`` (TCP's framing) and ``overlap`` apply as on the flat
exchange; a ``shared`` link has no nodes and prices no two-level step.

The intra-node link: with ``intra_gbps`` unset, the node's loopback, as on the emulated
cluster (`gracecomm.experiments.cluster.emulation`: a node's ranks talk over its unshaped
``lo``). The loopback has no rate of its own: what bounds it is the hosts copying every
byte (``host_gbps``, calibrated on the cluster) and the per-message latency
(``intra_latency_us``, unset: ``latency_us``, as the wait for the receiving rank to be
scheduled is the same); no framing overhead. With ``intra_gbps`` given (an NVLink-like
rate, e.g. a V100's NVLink: 300 GB/s over both directions, 1200 Gbit/s each way, NVIDIA's
V100 datasheet), the same table's bandwidth term at that rate.

`project_hierarchies` compares the flat exchange with the two-level one at M nodes of R
ranks for one method's per-step statistics measured flat (`two_level_stats`): flat, the
statistics at N = M R ranks (`at_world_size`), each node's link carrying the ring's stream
as above; two-level, each rank the owner of 1/R of the tensors: its cross-node bytes are
1/R of the flat payload at M ranks (the node's link carries one payload per node), its
compression overhead (compress, decompress, memory) 1/R of the flat one, and inside the node
one reduce and one broadcast of each tensor (``tensors`` calls, or ``exchanges`` where the
step did not count tensors), of the dense gradient's bytes each. Compute stays. Statistics
measured two-level need no translation: `at_world_size` with the nodes as ranks scales their
cross-node level, the node's group staying R.

Per-step statistics read here (written by communicators and the pipeline):
``coll_<kind>_calls``, ``coll_<kind>_bytes``, ``node_coll_<kind>_calls``,
``node_coll_<kind>_bytes``, ``exchanges``, ``tensors``, ``dense_bytes``, ``step_s``,
``comm_s``, ``compress_s``, ``decompress_s``, ``memory_s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from gracecomm.validation import ConfigError, check_choice, check_range

KINDS = ("allreduce", "allgather", "broadcast", "reduce", "ps_push", "ps_pull")
BROADCASTS = ("ring", "tree")
TCP_OVER_ETHERNET = 1514 / 1448  # wire bytes per payload byte (module docstring)
OVERHEAD_KEYS = ("compress_s", "decompress_s", "memory_s")


def calls_key(kind: str) -> str:
    return f"coll_{kind}_calls"


def bytes_key(kind: str) -> str:
    return f"coll_{kind}_bytes"


NODE_PREFIX = "node_"  # of the metrics of collectives inside a node (`gracecomm.hierarchy`)


def node_calls_key(kind: str) -> str:
    return NODE_PREFIX + calls_key(kind)


def node_bytes_key(kind: str) -> str:
    return NODE_PREFIX + bytes_key(kind)


COLLECTIVE_KEYS = tuple(key(k) for k in KINDS for key in (calls_key, bytes_key))
NODE_COLLECTIVE_KEYS = tuple(key(k) for k in KINDS for key in (node_calls_key, node_bytes_key))
LEVEL_KEYS = ("cross_node_bytes", "intra_node_bytes")  # a two-level step's bytes per level


def two_level(stats: Mapping[str, float]) -> bool:
    """Whether `stats` are a two-level exchange's: they hold intra-node collectives."""
    return any(stats.get(node_calls_key(kind), 0.0) for kind in KINDS)


def overhead_time(stats: Mapping[str, float]) -> float:
    """Measured compression overhead of a step: compress + decompress + memory."""
    return sum(stats.get(k, 0.0) for k in OVERHEAD_KEYS)


def compute_time(stats: Mapping[str, float]) -> float:
    """``compute_s`` if the caller measured it (the trainer records the slowest rank's: in a
    synchronous step the others wait for it, which their ``comm_s`` would count as
    communication), else the measured step time less the measured communication and
    compression overhead."""
    if "compute_s" in stats:
        return stats["compute_s"]
    return max(0.0, stats.get("step_s", 0.0) - stats.get("comm_s", 0.0) - overhead_time(stats))


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ConfigError(f"network: collective kind {kind!r} is unknown; kinds are "
                          f"{', '.join(KINDS)}")
    return kind


class Level(NamedTuple):
    """One level of an exchange: its network, the ranks of one group, the groups sharing
    each link at once, and the keys of its statistics."""

    net: Network
    size: int
    streams: int
    calls_key: Callable[[str], str]
    bytes_key: Callable[[str], str]


@dataclass(frozen=True)
class Network:
    """A homogeneous network: every rank has a link of `bandwidth_gbps` (10^9 bits/s) and
    each message pays `latency_us` microseconds; with `shared`, all ranks' traffic crosses
    one such link; `overhead` wire bytes per payload byte; broadcasts along a pipelined
    ``ring`` or Gloo's binomial ``tree``; `ranks_per_node` ranks share each node's link;
    `host_gbps`, where given, the rate at which the ranks' CPUs move payload through a
    collective, paid on top of the link's; with `overlap`, a message costs the larger of the
    latency and its link time rather than their sum; inside a node, a link of `intra_gbps`
    (unset: the node's loopback) and `intra_latency_us` (unset: `latency_us`) for the
    two-level exchange (module docstring)."""

    bandwidth_gbps: float
    latency_us: float
    shared: bool = False
    overhead: float = 1.0
    broadcast: str = "ring"
    ranks_per_node: int = 1
    host_gbps: float | None = None
    overlap: bool = False
    intra_gbps: float | None = None
    intra_latency_us: float | None = None

    def __post_init__(self) -> None:
        check_range(self.bandwidth_gbps, "network", "bandwidth_gbps", 0.0, low_open=True)
        check_range(self.latency_us, "network", "latency_us", 0.0)
        check_range(self.overhead, "network", "overhead", 1.0)
        for option in ("host_gbps", "intra_gbps"):
            if getattr(self, option) is not None:
                check_range(getattr(self, option), "network", option, 0.0, low_open=True)
        if self.intra_latency_us is not None:
            check_range(self.intra_latency_us, "network", "intra_latency_us", 0.0)
        check_choice(self.broadcast, BROADCASTS, "network", "broadcast")
        check_range(self.ranks_per_node, "network", "ranks_per_node", 1, integer=True)
        if self.overlap and self.shared:
            raise ConfigError("network: 'overlap' models per-node links of a switch; a shared "
                              "link (shared=True) carries every rank's messages one after "
                              "another: set one of them, not both")

    @property
    def label(self) -> str:
        """``0.1Gbps``, ``1Gbps``, ``10Gbps``: the suffix of this network's keys."""
        return f"{self.bandwidth_gbps:g}Gbps"

    @property
    def intra_node(self) -> Network:
        """The link inside a node, as a network of its own (module docstring): `intra_gbps`
        (unset: the loopback, no rate of its own), `intra_latency_us` (unset: `latency_us`),
        no framing; the hosts' rate, broadcast and overlap as across nodes."""
        return Network(math.inf if self.intra_gbps is None else self.intra_gbps,
                       self.latency_us if self.intra_latency_us is None
                       else self.intra_latency_us,
                       broadcast=self.broadcast, host_gbps=self.host_gbps,
                       overlap=self.overlap)

    def terms(self, kind: str, world_size: int) -> tuple[float, float]:
        """(messages per call, link bytes per recorded byte) of `kind` at `world_size`
        ranks (module table)."""
        n = world_size
        tree = math.ceil(math.log2(n))
        remote = (n - min(self.ranks_per_node, n)) / (n - 1)  # a server's remote share
        messages, factor = {
            "allreduce": (2 * (n - 1), 2 * (n - 1) / n),
            "allgather": (n - 1, (n - 1) / n),
            "broadcast": (n - 1, 1.0) if self.broadcast == "ring" else (tree, tree),
            "reduce": (n, 2 * (n - 1) / n),
            "ps_push": (1, remote),
            "ps_pull": (1, remote) if self.broadcast == "ring" else (tree, tree / (n - 1)),
        }[check_kind(kind)]
        if self.shared and not kind.startswith("ps_"):
            factor *= n
        return messages, factor * self.overhead

    def time(self, kind: str, nbytes: float, world_size: int, calls: float = 1,
             streams: int = 1) -> float:
        """Seconds for `calls` collectives of `kind` moving `nbytes` in total (module table);
        `streams` such collectives at once on disjoint groups share each link (the two-level
        exchange's local ranks): the link carries their bytes, each pays its own latency and
        hosts' time concurrently."""
        if world_size <= 1 or calls == 0:
            return 0.0
        messages, factor = self.terms(kind, world_size)
        beta = 8.0 / (self.bandwidth_gbps * 1e9)  # seconds per byte on the link
        host = 0.0 if self.host_gbps is None else 8.0 / (self.host_gbps * 1e9) / self.overhead
        sent, link = calls * messages, streams * factor * nbytes * beta
        alpha = self.latency_us * 1e-6
        wire = sent * max(alpha, link / sent) if self.overlap else sent * alpha + link
        return wire + factor * nbytes * host

    def levels(self, stats: Mapping[str, float], world_size: int) -> tuple[Level, ...]:
        """The levels of the exchange `stats` record: one flat level, or inside a node and
        across nodes (module docstring)."""
        if not two_level(stats):
            return (Level(self, world_size, 1, calls_key, bytes_key),)
        r = self.ranks_per_node
        if self.shared or r == 1 or world_size % r:
            raise ConfigError(f"network: statistics of a two-level exchange (node_coll_* keys) "
                              f"need nodes of ranks_per_node > 1 ranks on per-node links; got "
                              f"ranks_per_node={r}, world_size={world_size}, "
                              f"shared={self.shared}")
        return (Level(self.intra_node, r, 1, node_calls_key, node_bytes_key),
                Level(replace(self, ranks_per_node=1), world_size // r, r, calls_key, bytes_key))

    def comm_time(self, stats: Mapping[str, float], world_size: int) -> float:
        """Modelled seconds of every collective recorded in `stats`, at each level."""
        return sum(level.net.time(kind, stats.get(level.bytes_key(kind), 0.0), level.size,
                                  stats.get(level.calls_key(kind), 0.0), level.streams)
                   for level in self.levels(stats, world_size) for kind in KINDS)

    def link_bytes(self, stats: Mapping[str, float], world_size: int) -> float:
        """Bytes one node's network link carries each way per step in the model (framing
        included): the network level's bandwidth terms (module docstring)."""
        level = self.levels(stats, world_size)[-1]
        return sum(level.streams * level.net.terms(kind, level.size)[1]
                   * stats.get(level.bytes_key(kind), 0.0)
                   for kind in KINDS if level.size > 1 and stats.get(level.calls_key(kind), 0.0))

    def project(self, stats: Mapping[str, float], world_size: int) -> dict[str, float]:
        """``net_comm_s@L``, ``projected_step_s@L``, ``dense_step_s@L`` and ``speedup@L``
        (L = `label`) for one step's statistics (or per-step means)."""
        compute = compute_time(stats)
        comm = self.comm_time(stats, world_size)
        dense = compute + self.time("allreduce", stats.get("dense_bytes", 0.0), world_size,
                                    stats.get("exchanges", 0.0))
        projected = compute + overhead_time(stats) + comm
        return {f"net_comm_s@{self.label}": comm,
                f"projected_step_s@{self.label}": projected,
                f"dense_step_s@{self.label}": dense,
                f"speedup@{self.label}": dense / projected if projected > 0 else 1.0}


def at_world_size(stats: Mapping[str, float], measured_at: int,
                  world_size: int) -> dict[str, float]:
    """Per-step statistics recorded at `measured_at` ranks as they would be at `world_size`
    ranks, the per-rank payloads unchanged: an allgather's bytes grow with the ranks whose
    blocks it gathers, a parameter server's with its N - 1 workers; allreduce and
    broadcast bytes, calls and every other statistic stay."""
    scaled = dict(stats)
    for kind, factor in (("allgather", world_size / measured_at),
                         ("ps_push", (world_size - 1) / max(1, measured_at - 1)),
                         ("ps_pull", (world_size - 1) / max(1, measured_at - 1))):
        if bytes_key(kind) in scaled:
            scaled[bytes_key(kind)] *= factor
    return scaled


def networks(bandwidths_gbps: Iterable[float] | float, latency_us: float,
             shared: bool = False, ranks_per_node: int = 1) -> list[Network]:
    """One `Network` per bandwidth (a number or a list, as in ``network.bandwidth_gbps``),
    nodes of `ranks_per_node` ranks (what a two-level exchange's statistics need)."""
    values = ([bandwidths_gbps] if isinstance(bandwidths_gbps, (int, float))
              else list(bandwidths_gbps))
    if not values:
        raise ConfigError("network: option 'bandwidth_gbps' must list at least one bandwidth")
    return [Network(b, latency_us, bool(shared), ranks_per_node=ranks_per_node)
            for b in values]


def project(stats: Mapping[str, float], world_size: int,
            nets: Sequence[Network]) -> dict[str, float]:
    """`Network.project` for every network, plus the measured ``compute_s``."""
    out = {"compute_s": compute_time(stats)}
    for net in nets:
        out.update(net.project(stats, world_size))
    return out


def two_level_stats(stats: Mapping[str, float], measured_at: int, nodes: int,
                    ranks_per_node: int) -> dict[str, float]:
    """Per-step statistics of one rank measured on the flat exchange at `measured_at`
    ranks, as the two-level exchange would record them at `nodes` nodes of `ranks_per_node`
    ranks (module docstring): the cross-node collectives carry the rank's 1/R share of the
    flat payload at `nodes` ranks, compression costs 1/R, and each tensor is reduced and
    broadcast dense inside the node."""
    if two_level(stats):
        raise ConfigError("network: these statistics are already a two-level exchange's; "
                          "scale their cross-node level with at_world_size instead")
    r = check_range(ranks_per_node, "network", "ranks_per_node", 1, integer=True)
    out = at_world_size(stats, measured_at, nodes)
    out["compute_s"] = compute_time(stats)
    for key in (*(bytes_key(kind) for kind in KINDS), *OVERHEAD_KEYS):
        if key in out:
            out[key] /= r
    if r > 1:
        per_tensor = stats.get("tensors", stats.get("exchanges", 0.0))
        for kind in ("reduce", "broadcast"):
            out[node_calls_key(kind)] = per_tensor
            out[node_bytes_key(kind)] = stats.get("dense_bytes", 0.0)
    return out


def project_hierarchies(stats: Mapping[str, float], measured_at: int, net: Network,
                        nodes: Iterable[int], ranks_per_node: int) -> dict[int, dict[str, float]]:
    """The flat exchange against the two-level one for one method's per-step statistics
    measured flat at `measured_at` ranks, at each of `nodes` nodes of `ranks_per_node` ranks
    on `net`'s links (module docstring): per node count, the projected step times
    (``flat_step_s``, ``node_step_s``; ``dense_step_s``: the flat dense allreduce), the
    bytes one node's link carries each way per step (``flat_link_bytes``,
    ``node_link_bytes``) and ``speedup``, the flat step over the two-level one."""
    net = replace(net, ranks_per_node=ranks_per_node)
    label = net.label
    out = {}
    for m in nodes:
        n = m * ranks_per_node
        flat = at_world_size(stats, measured_at, n)
        node = two_level_stats(stats, measured_at, m, ranks_per_node)
        flat_p, node_p = net.project(flat, n), net.project(node, n)
        out[m] = {"flat_step_s": flat_p[f"projected_step_s@{label}"],
                  "node_step_s": node_p[f"projected_step_s@{label}"],
                  "dense_step_s": flat_p[f"dense_step_s@{label}"],
                  "flat_link_bytes": net.link_bytes(flat, n),
                  "node_link_bytes": net.link_bytes(node, n)}
        out[m]["speedup"] = out[m]["flat_step_s"] / out[m]["node_step_s"]
    return out
