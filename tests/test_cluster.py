"""The emulated cluster (experiments/cluster/emulation.py) and netbench's topology=cluster: bad
input refused before any namespace exists, a clear message without root or iproute2, and nothing
left behind (namespaces, links, processes) after a run, after SIGKILL of a rank and after
Ctrl-C of the launcher (root and iproute2 needed for those, skipped otherwise)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gracecomm.experiments.cluster import emulation
from gracecomm.experiments.cluster.emulation import (
    PREFIX,
    ClusterError,
    EmulatedCluster,
    Link,
    capacity,
)
from gracecomm.experiments.cluster.netbench import last_line, plan, time_to_target
from gracecomm.experiments.reports.tables import Run
from gracecomm.validation import ConfigError

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "netbench.yaml"
ROOT = os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "tc"))
needs_root = pytest.mark.skipif(not ROOT, reason="needs root and iproute2 (ip, tc)")


def config(**options):
    cfg = OmegaConf.load(CONFIG)
    cfg.pop("hydra")
    return OmegaConf.merge(cfg, {"topology": "cluster"}, options)


def root_links() -> set[str]:
    """The links of the root namespace."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in links.splitlines()}


def left_behind(links_before: set[str], run_dir: Path, launcher: int) -> dict[str, list]:
    """What a run left that it did not find: its launcher's namespaces, new root links, the
    processes of its run directory. Other clusters (a benchmark beside the suite) may come
    and go meanwhile; only this launcher's namespaces count."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = f"{PREFIX}{launcher}-"
    return {"namespaces": sorted(n for n in (line.split()[0] for line in netns.splitlines())
                                 if n.startswith(mine)),
            "links": sorted(root_links() - links_before),
            "processes": sorted(pid for pid, _ in processes(str(run_dir)))}


NOTHING: dict[str, list] = {"namespaces": [], "links": [], "processes": []}


def processes(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd and str(os.getpid()) != entry.name:
                found.append((int(entry.name), cmd))
    return found


@pytest.mark.parametrize("options,message", [
    ({"world_size": 100000}, r"this machine holds at most \d+"),
    ({"world_size": 1}, "world_size"),
    ({"bandwidth_mbps": 0}, "bandwidth_mbps"),
    ({"methods": ["ddp", "topkk"]}, r"names \['topkk'\]"),
    ({"jitter_ms": 5}, "jitter_ms"),
    ({"ranks_per_node": 0}, "ranks_per_node"),
    ({"accuracy": {"target_accuracy": 1.5}}, "target_accuracy"),
    ({"topology": "ring"}, "topology"),
])
def test_bad_input_is_refused_before_any_namespace(options, message):
    with pytest.raises(ConfigError, match=message):
        plan(config(**options))


def test_capacity_names_its_limit(monkeypatch):
    monkeypatch.setattr(emulation, "memory_available_mb", lambda: 3000.0)
    most, reason = capacity(1)
    assert most == 3000 // (emulation.RANK_MB + emulation.AGENT_MB) and "memory" in reason


def test_without_root_it_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root"), EmulatedCluster(2, Link(100)):
        pass


def test_netem_options_and_node_cpus():
    assert Link(100).netem == []
    assert Link(100, 5, 1, 0.5).netem == ["delay", "5ms", "1ms", "loss", "0.5%"]
    c = EmulatedCluster(4, Link(100), ranks_per_node=2)
    cpus = sorted(os.sched_getaffinity(0))
    assert c.cpus(0) == sorted({cpus[0], cpus[1 % len(cpus)]})
    cmd = c.node_command(3, ["-m", "x"], Path("run/nodes"))
    assert cmd[:4] == ["ip", "netns", "exec", c.namespaces[3]] and "--node-rank=3" in cmd
    assert f"--master-addr={c.addresses[0]}" in cmd and "--nnodes=4" in cmd
    assert "--log-dir=run/nodes/torchelastic3" in cmd  # not a torchelastic_* in /tmp


def test_a_missed_target_is_reported_as_such():
    evals = [{"step": 10, "train_time_s": 1.0, "test_acc": 0.5},
             {"step": 20, "train_time_s": 2.0, "test_acc": 0.7}]
    run = Run(Path("."), {}, {"metric": "test_acc", "steps": 20},
              [{"step_s": 0.1}] * 20, evals)
    missed = time_to_target(run, 0.9, warmup=5)
    assert (missed["reached_target"], missed["time_to_target_s"],
            missed["steps_to_target"], missed["final_accuracy"]) == (False, 2.0, 20, 0.7)
    hit = time_to_target(run, 0.6, warmup=5)
    assert (hit["reached_target"], hit["time_to_target_s"], hit["steps_to_target"]) == (
        True, 2.0, 20)
    assert time_to_target(run, 0.5, warmup=5)["time_to_target_s"] == 1.0


def test_last_line_keeps_the_schema_and_adds_accuracy_fields():
    row = {"method": "ddp", "step_s": 0.1, "dense_step_s": 0.1, "measured_speedup": 1.0,
           "projected_speedup": 1.0, "time_to_target_s": 3.0, "target_accuracy": 0.9,
           "final_accuracy": 0.95, "reached_target": True, "steps_to_target": 30,
           "tta_speedup": 1.0, "curve": []}
    result = {"bandwidth_mbps": 10.0, "topology": "cluster", "world_size": 4,
              "goal": "accuracy", "runs": [row]}
    line = last_line(result)
    assert list(line) == ["bandwidth_mbps", "topology", "world_size", "runs"]
    assert "curve" not in line["runs"][0] and line["runs"][0]["reached_target"] is True
    text = json.dumps(line)
    assert "null" not in text and "Infinity" not in text and "NaN" not in text
    step = last_line({**result, "goal": "step"})["runs"][0]
    assert set(step) == {"method", "step_s", "dense_step_s", "measured_speedup",
                         "projected_speedup"}


def netbench(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gracecomm.experiments.cluster.netbench",
                             "topology=cluster", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="as root, the tools are what is missing")
def test_without_iproute2_it_says_so_and_makes_nothing(tmp_path):
    links = root_links() if ROOT else set()
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # python, no ip or tc
    proc = netbench("methods=[ddp]", f"hydra.run.dir={tmp_path}", env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "iproute2" in err, err[-2000:]
    if ROOT:
        assert left_behind(links, tmp_path, proc.pid) == NOTHING


def wait_for_training(run_dir: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until rank 0 has logged a training step (every rank is then in the step loop)."""
    deadline = time.monotonic() + timeout_s
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"netbench ended early: {proc.communicate()[1][-3000:]}")
        if metrics.exists() and '"type": "step"' in metrics.read_text():
            return
        time.sleep(0.5)
    raise AssertionError("no training step within the time allowed")


# long enough for a signal after the first step (about 5 ms a step), short enough that the
# single-rank compute run before the cluster (as many steps) takes seconds
LONG_RUN = ("methods=[ddp]", "also_sync=false", "rounds=1", "warmup_steps=0", "steps=5000",
            "world_size=2", "bandwidth_mbps=1000", "timeout_s=600",
            'overrides=["model=mlp","data=digits"]')


@pytest.mark.slow
@pytest.mark.timeout(600)
@needs_root
def test_sigkill_of_a_rank_ends_the_run_and_leaves_nothing(tmp_path):
    links = root_links()
    proc = netbench(*LONG_RUN, f"hydra.run.dir={tmp_path}")
    try:
        wait_for_training(tmp_path / "ddp.0", proc, 300)
        workers = [pid for pid, cmd in processes(str(tmp_path / "ddp.0"))
                   if "torch.distributed.run" not in cmd
                   and "gracecomm.experiments.training" in cmd]
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGKILL)  # the later-started rank: not the store's host
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and "failed with exit code" in err, err[-3000:]
    assert left_behind(links, tmp_path, proc.pid) == NOTHING


@pytest.mark.slow
@pytest.mark.timeout(600)
@needs_root
def test_ctrl_c_of_the_launcher_leaves_nothing(tmp_path):
    links = root_links()
    proc = netbench(*LONG_RUN, f"hydra.run.dir={tmp_path}", start_new_session=True)
    try:
        wait_for_training(tmp_path / "ddp.0", proc, 300)
        # how the launcher holds signals (blocked, ignored, caught), for the message below
        held = [line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the launcher's group
        sent = time.monotonic()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = (tmp_path / "ddp.0" / "metrics.jsonl").read_text().count('"type": "step"')
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, (
        f"exit {proc.returncode} {time.monotonic() - sent:.1f} s after SIGINT, {steps} steps "
        f"logged; the launcher's signals when sent: {held}; stderr: {err[-2000:]}; "
        f"stdout: {out[-2000:]}")
    assert left_behind(links, tmp_path, proc.pid) == NOTHING
