"""The node-aware, two-level exchange (``hierarchy="node"``): dense inside a node, compressed
once per node across nodes.

The ranks of a cluster are grouped by node. Inside a node the gradient is reduced dense over
the node's own group (NVLink, PCIe or a loopback: fast); only what leaves the node is
compressed, once per node, so an allgather-based method carries one payload per node across
the network instead of one per rank. This is Horovod's hierarchical allreduce (Sergeev and
Del Balso 2018, "Horovod: fast and easy distributed deep learning in TensorFlow", Sec. 4)
and BytePS's two-level compression (Jiang et al. 2020, "A Unified Architecture for
Accelerating Distributed DNN Training in Heterogeneous GPU/CPU Clusters", OSDI, Sec. 4)
applied to every method, as the hierarchical Top-k of Shi et al. 2021 ("Towards Scalable
Distributed Training of Deep Learning on Public Cloud Clusters", MLSys, Sec. 3) does.

One exchange (`gracecomm.Grace.start_many`) in three steps:

1. Each tensor is owned by one local rank (`assign_owners`: greedy by size, the same on
   every rank, and for good: its error feedback stays there), the whole model by local
   rank 0 for a compressor of whole models, and each run of tensors that an elementwise
   compressor takes joined (fp16) is cut into one piece per local rank; every rank reduces
   its gradients to their owners inside the node (``node_coll_reduce_*``); an owner divides
   by the ranks per node: the node mean.
2. Each owner compensates, compresses, updates its memory and exchanges its tensors with the
   owners of the same tensors on the other nodes, over its cross-node group (the ranks with
   its local rank on every node): the communicator's mean over nodes of the node means is the
   global mean. Its memory covers exactly what it compresses, so error feedback is exact.
3. Each owner broadcasts its means inside the node (``node_coll_broadcast_*``).

Whole tensors are assigned rather than shards of a dense reduce-scatter because methods such
as PowerSGD and Top-k need a tensor's shape or its own k; so that no rank compresses more
than its share, the assignment balances the elements over the local ranks (a tensor larger
than the rest together is one rank's work). A compressor of whole models (LGC) cannot be
split: local rank 0 of each node compresses it.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gracecomm.exchange import Collectives, Continuations
from gracecomm.metrics import Metrics
from gracecomm.network import NODE_PREFIX
from gracecomm.validation import ConfigError, check_choice

HIERARCHIES = ("flat", "node")  # the values of the ``hierarchy`` option
FLAT, NODE = HIERARCHIES


def check_hierarchy(value: Any, owner: str = "pipeline") -> str:
    """`value` if it is one of `HIERARCHIES`, else `ConfigError` naming them.

    Args:
        value: The ``hierarchy`` option.
        owner: Who has the option, for the message.

    Returns:
        `value`.
    """
    return check_choice(value, HIERARCHIES, owner, "hierarchy")


def assign_owners(sizes: Sequence[int], owners: int,
                  load: Sequence[int] | None = None) -> list[int]:
    """A balanced assignment of units of work to `owners` (greedy: the largest unit first to
    the owner with the fewest elements so far, ties to the lowest index), the same on every
    rank for the same sizes.

    Args:
        sizes: The elements of each unit.
        owners: How many owners share them.
        load: The elements each owner has already (default none).

    Returns:
        The owner of each unit, in order.

    Example:
        >>> assign_owners([10, 3, 3, 4], 2)
        [0, 1, 1, 1]
    """
    load = [0] * owners if load is None else list(load)
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner[i] = min(range(owners), key=lambda o: (load[o], o))
        load[owner[i]] += sizes[i]
    return owner


class NodeCollectives(Collectives):
    """The accounted collectives inside this rank's node (metrics ``node_coll_<kind>_...``).

    Args:
        group: The node's process group.
        metrics: Where bytes and waiting times are recorded (the pipeline's).
    """

    metric_prefix = NODE_PREFIX

    def __init__(self, group: Any, metrics: Metrics) -> None:
        self.group = group
        self.metrics = metrics
        self.label = "the exchange inside the node"


class NodeLayout:
    """The nodes of the default process group and the process groups of the two-level
    exchange, created collectively: every rank constructs it at the same point.

    A rank's node is torchrun's ``GROUP_RANK`` where ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``
    are set, else its host name; both are gathered once and must give every node the same
    number of ranks (and, under torchrun, ``LOCAL_WORLD_SIZE`` ranks). Nodes are ordered by
    their lowest rank, and a node's ranks by rank (its local ranks).

    Args:
        metrics: The pipeline's metrics (for the node's collectives).

    Raises:
        ConfigError: The nodes have different numbers of ranks, or ranks disagree on how
            they are told (some under torchrun, some not).

    Attributes:
        nodes: The number of nodes.
        ranks_per_node: Ranks on each node.
        node: This rank's node.
        local_rank: This rank's place in its node.
        members: The global ranks of each node, ``members[node][local_rank]``.
        node_comm: The collectives inside this rank's node (`NodeCollectives`).
        cross_group: The process group of this rank's local rank on every node, or None
            with one node or one rank per node (no group is created then).
    """

    def __init__(self, metrics: Metrics) -> None:
        keys, source = gather_node_keys()
        first: dict[int, list[int]] = {}
        for rank, key in enumerate(keys):
            first.setdefault(key, []).append(rank)
        self.members = list(first.values())
        sizes = [len(m) for m in self.members]
        torchrun = os.environ.get("LOCAL_WORLD_SIZE")
        if len(set(sizes)) > 1 or (source == "torchrun" and str(sizes[0]) != torchrun):
            raise ConfigError(
                f"hierarchy 'node': the nodes (by {source}) have {sizes} ranks"
                + (f" and LOCAL_WORLD_SIZE is {torchrun}" if source == "torchrun" else "")
                + "; the two-level exchange needs the same number of ranks on every node; "
                "use hierarchy=flat")
        self.nodes, self.ranks_per_node = len(sizes), sizes[0]
        me = dist.get_rank()
        self.node = next(n for n, m in enumerate(self.members) if me in m)
        self.local_rank = self.members[self.node].index(me)
        self.node_comm = NodeCollectives(None, metrics)
        self.cross_group: Any = None
        self._groups: list[tuple[list[int], Any]] = []
        self._continuations: Continuations | None = None
        if self.two_level:
            for ranks in self.node_ranks() + self.cross_ranks():
                group = dist.new_group(ranks=ranks)
                self._groups.append((ranks, group if me in ranks else None))
            self.node_comm.group = self._groups[self.node][1]
            self.cross_group = self._groups[self.nodes + self.local_rank][1]

    @property
    def two_level(self) -> bool:
        """Whether the exchange has two levels: several nodes of several ranks (else it is
        the flat exchange, with no collective of its own)."""
        return self.nodes > 1 and self.ranks_per_node > 1

    @property
    def shape(self) -> str:
        """``2 nodes x 4 ranks``, for messages."""
        return f"{self.nodes} nodes x {self.ranks_per_node} ranks"

    def node_ranks(self) -> list[list[int]]:
        """The global ranks of each node's group, in node order."""
        return [list(m) for m in self.members]

    def cross_ranks(self) -> list[list[int]]:
        """The global ranks of each cross-node group, by local rank."""
        return [[m[local] for m in self.members] for local in range(self.ranks_per_node)]

    def continuations(self) -> Continuations:
        """The worker of submitted two-level exchanges, on duplicates of every node and
        cross-node group (created on first use, collectively, in the same order on every
        rank: every rank reaches its first asynchronous exchange at the same point)."""
        if self._continuations is None:
            self._continuations = Continuations(self._groups)
        return self._continuations


def gather_node_keys() -> tuple[list[int], str]:
    """Every rank's node as an integer key (a hash of ``GROUP_RANK`` or of the host name),
    gathered once over the default group, and how nodes were told (``torchrun`` or
    ``host name``).

    Raises:
        ConfigError: Some ranks run under torchrun's variables and others do not.
    """
    torchrun = "LOCAL_WORLD_SIZE" in os.environ and "GROUP_RANK" in os.environ
    name = f"group {os.environ['GROUP_RANK']}" if torchrun else f"host {socket.gethostname()}"
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    local = torch.tensor([key, int(torchrun)], dtype=torch.int64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    if len({int(o[1]) for o in out}) > 1:
        raise ConfigError("hierarchy 'node': some ranks have torchrun's LOCAL_WORLD_SIZE and "
                          "GROUP_RANK set and others not, so their nodes cannot be told; "
                          "start every rank the same way")
    return [int(o[0]) for o in out], "torchrun" if torchrun else "host name"
