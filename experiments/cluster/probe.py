"""Timed collectives on the emulated cluster (`gracecomm.experiments.cluster.emulation`): the
per-message latency the cost model takes, and Gloo's allreduce and allgather of given sizes
against the model (`gracecomm.network`), without any training around them.

    python -m gracecomm.experiments.cluster.probe sweep \\
        results/cluster_collectives/collectives.json \\
        --nodes 2 4 8 --mbit 10 100 1000

``sweep`` makes a cluster for every node count and bandwidth and runs ``rank`` on every
node under torchrun; rank 0 writes ``{"world_size", "latency_s", "allreduce": {bytes:
seconds}, "allgather": {bytes per rank: seconds}}`` (and, with ``--node-allreduce``,
``"node_allreduce": {bytes: seconds}``: an allreduce inside each node's own group, every
node at once, over its unshaped loopback): medians over ``repeats`` calls after one untimed
call, every call after a barrier; ``sweep`` also counts the bytes the links
carry for 20 allreduces of 1.08 MB (`EmulatedCluster.link_bytes`; ``wire_per_payload``:
TCP/IP framing and acknowledgements, `gracecomm.network.TCP_OVER_ETHERNET`). The latency
is the floor of one message of Gloo's ring: the median time of an allreduce whose N chunks
each hold `LATENCY_CHUNKS` bytes, divided by its 2(N-1) messages, the least over those
sizes. (A one-float allreduce is no such probe: with fewer elements than ranks most chunks
are empty, and Gloo ends it in a fraction of the time its 2(N-1) messages take with bytes
in them.) The sweep's JSON holds each case's measurements next to the model's time for the
same collective (per-node links, TCP framing, the calibrated latency, messages that overlap it:
`gracecomm.network.Network.overlap`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gracecomm.experiments.training.launch import run_rank
from gracecomm.hierarchy import NodeLayout
from gracecomm.metrics import Metrics

LATENCY_ROUNDS = 100
LATENCY_CHUNKS = (16, 64, 256, 1024)  # bytes per chunk of the latency probe's allreduces
# ResNet-20's gradient as plain DDP (float32) and fp16 allreduce it, and Random-k's payload;
# Top-1%'s payload per rank
ALLREDUCE_BYTES = (1_078_888, 539_444, 10_868)
ALLGATHER_BYTES = (21_688,)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(allreduce: list[int], allgather: list[int], repeats: int,
          node_allreduce: list[int] = ()) -> dict[str, Any]:
    """The figures of the module docstring, on this rank's process group; `node_allreduce`
    sizes on the groups of the two-level exchange's nodes (`gracecomm.hierarchy.NodeLayout`)."""
    n = dist.get_world_size()
    probes = [torch.zeros(n * chunk // 4) for chunk in LATENCY_CHUNKS]
    latency = min(median_time(lambda x=x: dist.all_reduce(x), LATENCY_ROUNDS)
                  for x in probes) / (2 * (n - 1))
    out: dict[str, Any] = {"world_size": n, "latency_s": latency, "allreduce": {},
                           "allgather": {}}
    for nbytes in allreduce:
        x = torch.zeros(nbytes // 4)
        out["allreduce"][str(nbytes)] = median_time(lambda x=x: dist.all_reduce(x), repeats)
    for nbytes in allgather:
        x = torch.zeros(nbytes // 4)
        outs = [torch.empty_like(x) for _ in range(n)]
        out["allgather"][str(nbytes)] = median_time(
            lambda x=x, outs=outs: dist.all_gather(outs, x), repeats)
    if node_allreduce:
        group = NodeLayout(Metrics()).node_comm.group
        out["node_allreduce"] = {}
        for nbytes in node_allreduce:
            x = torch.zeros(nbytes // 4)
            out["node_allreduce"][str(nbytes)] = median_time(
                lambda x=x: dist.all_reduce(x, group=group), repeats)
    return out


WIRE_CALLS, WIRE_BYTES = 20, 1_078_888  # the allreduces whose link bytes `sweep` counts
# a collective waiting longer fails (a dead peer): the slowest probe, 1 MB allreduced at
# 8 nodes and 10 Mbit/s, took 1.7 s (results/cluster_collectives)
COLLECTIVE_TIMEOUT_S = 300


def rank_main(args: argparse.Namespace) -> None:
    """One rank under torchrun, its whole life in `run_rank` (join the group, report a
    failure in torchrun's error file, end after a barrier without the interpreter's
    teardown)."""
    run_rank(_probe_rank, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), (args,),
             backend="gloo", collective_timeout_s=COLLECTIVE_TIMEOUT_S)


def _probe_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.wire:  # only WIRE_CALLS allreduces, for the links' byte counters
        x = torch.zeros(WIRE_BYTES // 4)
        for _ in range(WIRE_CALLS):
            dist.all_reduce(x)
        return
    result = probe(args.allreduce, args.allgather, args.repeats, args.node_allreduce)
    if rank == 0:
        args.out.write_text(json.dumps(result))


def sweep(nodes: list[int], mbits: list[float], repeats: int, work: Path) -> dict[str, Any]:
    """Every node count at every bandwidth: the measured times and the model's, and the
    bytes the links carried per payload byte of a ring allreduce (each of N ranks sends
    2(N-1)/N of the vector per call)."""
    from gracecomm.experiments.cluster.emulation import (
        EmulatedCluster,
        Link,
        cluster_network,
        sigterm_as_exit,
    )
    cases = []
    with sigterm_as_exit():
        for mbit in mbits:
            for n in nodes:
                out = work / f"probe_{n}n_{mbit:g}mbit.json"
                with EmulatedCluster(n, Link(mbit)) as cluster:
                    cluster.torchrun(
                        ["-m", "gracecomm.experiments.cluster.probe", "rank", str(out),
                         "--allreduce", *map(str, ALLREDUCE_BYTES),
                         "--allgather", *map(str, ALLGATHER_BYTES),
                         "--repeats", str(repeats)], work / f"logs_{n}n_{mbit:g}", 900)
                    before = cluster.link_bytes()
                    cluster.torchrun(["-m", "gracecomm.experiments.cluster.probe", "rank",
                                      str(out), "--wire"], work / f"wire_{n}n_{mbit:g}", 900)
                    payload = n * WIRE_CALLS * 2 * (n - 1) / n * WIRE_BYTES
                    wire = (cluster.link_bytes() - before) / payload
                measured = json.loads(out.read_text())
                net = cluster_network(mbit, measured["latency_s"] * 1e6)
                model = {"allreduce": {b: net.time("allreduce", int(b), n)
                                       for b in measured["allreduce"]},
                         "allgather": {b: net.time("allgather", n * int(b), n)
                                       for b in measured["allgather"]}}
                cases.append({"nodes": n, "bandwidth_mbps": mbit, **measured, "model": model,
                              "wire_per_payload": wire, "load": list(os.getloadavg())})
                print(json.dumps(cases[-1]), flush=True)
    return {"cases": cases, "repeats": repeats}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rank = sub.add_parser("rank", help="one rank's probe (under torchrun)")
    rank.add_argument("out", type=Path, help="JSON file rank 0 writes")
    rank.add_argument("--allreduce", type=int, nargs="*", default=[], metavar="BYTES")
    rank.add_argument("--allgather", type=int, nargs="*", default=[], metavar="BYTES",
                      help="bytes each rank contributes")
    rank.add_argument("--node-allreduce", type=int, nargs="*", default=[], metavar="BYTES",
                      help="allreduces inside each node (nodes of several ranks)")
    rank.add_argument("--repeats", type=int, default=10)
    rank.add_argument("--wire", action="store_true", help="only the allreduces of the "
                      "links' byte count")
    many = sub.add_parser("sweep", help="clusters of every size and bandwidth, probed")
    many.add_argument("out", type=Path, help="JSON file of every case, model beside")
    many.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    many.add_argument("--mbit", type=float, nargs="+", default=[10, 100, 1000])
    many.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if args.command == "rank":
        rank_main(args)
        return
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        result = sweep(args.nodes, args.mbit, args.repeats, Path(tmp))
    result["command"] = "python -m gracecomm.experiments.cluster.probe " + " ".join(
        argv if argv is not None else sys.argv[1:])
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
