"""The cost model's two levels (`gracecomm.network`: inside a node, across nodes) against
hand-computed alpha-beta times, and the flat-against-two-level projection."""

import pytest

from gracecomm.network import Network, project_hierarchies, two_level_stats
from gracecomm.validation import ConfigError

# 4 nodes of 2 ranks; network 1 Gbps (8e-9 s per byte), 10 us; NVLink-like 8 Gbps (1e-9), 1 us
NET = Network(bandwidth_gbps=1, latency_us=10, ranks_per_node=2, intra_gbps=8,
              intra_latency_us=1)
# a two-level step: each tensor (1 MB in all) reduced to its owner and broadcast inside the
# node; the owner's share allgathered across the 4 nodes (4000 bytes: 4 blocks of 1000)
STEP = {"node_coll_reduce_calls": 1, "node_coll_reduce_bytes": 1e6,
        "node_coll_broadcast_calls": 1, "node_coll_broadcast_bytes": 1e6,
        "coll_allgather_calls": 1, "coll_allgather_bytes": 4000}


def test_reduce_is_gloos_ring_reduce_scatter_then_gather():
    # 4 ranks, 1 MB: N alpha + 2(N-1)/N n beta = 4 * 10us + 1.5 * 1e6 * 8e-9
    assert Network(1, 10).time("reduce", 1e6, world_size=4) == pytest.approx(40e-6 + 0.012)


def test_two_levels_add_the_node_link_carrying_every_local_ranks_share():
    intra = (2 * 1e-6 + 1e6 * 1e-9) + (1e-6 + 1e6 * 1e-9)  # reduce (2 messages) + broadcast
    cross = 3 * 10e-6 + 2 * 0.75 * 4000 * 8e-9  # allgather of 4 nodes; 2 local ranks' shares
    assert NET.comm_time(STEP, world_size=8) == pytest.approx(intra + cross)
    assert NET.link_bytes(STEP, world_size=8) == pytest.approx(2 * 0.75 * 4000)


def test_the_default_intra_link_is_the_loopback_paid_by_the_hosts():
    loopback = Network(1, 10, ranks_per_node=2)
    intra = 3 * 10e-6  # 2 + 1 messages at the network's latency; the bytes cost no link
    cross = 3 * 10e-6 + 2 * 0.75 * 4000 * 8e-9
    assert loopback.comm_time(STEP, 8) == pytest.approx(intra + cross)
    hosts = Network(1, 10, ranks_per_node=2, host_gbps=8)  # 1e-9 s per payload byte
    # each rank moves its own bytes: 1 MB twice inside, 0.75 x 4000 across (not x 2)
    assert hosts.comm_time(STEP, 8) == pytest.approx(intra + cross + 2e-3 + 3000e-9)


def test_a_two_level_step_needs_nodes_of_several_ranks():
    with pytest.raises(ConfigError, match="two-level exchange .* ranks_per_node=1"):
        Network(1, 10).comm_time(STEP, 8)
    with pytest.raises(ConfigError, match="world_size=7"):
        NET.comm_time(STEP, 7)


@pytest.mark.parametrize("option", ["intra_gbps", "intra_latency_us"])
def test_bad_intra_options_are_named(option):
    with pytest.raises(ConfigError, match=f"'{option}' must be a number"):
        Network(1, 10, **{option: -1.0})


FLAT = {"coll_allgather_calls": 2, "coll_allgather_bytes": 1000.0, "dense_bytes": 1e6,
        "exchanges": 1, "tensors": 10, "step_s": 0.1, "comm_s": 0.01, "compress_s": 0.004}


def test_flat_statistics_as_the_two_level_exchange_would_record_them():
    # measured on one rank; 16 nodes of 8: the allgather gathers 16 blocks of 1/8 of the payload
    node = two_level_stats(FLAT, measured_at=1, nodes=16, ranks_per_node=8)
    assert node["coll_allgather_bytes"] == pytest.approx(1000 * 16 / 8)
    assert node["coll_allgather_calls"] == 2
    assert node["compress_s"] == pytest.approx(0.004 / 8)
    assert node["compute_s"] == pytest.approx(0.1 - 0.01 - 0.004)
    assert node["node_coll_reduce_calls"] == node["node_coll_broadcast_calls"] == 10
    assert node["node_coll_reduce_bytes"] == node["node_coll_broadcast_bytes"] == 1e6
    with pytest.raises(ConfigError, match="already a two-level"):
        two_level_stats(STEP, 1, 16, 8)


def test_the_projection_crosses_each_node_link_with_one_payload_per_node():
    net = Network(1, 10)
    cell = project_hierarchies(FLAT, 1, net, [16], ranks_per_node=8)[16]
    # flat: 128 ranks' blocks, (N-1)/N of them through each node's link; two-level: 16 nodes'
    assert cell["flat_link_bytes"] == pytest.approx(127 / 128 * 128 * 1000)
    assert cell["node_link_bytes"] == pytest.approx(8 * 15 / 16 * 16 * 1000 / 8)
    compute = 0.1 - 0.01 - 0.004
    flat = compute + 0.004 + 2 * 127 * 10e-6 + 127000 * 8e-9
    intra = 10 * (8 + 7) * 10e-6  # per tensor: reduce (8 messages), broadcast (7), loopback
    node = compute + 0.004 / 8 + intra + 2 * 15 * 10e-6 + 15000 * 8e-9
    assert cell["flat_step_s"] == pytest.approx(flat)
    assert cell["node_step_s"] == pytest.approx(node)
    assert cell["speedup"] == pytest.approx(flat / node)
    assert cell["dense_step_s"] == pytest.approx(compute + 2 * 127 * 10e-6
                                                 + 2 * 127 / 128 * 1e6 * 8e-9)


def test_one_rank_per_node_is_the_flat_exchange():
    cell = project_hierarchies(FLAT, 1, Network(1, 10), [4], ranks_per_node=1)[4]
    assert cell["node_step_s"] == pytest.approx(cell["flat_step_s"])
    assert cell["node_link_bytes"] == pytest.approx(cell["flat_link_bytes"])
