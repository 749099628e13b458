"""Timed collectives on the emulated cluster, run by torchrun on every node
(`gracecomm.experiments.cluster`): the per-message latency the cost model takes, and the
time of Gloo's allreduce and allgather of given sizes, to set against the model
(`gracecomm.network`) without any training around them.

    python -m torch.distributed.run ... -m gracecomm.experiments.cluster_probe OUT.json \\
        --allreduce 1078888 --allgather 21688 --repeats 10

Rank 0 writes ``{"world_size", "latency_s", "allreduce": {bytes: seconds}, "allgather":
{bytes per rank: seconds}}``: medians over `repeats` calls, after one untimed call. The
latency is the median time of a one-float allreduce divided by the 2(N-1) messages of
Gloo's ring.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

LATENCY_ROUNDS = 200


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(allreduce: list[int], allgather: list[int], repeats: int) -> dict[str, object]:
    """The figures of the module docstring, on this rank's process group."""
    n = dist.get_world_size()
    one = torch.zeros(1)
    latency = median_time(lambda: dist.all_reduce(one), LATENCY_ROUNDS) / (2 * (n - 1))
    out: dict[str, object] = {"world_size": n, "latency_s": latency,
                              "allreduce": {}, "allgather": {}}
    for nbytes in allreduce:
        x = torch.zeros(nbytes // 4)
        out["allreduce"][str(nbytes)] = median_time(lambda x=x: dist.all_reduce(x), repeats)
    for nbytes in allgather:
        x = torch.zeros(nbytes // 4)
        outs = [torch.empty_like(x) for _ in range(n)]
        out["allgather"][str(nbytes)] = median_time(
            lambda x=x, outs=outs: dist.all_gather(outs, x), repeats)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSON file rank 0 writes")
    parser.add_argument("--allreduce", type=int, nargs="*", default=[], metavar="BYTES")
    parser.add_argument("--allgather", type=int, nargs="*", default=[], metavar="BYTES",
                        help="bytes each rank contributes")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = probe(args.allreduce, args.allgather, args.repeats)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
