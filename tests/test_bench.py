"""The benchmark entry point runs and writes its records."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gracecomm.experiments.bench import PeakMemory
from gracecomm.experiments.bench.compressors import GradientStream, quality_band, synthetic

ROOT = Path(__file__).resolve().parent.parent
MEASURABLE = PeakMemory().available


def bench(tmp_path, *overrides):
    proc = subprocess.run(
        [sys.executable, "-m", "gracecomm.experiments.bench", f"hydra.run.dir={tmp_path}",
         "repeats=1", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads((tmp_path / "bench.json").read_text())


@pytest.mark.slow
def test_compressors_suite_runs(tmp_path):
    methods = "[topk,randomk,none,dgc,sidco_gp,redsync,gaussiank]"  # presets, registry names
    proc, records = bench(tmp_path, "sizes=[4096]", "distributions=[laplace,student_t]",
                          "ratios=[0.01]", f"methods={methods}", "steps=4",
                          "gradients=[{model:mlp,data:digits}]", "capture.warmup_steps=1")
    names = {"topk", "randomk", "none", "dgc", "sidco_gp", "redsync", "gaussiank"}
    assert {(r["method"], r["dist"]) for r in records} == {
        (m, d) for m in names for d in ("laplace", "student_t", "grad:MLP")}
    topk = next(r for r in records if r["method"] == "topk")
    assert topk["payload_bytes"] == 8 * 40 and topk["quality"] == 1.0
    assert topk["read_s"] > 0 and topk["topk_s"] > 0
    for rec in records:
        if rec["method"] not in ("randomk", "none"):
            assert rec["quality_p5"] <= rec["quality"] <= rec["quality_p95"], rec
            assert rec["numel"] == 4096 and rec["payload_bytes"] > 0
    sidco = next(r for r in records if r["method"] == "sidco_gp")
    assert sidco["stages"] >= 1 and sidco["quality_first"] > 0
    assert "topk_speedup" in proc.stdout and "quality_first" in proc.stdout
    for rec in records:  # whole cost, receive side and memory are reported
        assert rec["x_read_total"] >= rec["x_read"] and "topk_speedup_total" in rec
        assert (rec["receive_x_read"] != rec["receive_x_read"]) == (rec["method"] in ("randomk",
                                                                                      "none"))
        # peak memory is measured wherever the platform can (Linux's VmHWM), never left out
        for key in ("mem_compress_x", "mem_decompress_x", "topk_mem_x")[:3 if rec["ratio"] else 2]:
            assert math.isnan(rec[key]) != MEASURABLE, (key, rec)
            assert not MEASURABLE or rec[key] >= 0, (key, rec)
        assert rec["step_x_read"] > 0  # a whole pipeline step with the default memory


def test_gradient_stream_concatenates_training_steps():
    stream = GradientStream("mlp", "digits", seed=0, warmup_steps=1, residual_ratio=0.01)
    assert stream.numel == 64 * 128 + 128 + 128 * 10 + 10
    first = stream.take(25_000)  # three steps of 9,610 parameters
    assert first.shape == (25_000,) and len(stream.history) == 3
    second = stream.take(25_000)  # one new step, the oldest dropped
    assert torch.equal(second[:25_000 - stream.numel], first[stream.numel:])
    # the captured vector is g + e: what Top-k did not send is carried over
    assert float(stream.residual.abs().sum()) > 0


def test_synthetic_sources_and_quality_band():
    t = synthetic("student_t:3", 100_000, 0)
    assert t.dtype == torch.float32 and 1.4 < float(t.var()) < 4.0  # var 3 (heavy tails)
    assert torch.equal(t, synthetic("student_t", 100_000, 0))
    band = quality_band([5.0, 5.0, 1.0, 0.9, 1.1, 1.0])  # the second half only
    assert band["quality"] == 1.0 and band["quality_p5"] < 1.0 < band["quality_p95"]


@pytest.mark.slow
def test_hook_suite_runs_two_ranks_and_names_bad_methods(tmp_path):
    """Plain DDP, this library's hook and PyTorch's fp16 hook on 2 Gloo ranks; each record
    is set against plain DDP (and PyTorch's hook where the method has one)."""
    proc, records = bench(tmp_path, "suite=hook", "+hook.methods=[ddp,dense,fp16,torch_fp16]",
                          "+hook.steps=2", "+hook.rounds=1", "+hook.warmup_steps=1",
                          "+hook.timeout_s=100")
    by = {r["method"]: r for r in records}
    assert list(by) == ["ddp", "dense", "fp16", "torch_fp16"]
    assert by["ddp"]["over_ddp_ms"] == 0.0 and all(r["cpu_ms"] > 0 for r in records)
    assert "over_torch_ms" in by["fp16"] and "over_torch_ms" not in by["torch_fp16"]
    assert by["dense"]["over_torch_ms"] == by["dense"]["over_ddp_ms"]  # ddp: dense by PyTorch
    assert "over_ddp_ms" in proc.stdout  # the suite's own columns, not the compressors'
    bad = subprocess.run(
        [sys.executable, "-m", "gracecomm.experiments.bench", f"hydra.run.dir={tmp_path}/bad",
         "suite=hook", "+hook.methods=[ddp,topkk]"], cwd=ROOT, capture_output=True, text=True,
        timeout=120)
    assert bad.returncode != 0 and "'hook.methods' names ['topkk']" in bad.stderr
