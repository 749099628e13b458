"""`gracecomm-advise`: options refused up front, the ranking's rules (stored evidence first,
a method that missed the target never recommended), and the command's last line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gracecomm.experiments.cluster import advise
from gracecomm.experiments.cluster import evidence as evidence_module
from gracecomm.validation import ConfigError
from tests.helpers import console_script

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "advise.yaml"
MLP = {"model": "mlp", "data": "digits", "batch_size": 8}


def config(**options):
    cfg = OmegaConf.load(CONFIG)
    del cfg["hydra"]
    return OmegaConf.merge(cfg, options)


def evidence(tmp_path: Path, reached: dict[str, int | None]) -> Path:
    """A goal=accuracy netbench result: steps to the target per method (None: missed)."""
    runs = [{"method": m, "reached_target": steps is not None, "steps_to_target": steps or 300}
            for m, steps in reached.items()]
    path = tmp_path / "tta.json"
    path.write_text(json.dumps({
        "runs": runs, "world_size": 4, "bandwidth_mbps": 100.0, "target_accuracy": 0.93,
        "provenance": {"command": 'gracecomm-netbench overrides=["model=mlp","data=digits"]'}}))
    return path


@pytest.mark.parametrize(("options", "words"), [
    ({"nodes": 1}, "option 'nodes'"),
    ({"ranks_per_node": 0}, "option 'ranks_per_node'"),
    ({"bandwidth_mbps": float("inf")}, "'bandwidth_mbps' must be a positive, finite"),
    ({"intra_gbps": -1}, "'intra_gbps' must be a positive, finite"),
    ({"methods": []}, "at least one method preset"),
    ({"methods": ["topkk"]}, "Did you mean 'topk'"),
    ({"evidence": "/nonexistent/tta.json"}, "option 'evidence' names /nonexistent/tta.json"),
])
def test_bad_options_are_refused_before_any_timing(options, words):
    with pytest.raises(ConfigError, match=words):
        advise.validate(config(**options))


@pytest.mark.slow  # times a training step and four methods
def test_evidence_ranks_first_and_a_miss_is_never_recommended(tmp_path):
    cfg = config(workload=MLP, repeats=1,
                 methods=["randomk", "ddp", "fp16", "topk"],
                 evidence=str(evidence(tmp_path, {"ddp": 50, "topk": 80, "randomk": None})))
    result = advise.rank(cfg)
    order = [row["method"] for row in result["ranking"]]
    by = {row["method"]: row for row in result["ranking"]}
    reached = sorted(("ddp", "topk"), key=lambda m: by[m]["time_to_target_s"])
    assert order == [*reached, "fp16", "randomk"]  # evidence, then unknown, then the miss
    assert by["topk"]["time_to_target_s"] == pytest.approx(80 * by["topk"]["step_s"])
    assert by["fp16"]["time_to_target_s"] is None and by["fp16"]["evidence"].startswith("unknown")
    assert by["randomk"]["missed"] and "not recommended" in by["randomk"]["evidence"]
    assert "model=mlp,data=digits, 4 nodes at 100 Mbit/s" in by["ddp"]["evidence"]
    table = advise.table(result)
    assert "| - | `randomk` |" in table and "| 1 | " in table
    line = advise.summary_line(result)
    assert set(line) == {"nodes", "ranks_per_node", "bandwidth_mbps", "ranking"}
    assert [r["method"] for r in line["ranking"]] == order


@pytest.mark.slow  # times a training step and two methods
def test_nodes_of_several_ranks_project_this_librarys_methods_in_two_levels(tmp_path):
    cfg = config(workload=MLP, repeats=1, ranks_per_node=4,
                 methods=["ddp", "topk"], evidence=str(evidence(tmp_path, {})))
    by = {row["method"]: row for row in advise.rank(cfg)["ranking"]}
    assert (by["ddp"]["hierarchy"], by["topk"]["hierarchy"]) == ("flat", "node")


@pytest.mark.slow
def test_the_command_prints_the_ranking_and_its_json_last(tmp_path):
    proc = console_script("gracecomm-advise", tmp_path, "workload.model=mlp",
                          "workload.data=digits", "methods=[ddp,topk]", "repeats=1",
                          f"evidence={evidence(tmp_path, {'ddp': 50, 'topk': 80})}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["nodes"] == 4 and {r["method"] for r in last["ranking"]} == {"ddp", "topk"}
    assert "| rank | method |" in proc.stdout, proc.stdout


def cluster_run(tmp_path: Path, goal: str = "step") -> Path:
    """A stored goal=step netbench result of the emulated cluster, calibrated."""
    path = tmp_path / "4n_100mbit.json"
    path.write_text(json.dumps({
        "topology": "cluster", "goal": goal, "world_size": 4, "ranks_per_node": 1,
        "bandwidth_mbps": 100.0, "latency_us_calibrated": 800.0, "compute_alone_s": 0.02,
        "network": {"overhead": 1.05, "broadcast": "tree", "shared": False, "host_gbps": 5.0,
                    "overlap": True},
        "runs": [{"method": "ddp", "step_s": 0.2, "comm_timed": False, "compute_s": 0.03},
                 {"method": "topk", "step_s": 0.1, "comm_timed": True, "compute_s": 0.05},
                 {"method": "fp16", "step_s": 0.12, "comm_timed": True, "compute_s": 0.04}]}))
    return path


def test_against_takes_the_stored_cluster_its_network_and_contention(tmp_path):
    cfg = advise.against(config(against=str(cluster_run(tmp_path)), nodes=8))
    assert (cfg.nodes, cfg.ranks_per_node, cfg.bandwidth_mbps) == (4, 1, 100.0)
    assert cfg.contention == pytest.approx(0.045 / 0.02)  # timed runs only: topk, fp16
    net = advise.network(cfg)
    assert (net.latency_us, net.host_gbps, net.overlap) == (800.0, 5.0, True)
    assert advise.against(config()) == config()  # none: as configured
    with pytest.raises(ConfigError, match="not a goal=step netbench result of topology=cluster"):
        advise.validate(config(against=str(cluster_run(tmp_path, goal="accuracy"))))
    with pytest.raises(ConfigError, match="option 'contention'"):
        advise.validate(config(contention=0.5))


def test_checked_rows_show_the_measured_step_and_the_error(tmp_path):
    result = {"model": "resnet20", "parameters": 10, "compute_s": 0.02, "nodes": 4,
              "ranks_per_node": 1, "bandwidth_mbps": 100.0, "evidence": None,
              "against": "4n_100mbit.json", "contention": 2.0,
              "ranking": [{"method": "topk", "hierarchy": "flat", "step_s": 0.11,
                           "time_to_target_s": None, "verdict": "unknown", "missed": False,
                           "wire_bytes": 1000.0, "compress_s": 0.001, "evidence": "unknown",
                           "measured_step_s": 0.1}]}
    assert "| 110.0 | - | 1.0 | 1.0 | unknown | 100.0 | +10% |" in advise.table(result)
    assert advise.summary_line(result)["ranking"][0]["measured_step_s"] == 0.1
    path = tmp_path / "advise.json"
    path.write_text(json.dumps(result))
    assert "| 100 Mbit/s | `topk` | 110.0 | 100.0 | +10% |" in advise.render_checks([path])


def test_a_rank_decodes_every_nodes_payload_where_the_communicator_does_not_sum(monkeypatch):
    """`traffic` at N ranks adds the decoding of N payloads per tensor (less one) for
    allgather, and nothing for a communicator that sums payloads."""
    from gracecomm.communicator import Communicator
    from gracecomm.experiments.cluster.projection import traffic

    decoded: list[int] = []  # payloads per tensor of each aggregation
    aggregate = Communicator.aggregate_items
    monkeypatch.setattr(Communicator, "aggregate_items", lambda self, items, per_rank: (
        decoded.append(len(per_rank)), aggregate(self, items, per_rank))[1])
    traffic("topk", [(8, 4), (16,)], ranks=4)
    assert set(decoded) == {1, 4}  # the steps' own payload; then 1 against 4, timed
    decoded.clear()
    traffic("fp16", [(8, 4), (16,)], ranks=4)
    assert not decoded


def test_step_penalty_is_a_method_s_steps_over_the_baseline_s(tmp_path):
    path = evidence(tmp_path, {"ddp": 90, "topk": 225, "fp16": 80, "randomk": None})
    assert evidence_module.step_penalty("topk", path)[0] == 2.5
    assert evidence_module.step_penalty("fp16", path)[0] == 1.0  # never below 1
    penalty, why = evidence_module.step_penalty("randomk", path)
    assert penalty == math.inf and why.startswith("randomk missed the target in tta.json")
    assert evidence_module.step_penalty("qsgd", path) is None
    assert evidence_module.step_penalty("topk", evidence(tmp_path, {"ddp": None})) is None


def test_an_auto_run_takes_its_method_s_step_penalty_unless_given(tmp_path, monkeypatch):
    """``exchange.step_penalty`` null: the stored ratio of the preset whose compressor,
    memory and communicator the run has (``+method=NAME`` or ``compressor=NAME``); another
    ratio is another method, and a value given is kept."""
    from gracecomm.experiments import presets
    monkeypatch.setattr(evidence_module, "EVIDENCE", evidence(tmp_path, {"ddp": 80, "topk": 200}))
    cfg = presets.train_config("exchange.strategy=auto")
    assert evidence_module.apply_step_penalty(cfg, {"compressor": "topk"}) == [
        "exchange.step_penalty=2.5 (topk needed 200 steps to the target, ddp 80, in tta.json: "
        "model=mlp,data=digits, 4 nodes at 100 Mbit/s, target accuracy 0.930)"]
    assert cfg.exchange.step_penalty == 2.5
    other = presets.train_config("exchange.strategy=auto", "compressor.ratio=0.1")
    [line] = evidence_module.apply_step_penalty(other, {"compressor": "topk"})
    assert other.exchange.step_penalty == 1.0 and "no stored run of this method" in line
    given = presets.train_config("exchange.strategy=auto", "exchange.step_penalty=3")
    assert evidence_module.apply_step_penalty(given, {"compressor": "topk"}) == []
    assert given.exchange.step_penalty == 3
    assert evidence_module.apply_step_penalty(presets.train_config(), {"compressor": "topk"}) == []
