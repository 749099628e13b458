"""The cluster's cost model additions (per-node links with TCP framing, Gloo's binomial
broadcast, ranks per node, statistics at another world size), the results-page tables
rendered from stored netbench outputs, the scaling crossover and the projection's inputs."""

from __future__ import annotations

import json
import math

import pytest

from gracecomm.experiments.cluster import report as cluster_report
from gracecomm.experiments.cluster.projection import bert_base_shapes, buckets, resnet50_shapes
from gracecomm.network import TCP_OVER_ETHERNET, Network, at_world_size, bytes_key, calls_key
from gracecomm.validation import ConfigError

MBIT = 8 / 100e6  # seconds per byte at 100 Mbit/s


def test_tcp_framing_and_gloo_broadcast_by_hand():
    net = Network(0.1, 0.0, overhead=TCP_OVER_ETHERNET, broadcast="tree")
    assert TCP_OVER_ETHERNET == pytest.approx(1514 / 1448)
    assert net.time("allreduce", 1e6, 4) == pytest.approx(1.5 * 1e6 * MBIT * TCP_OVER_ETHERNET)
    # binomial tree: the root sends the message ceil(log2 8) = 3 times
    assert net.time("broadcast", 1e6, 8) == pytest.approx(3 * 1e6 * MBIT * TCP_OVER_ETHERNET)
    # a parameter server's reply of 1 MB to each of 7 workers is one tree broadcast
    assert net.time("ps_pull", 7e6, 8) == pytest.approx(3 * 1e6 * MBIT * TCP_OVER_ETHERNET)
    assert Network(0.1, 0.0).time("ps_pull", 7e6, 8) == pytest.approx(7e6 * MBIT)


def test_ranks_per_node_spare_the_servers_link_only():
    two = Network(0.1, 0.0, ranks_per_node=2)
    assert two.time("ps_push", 7e6, 8) == pytest.approx(6e6 * MBIT)  # 6 remote workers
    assert two.time("allreduce", 1e6, 8) == Network(0.1, 0.0).time("allreduce", 1e6, 8)
    with pytest.raises(ConfigError, match="broadcast"):
        Network(0.1, 0.0, broadcast="star")
    with pytest.raises(ConfigError, match="overhead"):
        Network(0.1, 0.0, overhead=0.5)


def test_statistics_at_another_world_size():
    stats = {bytes_key("allgather"): 4 * 1000.0, calls_key("allgather"): 2,
             bytes_key("allreduce"): 500.0, bytes_key("ps_push"): 3 * 10.0, "compute_s": 0.1}
    at8 = at_world_size(stats, 4, 8)
    assert at8[bytes_key("allgather")] == 8 * 1000.0 and at8[calls_key("allgather")] == 2
    assert at8[bytes_key("allreduce")] == 500.0 and at8["compute_s"] == 0.1
    assert at8[bytes_key("ps_push")] == pytest.approx(7 * 10.0)


def run(method, step_s, speedup, projected, timed=True, **extra):
    return {"method": method, "step_s": step_s, "round_step_s": [step_s, step_s],
            "measured_speedup": speedup, "projected_speedup": projected, "comm_timed": timed,
            "compute_s": 0.05, "wire_bytes": 21688.0, **extra}


def stored(tmp_path, name, world_size, runs, **extra):
    result = {"provenance": {"command": "gracecomm-netbench topology=cluster",
                             "commit": "abc", "date": "today", "cpus": 2,
                             "load_before": [0.3], "load_after": [0.4]},
              "bandwidth_mbps": 100.0, "topology": "cluster", "world_size": world_size,
              "ranks_per_node": 1, "ranks": world_size, "latency_us_calibrated": 60.0,
              "compute_alone_s": 0.02, "runs": runs, **extra}
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return path


def test_step_table_names_the_projection_error_and_pytorchs_hooks(tmp_path):
    path = stored(tmp_path, "step.json", 4, [
        run("ddp", 0.2, 1.0, 1.0, timed=False), run("fp16", 0.1, 2.0, 2.2),
        run("torch_fp16", 0.095, 2.1, 2.0)])
    table = cluster_report.render_step(path)
    assert "| `fp16` | 100.0 (100.0-100.0) | 2.00x | 2.20x | +10% |" in table
    assert "| `ddp` | 200.0 (200.0-200.0) | 1.00x | - | - | - |" in table
    assert "`fp16` +5% of `torch_fp16`" in table and "commit `abc`" in table


def test_time_to_accuracy_table_says_a_miss(tmp_path):
    tta = {"reached_target": True, "time_to_target_s": 10.0, "steps_to_target": 90,
           "final_accuracy": 0.95, "target_accuracy": 0.93, "tta_speedup": 1.0}
    path = stored(tmp_path, "tta.json", 4, [
        run("ddp", 0.2, 1.0, 1.0, timed=False, **tta),
        run("randomk", 0.05, 4.0, 4.0, **{**tta, "reached_target": False,
                                          "time_to_target_s": 20.0, "tta_speedup": 0.5,
                                          "steps_to_target": 300})],
        goal="accuracy", target_accuracy=0.93,
        reference={"method": "ddp", "final_accuracy": 0.98, "steps": 300})
    table = cluster_report.render_tta(path)
    assert "| `randomk` | no | 300 | > 20.0 | < 0.50x |" in table
    assert "| `ddp` | yes | 90 | 10.0 | 1.00x |" in table


def test_strategy_table_gives_the_median_round_and_the_spread(tmp_path):
    def tta(method, times):
        return run(method, 0.1, 1.0, 1.0, reached_target=True, final_accuracy=0.9,
                   time_to_target_s=sorted(times)[1],
                   rounds=[{"time_to_target_s": t, "steps_to_target": 90,
                            "reached_target": True} for t in times])
    path = stored(tmp_path, "tta.json", 4, [
        tta("ddp", [20.0, 22.0, 21.0]), tta("topk", [10.0, 12.0, 11.0]),
        {**tta("topk@auto", [11.5, 10.5, 13.0]),
         "decision": {"forms": {"compressed": 59, "fp16": 0, "dense": 0}, "decide_s": 0.2}}],
        goal="accuracy", target_accuracy=0.9)
    table = cluster_report.render_strategies([path])
    assert "each time the median of 3 rounds run in turn, [the fastest - the slowest]" in table
    assert ("| 100 Mbit/s | `topk` | 21.0 [20.0-22.0] / 11.0 [10.0-12.0] / 11.5 [10.5-13.0] "
            "| 1.05x | 0.96x | 59 / 0 / 0 | 0.20 | 0.9000 / 0.9000 |") in table


def test_model_table_and_crossover(tmp_path):
    def stats(nbytes, kind):
        return {bytes_key(kind): nbytes, calls_key(kind): 1, "compute_s": 0.02}
    paths = []
    for n in (2, 4, 8):  # Top-1% gathers N blocks; PowerSGD allreduces a fixed vector
        topk = run("topk", 0.02 + 0.001 * n, 5.0, 5.0, stats=stats(n * 20000.0, "allgather"))
        psgd = run("powersgd_parity", 0.025, 4.0, 4.2, stats=stats(60000.0, "allreduce"))
        paths.append(stored(tmp_path, f"{n}.json", n, [run("ddp", 0.2, 1.0, 1.0, timed=False),
                                                       topk, psgd]))
    table = cluster_report.render_model(paths)
    assert "| `powersgd_parity` | 4.00 / 4.20 (+5%) |" in table and "Largest error: 5%" in table
    data = cluster_report.plot_crossover(paths, tmp_path / "crossover.png")
    assert (tmp_path / "crossover.png").stat().st_size > 0
    assert data["crossover_measured"] == 8  # Top-k 24 ms against 25 at 4 nodes, 28 at 8
    projected = data["projected"]
    assert projected["topk"][2] < projected["powersgd_parity"][2]
    assert data["crossover_projected"] and projected["topk"][1024] > projected[
        "powersgd_parity"][1024]


def test_a_stored_runs_network_keeps_its_overlap(tmp_path):
    def network(name, **stored_network):
        path = stored(tmp_path, name, 8, [], network={"host_gbps": 4.0, **stored_network})
        return cluster_report.network_of(json.loads(path.read_text()))
    now, before = network("now.json", overlap=True), network("before.json")
    assert now.overlap and not before.overlap and now.host_gbps == 4.0
    # 14 messages of 10 kB allreduced at 8 nodes: the 60 us latency overlaps each transfer
    assert now.time("allreduce", 1e4, 8) < before.time("allreduce", 1e4, 8)


def test_projection_inputs_come_from_the_models_definitions():
    assert sum(math.prod(s) for s in resnet50_shapes()) == 25_557_032
    assert sum(math.prod(s) for s in bert_base_shapes()) == 109_482_240
    assert buckets(2**20) == 1 and buckets(2**20 + 1) == 2  # DDP: 1 MiB, then 25 MiB


def test_the_hosts_rate_adds_to_the_links_time_per_payload_byte():
    link = Network(1.0, 0.0, overhead=TCP_OVER_ETHERNET)
    both = Network(1.0, 0.0, overhead=TCP_OVER_ETHERNET, host_gbps=2.0)
    extra = both.time("allreduce", 1e6, 4) - link.time("allreduce", 1e6, 4)
    assert extra == pytest.approx(1.5 * 1e6 * 8 / 2e9)  # 2(N-1)/N of the payload at 2 Gbit/s
    with pytest.raises(ConfigError, match="host_gbps"):
        Network(1.0, 0.0, host_gbps=0.0)


def test_the_projection_compares_nodes_of_eight_flat_and_two_level():
    from gracecomm.experiments.cluster.projection import (
        NODES,
        hierarchy_grid,
        step_stats,
        step_time,
    )
    topk = {"method": "topk", "communicator": "allgather", "wire_bytes": 2e5,
            "dense_bytes": 1e8, "calls_per_bucket": 1, "reads": 3.0}
    net = Network(10.0, 25.0, overhead=TCP_OVER_ETHERNET)
    stats = at_world_size(step_stats(topk, 0.3, 0), 1, 64)
    assert stats[bytes_key("allgather")] == 64 * 2e5 and stats[calls_key("allgather")] == 5
    by_hand = 0.3 + 3.0 * 1e8 / 900e9 + net.comm_time(stats, 64)
    assert step_time(topk, 0.3, 64, net) == pytest.approx(by_hand)
    grid = hierarchy_grid({"topk": topk}, 0.3, tensors=100)
    assert len(grid) == 3 * len(NODES)
    cell = grid["1024@10"]["topk"]  # 1024 nodes: each node's link carries 1/8 of the flat
    assert cell["node_link_bytes"] / cell["flat_link_bytes"] == pytest.approx(
        (1023 / 1024) / (8191 / 8192) / 8)
    assert cell["speedup"] > 1


def test_hierarchy_tables(tmp_path):
    def both(name, flat_s, node_s, flat_bytes, node_bytes):
        return [run(name, flat_s, 1.0, 1.0, hierarchy="flat",
                    cross_node_bytes_per_step=flat_bytes),
                run(f"{name}@node", node_s, 1.0, 1.0, hierarchy="node",
                    cross_node_bytes_per_step=node_bytes, projected_step_s=1.1 * node_s)]
    path = stored(tmp_path, "h.json", 4, [*both("ddp", 0.2, 0.19, 4e6, 4e6),
                                          *both("topk", 0.1, 0.05, 2e5, 1e5)])
    table = cluster_report.render_hierarchies(path)
    assert "| `topk` | 100.0 | 50.0 | 2.00x | 200.0 | 100.0 | 0.50x | 55.0 |" in table
    assert "| `ddp` | 200.0 | 190.0 |" in table and "`topk@node`" not in table
    projection = {"assumptions": {"hierarchy": {"ranks_per_node": 8, "intra_gbps": 1200.0,
                                                "intra_latency_us": 3.4}},
                  "models": {"m": {"methods": {"topk": {}}, "hierarchy": {"16@1": {"topk": {
                      "speedup": 2.0, "node_link_bytes": 1.0, "flat_link_bytes": 8.0}}}}}}
    (tmp_path / "p.json").write_text(json.dumps(projection))
    assert "| 16@1 | 2.00x / 0.12 |" in cluster_report.render_hierarchy_projection(
        tmp_path / "p.json")


def test_a_method_that_missed_the_target_never_wins_where_the_projection_knows_it():
    from gracecomm.experiments.cluster.projection import winners
    grid = {"16@1": {"step_s": {"ddp": 1.0, "topk": 0.5, "randomk": 0.2},
                     "tta_s": {"ddp": 100.0, "topk": 60.0}}}  # randomk missed the target
    projection = {"tta_source": "tta.json", "models": {"m": {"grid": grid}}}
    assert winners(projection, "m") == {(16, 1.0): ("topk", 2.0)}
    assert winners(projection, "m", "tta_s") == {(16, 1.0): ("topk", 100.0 / 60.0)}
    projection["tta_source"] = None  # no evidence: the shortest step wins
    assert winners(projection, "m") == {(16, 1.0): ("randomk", 5.0)}


def test_the_decision_table_names_the_soonest_method_that_reached_the_target(tmp_path):
    from gracecomm.experiments.cluster.projection import Fastest, fastest

    def traffic(method, kind, wire):
        return {"method": method, "communicator": kind, "wire_bytes": wire, "dense_bytes": 1e8,
                "calls_per_bucket": 1, "reads": 3.0}
    methods = {"ddp": traffic("ddp", "allreduce", 1e8), "topk": traffic("topk", "allgather", 2e5),
               "randomk": traffic("randomk", "allreduce", 1e5)}
    projection = {"nodes": [16], "bandwidths_gbps": [1.0], "tta_source": "steps.json",
                  "models": {"m": {"parameters": 25_000_000, "compute_s": 0.3, "methods": methods,
                                   "grid": {"16@1": {"step_s": {"ddp": 1.0, "topk": 0.4,
                                                                "randomk": 0.2},
                                                     "tta_s": {"ddp": 90.0, "topk": 80.0}}}}}}
    (tmp_path / "p.json").write_text(json.dumps(projection))
    tta = {"reached_target": True, "steps_to_target": 90, "final_accuracy": 0.95}
    missed = {**tta, "reached_target": False, "steps_to_target": 300}
    measured = stored(tmp_path, "4n_100mbit.json", 4, [
        run("ddp", 0.2, 1.0, 1.0, timed=False, time_to_target_s=20.0, **tta),
        run("fp16", 0.1, 2.0, 2.0, time_to_target_s=8.0, **tta),  # not the projection's
        run("topk", 0.05, 4.0, 4.0, time_to_target_s=12.5, **{**tta, "steps_to_target": 200}),
        run("randomk", 0.04, 5.0, 5.0, time_to_target_s=5.0, **missed)],
        goal="accuracy", target_accuracy=0.93)
    source = json.loads(measured.read_text())
    cells = cluster_report.decision_cells(projection, "m", [source], {"ddp": 90, "topk": 200})
    # measured: randomk missed the target, however short its time; fp16 does not compete
    assert cells[(4, 100)] == (Fastest("topk", 1.6, "ddp", 1.6), True)
    assert cells[(16, 1000)] == (Fastest("topk", 90 / 80, "ddp", 90 / 80), False)  # as stored
    slow, fast = cells[(2, 10)][0], cells[(2, 100_000)][0]  # computed from the statistics
    assert slow.method == "topk" and slow.over_ddp > 10 and fast.method == "ddp"
    assert "randomk" not in (slow.runner_up, fast.runner_up)
    assert fastest({}) is None and fastest({"topk": 2.0}) == Fastest("topk", None, None, None)
    table = cluster_report.render_decision(tmp_path / "p.json", [measured], measured, "m")
    assert "| 4 | " in table and "**`topk` 1.60x vs DDP (the runner-up)** (measured)" in table
    assert f"| `ddp` {fast.over_runner_up:.2f}x over `topk` |" in table  # no margin over itself
    assert "`randomk` (missed at 4 nodes at 100 Mbit/s)" in table
    assert "(not the runs' `fp16`)" in table
    assert cluster_report.verdict(None, False) == "-"
