"""The GPU readiness check (gracecomm.experiments.checks.gpucheck): its CPU mode end to end, the
host round trips its emulation finds, and the device code paths it keeps on the device."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import gracecomm
from gracecomm.compressors import sign
from gracecomm.compressors.deepreduce.codec import check_index_set
from gracecomm.compressors.randomk import random_subset
from gracecomm.compressors.shared import exceedance, stochastic
from gracecomm.experiments.checks import gpucheck
from gracecomm.experiments.checks.gpucheck_report import markdown, summary_line
from gracecomm.experiments.checks.hostwatch import SYNC_KINDS, HostWatch
from gracecomm.validation import ConfigError, PayloadError

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "gpucheck.yaml"


def watched(fn, *args, **kwargs):
    """fn(*args) with the tensors in args on an emulated device and the torch code paths
    forced, as a CUDA tensor would run it; returns (result, watch)."""
    watch = HostWatch(torch.device("cpu"), emulate=True)
    with stochastic.torch_paths(), watch:
        args = [watch.adopt(a.clone()) if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*args, **kwargs)
    return out, watch


def syncs(watch):
    return sum(watch.count(kind) for kind in SYNC_KINDS)


def test_no_cuda_is_a_message_and_exit_status_not_a_traceback(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit_info:
        gpucheck.resolve_device("cuda")
    assert exit_info.value.code == gpucheck.NO_DEVICE == 2
    out, err = capsys.readouterr()
    assert "no CUDA device is available" in err and "device=cpu" in err
    assert json.loads(out.strip().splitlines()[-1]) == {
        "device": "cuda", "ok": False, "error": err.split(". Run")[0].removeprefix("gpucheck: ")}


def test_device_option_is_checked():
    with pytest.raises(ConfigError, match="'device' must be"):
        gpucheck.resolve_device("gpu")
    with pytest.raises(ConfigError, match="'device' must be one of"):
        gpucheck.resolve_device("meta")


def job_config(*dotlist):
    """configs/gpucheck.yaml as the job sees it (no ``hydra`` node), with `dotlist` merged."""
    cfg = OmegaConf.load(CONFIG)
    del cfg["hydra"]
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(dotlist)))


def test_the_shipped_config_is_valid():
    gpucheck.validate(job_config())
    gpucheck.validate(job_config("device=cpu", "sizes=[65536]", "ddp.methods=[none]",
                                 "methods=[topk,sidco]", "budget_s=0"))


@pytest.mark.parametrize("override, option", [
    ("sizez=[1]", "unknown option 'sizez'. Did you mean 'sizes'"),
    ("tolerance.close=1", "unknown option 'tolerance.close'"),
    ("ddp.stepz=1", "unknown option 'ddp.stepz'"),
    ("tolerance=3", "'tolerance' is a section"),
    ("variants.topk.nonsense=3", "'variants.topk.nonsense' is not an option of compressor"),
    ("variants.topkk.ratio=0.1", "'variants' must be one of"),
    ("variants.topk.ratio=2", "'variants': topk[ratio=2] cannot be built"),
    ("short_schedule.nonsense=1", "'short_schedule' must be one of"),
    ("sizes=[0]", "'sizes[0]' must be an integer in [1, inf)"),
    ("sizes=[-5]", "'sizes[0]'"),
    ("sizes=[1.5]", "'sizes[0]' must be an integer"),
    ("ratio=0", "'ratio' must be in (0, 1]"),
    ("ratio=2", "'ratio' must be in (0, 1]"),
    ("repeats=0", "'repeats'"),
    ("warmup=-1", "'warmup'"),
    ("calls=0", "'calls'"),
    ("threads=0", "'threads'"),
    ("check_numel=0", "'check_numel'"),
    ("pipeline_steps=0", "'pipeline_steps'"),
    ("slow_call_s=0", "'slow_call_s'"),
    ("budget_s=-1", "'budget_s' must be a number in [0.0, inf)"),
    ("tolerance.close_fraction=-0.1", "'tolerance.close_fraction'"),
    ("tolerance.close_fraction=2", "'tolerance.close_fraction'"),
    ("tolerance.close_relative=-1e-5", "'tolerance.close_relative'"),
    ("tolerance.statistics=-0.05", "'tolerance.statistics'"),
    ("methods=[]", "'methods' is empty"),
    ("methods=topk", "'methods' must be a list"),
    ("sizes=5", "'sizes' must be a list"),
    ("ddp.methods=none", "'ddp.methods' must be a list"),
    ("methods=[topkk]", "'methods' must be one of"),
    ("device=tpu", "'device' must be cuda, cuda:N or cpu"),
    ("device=meta", "'device' must be one of"),
    ("ddp.methods=[nonsense]", "'ddp.methods' must be one of"),
    ("ddp.steps=0", "'ddp.steps'"),
    ("ddp.world_size=0", "'ddp.world_size'"),
    ("ddp.timeout_s=0", "'ddp.timeout_s'"),
    ("seed=-1", "'seed'"),
])
def test_every_bad_option_is_refused_before_any_check(override, option):
    """A value outside what configs/gpucheck.yaml allows is refused up front, naming the
    option (before the fix most of these ran and reported ``"ok": true``)."""
    with pytest.raises(ConfigError, match=re.escape(option)):
        gpucheck.validate(job_config(override))


def test_methods_are_every_registered_compressor_and_codec():
    cfg = OmegaConf.load(CONFIG)
    labels = [e.label for e in gpucheck.entries(cfg)]
    assert set(gracecomm.available("compressor")) <= set(labels)
    for kind in ("index", "value"):
        for codec in gracecomm.available(f"{kind}_codec"):
            assert f"deepreduce[{kind}={codec}]" in labels
    cfg.methods = ["topk", "deepreduce[index=bloom]"]
    assert [e.overrides for e in gpucheck.entries(cfg)] == [
        ("compressor=topk",), ("compressor=deepreduce", "compressor/index=bloom")]
    cfg.methods = ["topkk"]
    with pytest.raises(ConfigError, match="topkk"):
        gpucheck.entries(cfg)


def test_hostwatch_emulation_finds_each_kind_of_round_trip():
    watch = HostWatch(torch.device("cpu"), emulate=True)
    with watch:
        x = watch.adopt(torch.randn(1000))
        a = x.abs()
        int(a.argmax())                                   # scalar
        idx = torch.nonzero(a > 1).view(-1)               # shape
        a[a > 2]                                          # shape: a bool mask as index
        a[a > 2] = 0.0                                    # a masked fill: no sync
        placed = torch.zeros(1000, device=x.device)       # device= taken from a tensor
        placed.scatter_(0, idx, a.index_select(0, idx))
        host = torch.zeros(1000)                          # made on the host ...
        host.add_(a)                                      # ... and mixed into device work
        a.numpy()
        a.cpu()                                           # to_host: 1000 elements
        torch.arange(10).to(x.device)                     # to_device: 10 elements
    assert (watch.count("scalar"), watch.count("shape"), watch.count("numpy"),
            watch.count("host_tensor"), watch.count("to_host"), watch.count("to_device")) == (
        1, 2, 1, 1, 1, 1)
    assert watch.copied == {("", "to_host"): 1000, ("", "to_device"): 10}
    assert watch.on_device(placed) and watch.on_device(a) and not watch.on_device(host)


def test_torch_paths_switch_every_automatic_kernel_choice():
    x = torch.randn(exceedance.NUMBA_MIN_NUMEL)
    assert stochastic.kernels_enabled(x.device) and exceedance.use_numba("auto", x)
    with stochastic.torch_paths():
        assert not stochastic.kernels_enabled(x.device)
        assert not exceedance.use_numba("auto", x) and not exceedance.use_numba_top_k("auto", x)
        assert exceedance.use_numba("numba", x)  # asked for by name
    assert stochastic.kernels_enabled(x.device)


def test_top_k_on_the_device_path_reads_nothing_back():
    """Exact Top-k (ties to the lowest index) without a host sync, the kernels' bits."""
    x = torch.randn(70_000).round(decimals=1)  # many ties at the k-th magnitude
    for k in (1, 700, 69_999):
        (indices, values), watch = watched(exceedance.top_k, x, k, "torch")
        want_i, want_v = exceedance.top_k(x, k, "numba")
        assert torch.equal(indices, want_i) and torch.equal(values, want_v)
        assert syncs(watch) == 0 and watch.on_device(indices)
    candidates = torch.arange(0, 70_000, 3)
    chosen, watch = watched(exceedance.top_k_of, x, candidates, 100, "torch")
    assert torch.equal(chosen, exceedance.top_k_of(x, candidates, 100, "numba"))
    assert syncs(watch) == 0


def test_moments_on_the_device_path_read_one_row():
    x = torch.randn(300_000)
    x[::7] = 0.0
    got, watch = watched(exceedance.moments, x, 0.5, "torch", logs=True)
    want = exceedance.moments(x, 0.5, "numba", logs=True)
    assert got.count == want.count
    assert got.s1 == pytest.approx(want.s1, rel=1e-12)
    assert got.s2 == pytest.approx(want.s2, rel=1e-12)
    assert got.log_sum == pytest.approx(want.log_sum, rel=1e-12)
    assert (watch.count("scalar"), watch.count("shape")) == (1, 0)
    bad = x.clone()
    bad[3] = float("nan")  # NaN is an exceedance and reaches the sums
    assert not exceedance.moments(bad, 0.5, "torch").finite


@pytest.mark.parametrize("d,k", [(100_000, 1000), (1000, 900), (50, 50)])
def test_random_subset_on_the_device_path_reads_one_number(d, k):
    key = 12345
    got, watch = watched(random_subset, d, k, key, torch.device("cpu"))
    assert torch.equal(got, random_subset(d, k, key, torch.device("cpu")))  # the kernel's
    assert syncs(watch) <= 1


def test_sign_stats_and_sum_on_the_device_path():
    x = torch.randn(10_001)
    (plane, stats), watch = watched(sign.sign_plane, x, stats=True)
    want_plane, want = sign.sign_plane(x, stats=True)
    assert torch.equal(plane, want_plane) and stats.negatives == want.negatives
    assert stats.abs_sum == pytest.approx(want.abs_sum, rel=1e-12)
    assert syncs(watch) == 1
    onebit = gracecomm.create("compressor", "onebit")
    payload, ctx = onebit.compress(x, "x")
    total, watch = watched(onebit.aggregate, [payload, payload], ctx)
    assert torch.equal(total, onebit.aggregate([payload, payload], ctx))
    assert syncs(watch) == 0


def test_index_checks_on_the_device_path_read_once():
    indices = torch.tensor([1, 5, 9, 20])
    _, watch = watched(check_index_set, indices, 21, "codec")
    assert syncs(watch) == 1 and watch.count("numpy") == 0
    for bad, message in ((torch.tensor([1, 5, 21]), "outside"),
                         (torch.tensor([1, 9, 5]), "ascending")):
        with stochastic.torch_paths(), pytest.raises(PayloadError, match=message):
            check_index_set(bad, 21, "codec")


def test_compare_levels():
    tol = OmegaConf.create({"close_fraction": 1e-3, "close_relative": 1e-5, "statistics": 0.05})
    x = torch.randn(10_000)
    ref = torch.where(x.abs() > 1, x, 0.0)
    assert gpucheck.level(gpucheck.compare(x, ref, ref.clone()), tol) == "identical"
    swapped = ref.clone()
    swapped[0] = 0.5 if swapped[0] == 0 else 0.0  # one element of 10000
    assert gpucheck.level(gpucheck.compare(x, ref, swapped), tol) == "close"
    ulps = ref * (1 + 1e-7)
    assert gpucheck.level(gpucheck.compare(x, ref, ulps), tol) == "close"
    other = torch.where(x.abs() > 1.001, x, 0.0)  # about 0.1% of the kept differ
    other[:50] = ref[:50] + 0.01  # 0.5% of the elements
    assert gpucheck.level(gpucheck.compare(x, ref, other), tol) == "statistics"
    assert gpucheck.level(gpucheck.compare(x, ref, torch.zeros_like(x)), tol) == "differs"


@pytest.mark.slow
def test_cpu_mode_lists_every_method_and_passes(tmp_path):
    """``gracecomm-gpucheck device=cpu``, small: every registered compressor and codec runs
    its torch code paths bit-identically to the CPU path, on the (emulated) device; the DDP
    hook trains over Gloo; the report and the last JSON line say so."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gracecomm.experiments.checks.gpucheck", "device=cpu",
         "sizes=[65536]", "check_numel=131089", "calls=1", "pipeline_steps=2", "repeats=1",
         "warmup=0", "ddp.methods=[none]", "ddp.steps=3", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["device"] == "cpu" and line["ok"] is True
    methods = line["compressors"]
    assert set(gracecomm.available("compressor")) <= set(methods)
    assert {f"deepreduce[index={c}]" for c in gracecomm.available("index_codec")} <= set(methods)
    for label, rec in methods.items():
        assert rec["agree"] == "identical" and rec["on_device"] and rec["ok"], label
    assert methods["topk"]["x_read"]["65536"] > 0 and methods["topk"]["vs_topk"]["65536"] > 0
    assert line["ddp"] == {"backend": "gloo", "ok": True, "runs": {
        "none": {"ok": True, "steps": 3, "loss_last": line["ddp"]["runs"]["none"]["loss_last"]}}}
    report = json.loads((run_dir / "gpucheck.json").read_text())
    assert report["methods"]["topk"]["syncs"]["compress"] == 0  # exact Top-k without a sync
    assert "PASSED" in (run_dir / "gpucheck.md").read_text()


@pytest.mark.slow
def test_a_bad_option_ends_the_command_with_one_line(tmp_path):
    """The command refuses a bad option with one line on stderr and exit status 1, before
    any check runs (no report is written)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gracecomm.experiments.checks.gpucheck", "device=cpu",
         "+sizez=[1]", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "gracecomm.validation.ConfigError: gpucheck: unknown option 'sizez'. Did you mean "
        "'sizes'? The options are device, methods, check_numel, calls, pipeline_steps, sizes, "
        "ratio, repeats, warmup, slow_call_s, budget_s, threads, tolerance, seed, "
        "short_schedule, variants, ddp"]
    assert not (run_dir / "gpucheck.json").exists()


@pytest.mark.slow
def test_a_method_that_cannot_run_is_listed_with_its_reason(tmp_path, monkeypatch):
    """One broken method does not stop the others; the report says what went wrong."""
    cfg = OmegaConf.load(CONFIG)
    del cfg["hydra"]
    cfg.update({"device": "cpu", "sizes": [4096], "check_numel": 5000, "calls": 1,
                "pipeline_steps": 1, "repeats": 1, "warmup": 0,
                "methods": ["topk", "topk[ratio=2.0]", "signsgd"]})
    cfg.variants["topk"] = {"ratio": 2.0}
    cfg.ddp.methods = []

    def no_device(self, tensor, name):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(sign.SignCompressor, "compress", no_device)
    report = gpucheck.run_checks(cfg, tmp_path, log=lambda line: None)
    methods = report["methods"]
    assert methods["topk"]["ok"] and methods["topk"]["agree"] == "identical"
    bad = methods["topk[ratio=2.0]"]
    assert bad["agree"] == "cannot build" and not bad["ok"]
    assert "ratio" in bad["reason"]
    assert methods["signsgd"]["agree"] == "cannot run" and not methods["signsgd"]["ok"]
    assert "no kernel for this device" in methods["signsgd"]["reason"]
    assert report["ok"] is False
    line = summary_line(report)
    assert line["compressors"]["signsgd"]["agree"] == "cannot run" and line["ok"] is False
    assert "cannot run" in markdown(report, "gracecomm-gpucheck device=cpu")
