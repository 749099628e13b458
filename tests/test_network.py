"""The network cost model against hand-computed alpha-beta times, and the collectives the
communicators record for it on 2 ranks."""

from dataclasses import replace

import pytest
import torch

import gracecomm
from gracecomm.network import Network, networks, project
from gracecomm.validation import ConfigError
from tests.helpers import run_ranks

# 1 Gbps = 1.25e8 bytes/s, i.e. 8e-9 s per byte; latency 10 us
NET = Network(bandwidth_gbps=1, latency_us=10)


def test_ring_allreduce_matches_hand_computation():
    # 4 ranks, 1 MB: 2(N-1) alpha + 2(N-1)/N n beta = 6 * 10us + 1.5 * 1e6 * 8e-9
    assert NET.time("allreduce", 1e6, world_size=4) == pytest.approx(60e-6 + 0.012)
    # three allreduces moving 1 MB in total pay the latency three times
    assert NET.time("allreduce", 1e6, world_size=4, calls=3) == pytest.approx(180e-6 + 0.012)


def test_ring_allgather_matches_hand_computation():
    # 4 ranks gather 100 kB each (n = 400 kB): (N-1) alpha + (N-1)/N n beta
    assert NET.time("allgather", 4e5, world_size=4) == pytest.approx(30e-6 + 0.75 * 4e5 * 8e-9)


def test_broadcast_and_parameter_server_times():
    assert NET.time("broadcast", 1e6, world_size=4) == pytest.approx(30e-6 + 8e-3)
    # the server's link carries everything: 3 workers x 1 MB up, the same down
    assert NET.time("ps_push", 3e6, world_size=4) == pytest.approx(10e-6 + 0.024)
    assert NET.time("ps_pull", 3e6, world_size=4) == pytest.approx(10e-6 + 0.024)


def test_overlap_charges_the_larger_of_latency_and_transfer_per_message():
    slow = Network(bandwidth_gbps=0.1, latency_us=1600, overlap=True)  # 8e-8 s per byte
    # 8 ranks, 14 ring messages: a 10 kB allreduce waits 1.6 ms per message; a 1 MB one's
    # messages of 125 kB take 10 ms each on the link and hide the wait
    assert slow.time("allreduce", 1e4, 8) == pytest.approx(14 * 1.6e-3)
    assert slow.time("allreduce", 1e6, 8) == pytest.approx(1.75 * 1e6 * 8e-8)
    assert slow.time("allreduce", 1e6, 8) < replace(slow, overlap=False).time("allreduce", 1e6, 8)
    # two calls share the bytes equally: 2 x 7 messages of 1 kB (80 us each, under the floor)
    assert slow.time("allgather", 2 * 8e3, 8, calls=2) == pytest.approx(14 * 1.6e-3)
    with pytest.raises(ConfigError, match="set one of them, not both"):
        Network(0.1, 10, shared=True, overlap=True)


def test_one_rank_or_no_call_costs_nothing():
    assert NET.time("allreduce", 1e6, world_size=1) == 0.0
    assert NET.time("allgather", 0.0, world_size=4, calls=0) == 0.0


def test_projection_and_speedup_by_hand():
    stats = {"step_s": 0.050, "comm_s": 0.010, "compress_s": 0.002, "decompress_s": 0.002,
             "memory_s": 0.001, "dense_bytes": 1e6, "exchanges": 1,
             "coll_allgather_calls": 2, "coll_allgather_bytes": 2e4}
    out = project(stats, 2, networks([0.1, 10], 10))
    compute = 0.050 - 0.010 - 0.005
    assert out["compute_s"] == pytest.approx(compute)
    comm = 2 * 10e-6 + 0.5 * 2e4 * 8e-8  # two allgathers at 0.1 Gbps
    dense = 2 * 10e-6 + 1e6 * 8e-8       # ring allreduce of 1 MB, N = 2
    assert out["net_comm_s@0.1Gbps"] == pytest.approx(comm)
    assert out["projected_step_s@0.1Gbps"] == pytest.approx(compute + 0.005 + comm)
    assert out["dense_step_s@0.1Gbps"] == pytest.approx(compute + dense)
    assert out["speedup@0.1Gbps"] == pytest.approx((compute + dense) / (compute + 0.005 + comm))
    assert out["speedup@0.1Gbps"] > 1 > out["speedup@10Gbps"]  # pays off only on slow links


@pytest.mark.parametrize("bandwidth,latency,message", [
    (0, 10, "option 'bandwidth_gbps' must be a number in (0.0, inf)"),
    (1, -1, "option 'latency_us' must be a number in [0.0, inf)"),
    ([], 10, "option 'bandwidth_gbps' must list at least one bandwidth"),
])
def test_bad_network_options(bandwidth, latency, message):
    with pytest.raises(ConfigError) as err:
        networks(bandwidth, latency)
    assert message in str(err.value)


def test_unknown_collective_kind():
    with pytest.raises(ConfigError, match="kinds are allreduce, allgather"):
        NET.time("alltoall", 1.0, 2)


def record_collectives(rank, world_size):
    tensors = [("a", torch.randn(1000) * (rank + 1)), ("b", torch.randn(10, 10))]
    dense = gracecomm.build("none")
    dense.step_many(tensors)
    stats = dense.metrics.pop()
    assert stats["exchanges"] == 1
    assert stats["coll_allreduce_calls"] == 1
    assert stats["coll_allreduce_bytes"] == stats["wire_bytes"] == 4 * 1100

    sparse = gracecomm.build({"name": "topk", "ratio": 0.1})  # allgather: sizes, then payloads
    sparse.step_many(tensors)
    stats = sparse.metrics.pop()
    assert stats["coll_allgather_calls"] == 2
    # the first exchange of a fixed-size method agrees on the layout: 4 payload tensors'
    # byte counts and dtype codes (int64) per rank; payloads: 110 (value, index) pairs per rank
    assert stats["coll_allgather_bytes"] == world_size * (2 * 4 * 8 + 110 * 8)

    bcast = gracecomm.build({"name": "topk", "ratio": 0.1}, communicator="broadcast")
    bcast.step_many(tensors)
    stats = bcast.metrics.pop()
    assert stats["coll_broadcast_calls"] == world_size
    assert stats["coll_broadcast_bytes"] == world_size * 110 * 8


@pytest.mark.slow
def test_communicators_record_their_collectives():
    run_ranks(record_collectives, 2)
