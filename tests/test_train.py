"""End-to-end runs of the training entry point (subprocesses, as a user would run them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def train(tmp_path, *overrides, multirun=False, timeout=240, progress=False):
    cmd = [sys.executable, "-m", "gracecomm.experiments.training"]
    if multirun:
        cmd += ["-m", f"hydra.sweep.dir={tmp_path}/sweep"]
    else:
        cmd += [f"hydra.run.dir={tmp_path}/run"]
    cmd += [f"trainer.progress={str(progress).lower()}", *overrides]
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.slow
def test_default_experiment_end_to_end(tmp_path):
    proc = train(tmp_path, "trainer.max_steps=30", progress=True)  # as the README's command
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]  # nothing left behind at exit
    assert "test accuracy" in proc.stdout and "wire bytes / step" in proc.stdout
    assert "== compression bought 49.8x fewer bytes than dense allreduce" in proc.stdout
    assert "measured speedup" in proc.stdout
    recs = records(tmp_path / "run" / "metrics.jsonl")
    assert recs[0]["type"] == "config" and recs[0]["config"]["trainer"]["world_size"] == 2
    assert recs[0]["config"]["compressor"]["_target_"].endswith("TopK")  # it compresses
    steps = [r for r in recs if r["type"] == "step"]
    assert len(steps) == 30
    assert all(49 < s["dense_bytes"] / s["wire_bytes"] < 50 for s in steps)  # Top-1%
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 30 and 0 <= summary["test_acc"] <= 1


@pytest.mark.slow
def test_topk_run_logs_real_wire_bytes(tmp_path):
    proc = train(tmp_path, "compressor=topk", "compressor.ratio=0.05", "trainer.max_steps=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(tmp_path / "run" / "metrics.jsonl")
    assert recs[0]["config"]["communicator"]["_target_"].endswith("Allgather")
    step = next(r for r in recs if r["type"] == "step")
    # 8 bytes (fp32 value + int32 index) per kept element, k = max(1, floor(0.05 d)) per tensor
    sizes = [1 * 16 * 9, 16, 16 * 32 * 9, 32, 512 * 64, 64, 64 * 10, 10]
    assert step["wire_bytes"] == sum(8 * max(1, int(0.05 * d)) for d in sizes)
    assert step["dense_bytes"] == 4 * sum(sizes)


@pytest.mark.slow
def test_the_run_log_keeps_the_summary_and_the_refusal(tmp_path):
    """Hydra's job log of the run directory, ``train.log``, holds what the run printed at
    its end: the summary (rank 0's, written by the launcher), or the refusal."""
    proc = train(tmp_path / "ok", "trainer.max_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "ok" / "run" / "train.log").read_text()
    summary = proc.stdout[proc.stdout.index("== topk + residual memory"):].strip()
    assert summary.splitlines()[-1].startswith("== compression bought")
    assert summary in log and log.count("== compression bought") == 1
    proc = train(tmp_path / "bad", "compressor.ratio=1.5", timeout=60)
    assert proc.returncode == 1
    refusal = proc.stderr.strip().splitlines()[-1]
    assert "option 'ratio' must be in (0, 1]" in refusal
    assert refusal in (tmp_path / "bad" / "run" / "train.log").read_text()


def test_summary_says_what_compression_bought():
    """The last line: bytes against dense allreduce and the projected speedup on the slowest
    and fastest modelled networks; the measured speedup sets the mean step against the same
    step with a dense allreduce timed in the run instead of compression and communication."""
    from gracecomm.experiments.training.summary import bought, format_summary, measured_speedup

    s = {"compressor": "topk", "memory": "residual", "communicator": "allgather",
         "world_size": 2, "steps": 10, "metric": "test_acc", "metric_label": "test accuracy",
         "test_acc": 0.98, "wire_bytes_per_step": 100.0, "dense_bytes_per_step": 5000.0,
         "compression_factor": 50.0, "overhead_s_per_step": 0.001, "compress_s_per_step": 0.0,
         "decompress_s_per_step": 0.0, "memory_s_per_step": 0.0, "comm_s_per_step": 0.002,
         "step_s_per_step": 0.01, "speedup@0.1Gbps": 2.5, "speedup@10Gbps": 0.9}
    s.update(measured_speedup(s, dense_s=0.004))
    assert s["measured_speedup"] == pytest.approx((0.007 + 0.004) / 0.01)
    assert measured_speedup(s, dense_s=0.0) == {}  # one process: nothing to measure
    text = format_summary(s, "run")
    assert "measured speedup       1.10x on this run's network (vs a dense allreduce timed " \
        "in the run: 4.00 ms)" in text
    assert text.splitlines()[-1] == ("== compression bought 50.0x fewer bytes than dense "
                                     "allreduce; projected speedup 2.50x at 0.1Gbps, 0.90x at "
                                     "10Gbps")
    assert bought({**s, "compression_factor": 1.0}).startswith("== compression bought nothing")
    assert bought({**s, "compression_factor": 0.5}).startswith("== compression cost 2.0x more")


def test_summary_keeps_start_up_apart():
    """Per-step means exclude the first step of a process (start-up: kernels loading), which
    is reported on its own; a parameter server's downlink is summarised next to the uplink."""
    import torch

    from gracecomm.experiments.training.summary import (
        accumulate,
        format_summary,
        new_totals,
        summarize,
    )
    from gracecomm.network import networks

    totals = new_totals()
    first = {"dense_bytes": 1000, "wire_bytes": 20, "downlink_bytes": 1000, "step_s": 5.0,
             "compress_s": 4.0, "exchanges": 1, "coll_ps_pull_bytes": 1000,
             "coll_ps_pull_calls": 1}
    accumulate(totals, first, startup=True)
    for _ in range(4):
        accumulate(totals, {**first, "step_s": 0.01, "compress_s": 0.002}, startup=False)
    s = summarize(totals, 5, 1, torch.device("cpu"), networks([1.0], 50))
    assert s["step_s_per_step"] == pytest.approx(0.01) and s["steady_steps"] == 4
    assert s["compress_s_per_step"] == pytest.approx(0.002)
    assert (s["startup_steps"], s["startup_step_s"], s["startup_overhead_s"]) == (1, 5.0, 4.0)
    assert s["compression_factor"] == 50 and s["compression_factor_down"] == 1
    s.update(compressor="topk", memory="residual", communicator="parameter_server",
             world_size=2, steps=5, metric="test_acc", metric_label="test accuracy",
             test_acc=0.5)
    text = format_summary(s, "run")
    assert "uplink / step          20 B per rank (dense 1.0 KB, compression factor 50.0x)" in text
    assert "downlink / step        1.0 KB to every rank (compression factor 1.0x)" in text
    assert "means over steps 2-5; start-up (step 1) took 5.00 s, of it compression 4.00 s" \
        in text
    one = new_totals()  # a run of one step has nothing else to average
    accumulate(one, first, startup=True)
    s = summarize(one, 1, 1, torch.device("cpu"), networks([1.0], 50))
    assert s["step_s_per_step"] == 5.0 and s["startup_steps"] == 0


@pytest.mark.slow
def test_parameter_server_run_summarises_both_directions(tmp_path):
    proc = train(tmp_path, "compressor=topk", "communicator=parameter_server",
                 "trainer.max_steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # the server replies with the dense mean: every rank receives dense bytes
    assert summary["downlink_bytes_per_step"] == summary["dense_bytes_per_step"]
    assert summary["compression_factor_down"] == 1 and summary["compression_factor"] > 5
    assert summary["steady_steps"] == 5 and summary["startup_steps"] == 1
    assert "downlink / step" in proc.stdout and "start-up (step 1)" in proc.stdout


@pytest.mark.slow
def test_multirun_sweeps_compressors_and_wandb_offline(tmp_path):
    proc = train(tmp_path, "compressor=none,randomk", "logger=wandb", "trainer.max_steps=5",
                 multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((tmp_path / "sweep").glob("*_*/summary.json"))
    assert [json.loads(p.read_text())["compressor"] for p in runs] == ["none", "randomk"]
    assert list((tmp_path / "sweep").glob("*_*/wandb/offline-run-*")), "no offline W&B run"


@pytest.mark.parametrize("override,message", [
    ("compressor.ratio=1.5", "option 'ratio' must be in (0, 1]"),
    ("trainer.world_size=0", "option 'world_size' must be an integer in [1, inf)"),
    ("communicator=allreduce", "not summable"),
    # a config saved before the one import root
    ("compressor._target_=grace.compressors.topk.TopK",
     "the core moved to the import root gracecomm, use 'gracecomm.compressors.topk.TopK'"),
])
@pytest.mark.slow
def test_bad_config_fails_before_workers_start(tmp_path, override, message):
    proc = train(tmp_path, "compressor=topk", override, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no worker ever started


@pytest.mark.slow
def test_unknown_compressor_lists_choices(tmp_path):
    proc = train(tmp_path, "compressor=tpok", timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "unknown compressor 'tpok'. Did you mean 'topk'?" in lines[0]


@pytest.mark.slow
def test_step_exchange_matches_ddp_hook(tmp_path):
    losses = {}
    for mode in ("hook", "step"):
        proc = train(tmp_path / mode, "compressor=topk", f"trainer.exchange={mode}",
                     "trainer.max_steps=15")
        assert proc.returncode == 0, proc.stderr[-3000:]
        recs = records(tmp_path / mode / "run" / "metrics.jsonl")
        losses[mode] = [r["loss"] for r in recs if r["type"] == "step"]
    assert losses["hook"] == pytest.approx(losses["step"], rel=1e-5)
