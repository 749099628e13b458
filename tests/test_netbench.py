"""The shaped-link benchmark: its plan and table, a real run in a private network namespace
(root and iproute2 needed, skipped otherwise) and its refusal without the tools."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gracecomm.experiments.cluster.emulation import cluster_network
from gracecomm.experiments.cluster.netbench import (
    format_table,
    median_round,
    per_step,
    plan,
    said,
    setup_steps,
    variant_of,
)
from gracecomm.experiments.cluster.topologies import NAMESPACE_PREFIX, hosts_rate
from gracecomm.hierarchy import HIERARCHIES
from gracecomm.strategy import STRATEGIES
from gracecomm.validation import ConfigError

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "netbench.yaml"
ROOT = os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "tc"))


def config(**options):
    cfg = OmegaConf.load(CONFIG)
    cfg.pop("hydra")
    return OmegaConf.merge(cfg, options)


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(NAMESPACE_PREFIX)]


def test_plan_puts_the_baseline_first_and_sync_variants_after_their_method():
    runs = plan(config(methods=["topk", "ddp", "torch_fp16"]))
    assert [name for name, _ in runs] == ["ddp", "topk", "topk_sync", "torch_fp16"]  # PyTorch's
    assert dict(runs)["topk"][-2:] == ["+method=topk", "trainer.world_size=2"]  # hooks: no twin


def test_each_method_runs_once_per_hierarchy_the_node_run_named_for_it():
    runs = plan(config(topology="cluster", methods=["topk", "torch_fp16"],
                       hierarchies=["flat", "node"]))
    # PyTorch's own exchange (plain DDP, its hooks) is flat: no node run
    assert [name for name, _ in runs] == ["ddp", "topk", "topk@node", "topk_sync",
                                          "topk_sync@node", "torch_fp16"]
    by = dict(runs)
    assert by["topk@node"] == [*by["topk"], "exchange.hierarchy=node"]  # flat: the default
    assert not any("hierarchy" in o for o in by["topk"])
    assert [variant_of(name, HIERARCHIES) for name in by] == ["flat", "flat", "node", "flat",
                                                              "node", "flat"]


def test_each_method_runs_once_per_strategy_and_hierarchy():
    runs = plan(config(topology="cluster", methods=["topk", "ddp"], also_sync=False,
                       hierarchies=["flat", "node"], strategies=["fixed", "auto"]))
    # plain DDP is PyTorch's exchange: neither two-level nor chosen per tensor
    assert [name for name, _ in runs] == ["ddp", "topk", "topk@auto", "topk@node",
                                          "topk@node@auto"]
    by = dict(runs)
    assert by["topk@node@auto"] == [*by["topk"], "exchange.hierarchy=node",
                                    "exchange.strategy=auto"]
    assert [(variant_of(n, HIERARCHIES), variant_of(n, STRATEGIES)) for n in by] == [
        ("flat", "fixed"), ("flat", "fixed"), ("flat", "auto"), ("node", "fixed"),
        ("node", "auto")]


def test_link_bytes_per_step_leave_out_the_setup_run():
    cfg = config(warmup_steps=5)
    assert per_step(1_000_000, 400_000, 35, cfg) == pytest.approx(600_000 / 30)
    assert per_step(None, 400_000, 35, cfg) is None  # a topology that does not count
    assert per_step(1_000_000, 400_000, 5, cfg) is None  # no step beyond the setup run's
    assert setup_steps(config(warmup_steps=0)) == 1


def test_accuracy_rounds_report_each_runs_median_round():
    rows = [{"time_to_target_s": t, "steps_to_target": s, "reached_target": True, "curve": c}
            for t, s, c in ((12.0, 95, "a"), (10.0, 85, "b"), (11.0, 90, "c"), (13.0, 99, "d"))]
    median = median_round(rows[:3])
    assert median["curve"] == "c" and median["steps_to_target"] == 90  # one run's row
    assert [r["time_to_target_s"] for r in median["rounds"]] == [12.0, 10.0, 11.0]
    assert median_round(rows)["curve"] == "c"  # of four, the faster middle one
    assert median_round(rows[:1]) == rows[0]  # one round: no rounds listed


def test_accuracy_rounds_give_every_method_the_same_seeds(monkeypatch, tmp_path):
    """Round r trains every method with its seed plus r: the median compares like with
    like over initialisations and data orders."""
    from types import SimpleNamespace

    from gracecomm.experiments.cluster import netbench as nb

    trained: list[tuple[str, str]] = []

    class Topology:
        ranks, counts_links = 4, False

        def train(self, overrides, run_dir, timeout_s):
            trained.append((run_dir.name, [o for o in overrides if o.startswith("seed=")][-1]))

    monkeypatch.setattr(nb, "finished", lambda run_dir: SimpleNamespace(steps=[{}], summary={}))
    monkeypatch.setattr(nb, "time_to_target", lambda run, target, warmup: {
        "step_records": [], "time_to_target_s": 1.0, "steps_to_target": 5,
        "reached_target": True, "final_accuracy": 0.95})
    monkeypatch.setattr(nb, "summarise", lambda *args: {})
    rows = nb.measure_accuracy(config(accuracy={"rounds": 2}), Topology(),
                               [("ddp", ["seed=3"]), ("topk", [])], None, 0.9, tmp_path)
    assert trained == [("ddp.0", "seed=3"), ("topk.0", "seed=0"),
                       ("ddp.1", "seed=4"), ("topk.1", "seed=1")]
    assert [len(row["rounds"]) for row in rows] == [2, 2]


@pytest.mark.parametrize("inside", [True, False])
def test_the_hosts_rate_is_what_the_allreduce_leaves_unexplained(inside):
    """An allreduce timed as the model prices it with a hosts' rate gives that rate back,
    inside a node (the loopback: no link rate) as across nodes; one the latency and the link
    explain gives none."""
    link = cluster_network(10, 1200.0, ranks_per_node=2)
    net, ranks = (link.intra_node, 2) if inside else (link, 8)
    seconds = replace(net, host_gbps=2.5).time("allreduce", 2**20, ranks)
    assert hosts_rate(net, ranks, 2**20, seconds) == pytest.approx(2.5)
    assert hosts_rate(net, ranks, 2**20, net.time("allreduce", 2**20, ranks)) is None


def test_an_error_says_netbench_once():
    assert said(ConfigError("netbench: option 'rounds' must be")) == (
        "netbench: option 'rounds' must be")
    assert said(ConfigError("cluster: option 'jitter_ms'")) == (
        "netbench: cluster: option 'jitter_ms'")


@pytest.mark.parametrize("options,message", [
    ({"hierarchies": ["flat", "nodes"]}, "'hierarchies' must be one of 'flat', 'node'; got"),
    ({"hierarchies": []}, "'hierarchies' must list distinct hierarchies of flat, node"),
    ({"hierarchies": ["node", "node"]}, "'hierarchies' must list distinct"),
    ({"hierarchies": ["flat", "node"]}, "'hierarchies' may hold node only with topology=cluster"),
    ({"overrides": ["exchange.hierarchy=node"]}, "'overrides' sets exchange.hierarchy"),
    ({"strategies": ["auto", "best"]}, "'strategies' must be one of 'fixed', 'auto'; got"),
    ({"overrides": ["exchange.strategy=auto"]}, "'overrides' sets exchange.strategy"),
    ({"methods": ["ddp", "topkk"]}, r"'methods' names \['topkk'\], which are not method presets"),
    ({"rounds": 0}, "rounds"),
    ({"accuracy": {"rounds": 0}}, r"'accuracy.rounds' must be an integer in \[1, inf\)"),
    ({"bandwidth_mbps": 0}, "bandwidth_mbps"),
    ({"world_size": 1}, "world_size"),
    ({"topology": "cluster", "world_size": 0}, r"'world_size' must be an integer in \[2, inf\)"),
    ({"topology": "cluster", "world_size": 1}, r"'world_size' must be an integer in \[2, inf\)"),
    ({"topology": "cluster", "world_size": 65}, "this machine holds at most"),
    ({"bandwidth_mbps": float("inf")}, r"'bandwidth_mbps' must be a number in \(0.0, inf\)"),
    ({"topology": "cluster", "bandwidth_mbps": float("inf")}, "'bandwidth_mbps'"),
    ({"latency_ms": float("inf")}, "'latency_ms'"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ConfigError, match=message):
        plan(config(**options))


def test_a_run_without_its_own_exchange_timing_shows_no_projection():
    row = {"method": "ddp", "step_s": 0.2, "round_step_s": [0.19, 0.21], "dense_step_s": 0.2,
           "measured_speedup": 1.0, "projected_speedup": 1.0, "projected_step_s": 0.4,
           "comm_timed": False, "wire_bytes": 1.0e6, "compute_s": 0.2}
    timed = {**row, "method": "topk", "comm_timed": True, "projected_step_s": 0.03,
             "compute_s": 0.025}
    table = format_table({"bandwidth_mbps": 100, "topology": "loopback",
                          "runs": [row, timed]}).splitlines()
    assert table[2].split()[:3] == ["ddp", "200.0", "190.0-210.0"] and "400.0" not in table[2]
    assert table[2].split()[6:8] == ["-", "-"]  # no projected step, no compute of its own
    assert table[3].split()[6:8] == ["30.0", "25.0"]


def netbench(*args: str, env: dict[str, str] | None = None
             ) -> tuple[subprocess.CompletedProcess, str]:
    """Run netbench; its result and the name its namespace has while it lives (the
    namespaces of benchmarks run beside it, by other tests, are theirs)."""
    with subprocess.Popen([sys.executable, "-m", "gracecomm.experiments.cluster.netbench",
                           *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return (subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
            f"{NAMESPACE_PREFIX}{proc.pid}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not ROOT, reason="needs root and iproute2 (ip, tc) for a network namespace")
def test_a_shaped_run_prints_its_json_and_removes_its_namespace(tmp_path):
    proc, own = netbench("bandwidth_mbps=200", "methods=[ddp,topk]", "also_sync=false", "steps=3",
                    "warmup_steps=1", "rounds=2", "overrides=[]", "world_size=2",
                    f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bandwidth_mbps"] == 200
    assert [r["method"] for r in result["runs"]] == ["ddp", "topk"]
    for run in result["runs"]:
        assert {"step_s", "dense_step_s", "measured_speedup", "projected_speedup"} <= set(run)
    assert result["runs"][0]["measured_speedup"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and p.name[0] != ".") == [
        "alone", "ddp.0", "ddp.1", "topk.0", "topk.1"]  # the methods ran in turn, twice
    assert own not in namespaces()


@pytest.mark.slow
@pytest.mark.parametrize("option", ["world_size=0", "bandwidth_mbps=inf"])
def test_a_bad_cluster_option_is_one_line_before_any_run(tmp_path, option):
    """Refused before the compute run or any namespace: one line naming the option."""
    proc, _ = netbench("topology=cluster", option, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"'{option.split('=')[0]}' must be" in lines[0], lines
    assert lines[0].count("netbench:") == 1, lines
    assert not (tmp_path / "alone").exists()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="as root, the tools are what is missing")
def test_without_iproute2_it_says_so_and_makes_no_namespace(tmp_path):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # python, but no ip or tc
    proc, own = netbench(f"hydra.run.dir={tmp_path}", env=env)
    assert proc.returncode == 2 and "iproute2" in proc.stderr, proc.stderr[-2000:]
    assert own not in namespaces()


def readme_examples() -> list[list[str]]:
    """The overrides of every `gracecomm-netbench ...` command in the README and on the
    benchmarks page of the docs."""
    import shlex
    root = CONFIG.parent.parent
    text = "\n".join((root / page).read_text() for page in ("README.md", "docs/benchmarks.md"))
    return [shlex.split(line.split("#")[0])[1:] for line in text.splitlines()
            if line.startswith("gracecomm-netbench")]


@pytest.mark.parametrize("overrides", readme_examples(), ids=lambda o: " ".join(o) or "defaults")
def test_readme_examples_compose_and_plan(overrides):
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base="1.3"):
        cfg = compose(config_name="netbench", overrides=overrides)
    assert plan(cfg)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_signal_during_the_compute_run_leaves_no_process(tmp_path, sig):
    """SIGTERM or SIGKILL to netbench while its single-rank compute run (a torchrun agent
    and its rank) trains, before any cluster exists: the agent and the rank end too
    (before the fix both lived on)."""
    import signal
    import time
    proc = subprocess.Popen(
        [sys.executable, "-m", "gracecomm.experiments.cluster.netbench", "methods=[ddp]",
         "also_sync=false", "steps=100000", "warmup_steps=0", "overrides=[]",
         f"hydra.run.dir={tmp_path}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        below: set[int] = set()
        while time.monotonic() < deadline and not (tmp_path / "alone" / "metrics.jsonl").exists():
            assert proc.poll() is None, "netbench ended before its compute run trained"
            time.sleep(0.5)
        below = descendants(proc.pid)
        assert len(below) >= 2, "no torchrun agent and rank found"  # agent, rank (and more)
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(alive(p) for p in below):
            time.sleep(0.5)
        left = [p for p in below if alive(p)]
        assert not left, f"left running after {sig}: " + "; ".join(
            Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:200] for p in left)
    finally:
        for pid in descendants(proc.pid) | below:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()
        proc.wait()
