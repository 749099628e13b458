"""The library inside the training stacks people use: Lightning (`GraceStrategy`),
Accelerate (`gracecomm.accelerate.register_comm_hook`), the Hugging Face Trainer
(`GraceTrainer`) and the public (state, hook) pair, each trained on 2 CPU processes by a
client script in tests/frameworks/ started with torchrun, as their users start them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gracecomm
from gracecomm import ConfigError, GradientExchange, build, comm_hook
from gracecomm.experiments.training.launch import torchrun_standalone
from gracecomm.frameworks import (
    MetricsWindow,
    gather_state,
    load_state_file,
    logged_metrics,
    restore_state,
    save_state_file,
)
from tests.helpers import free_port, run_ranks, same

SCRIPTS = Path(__file__).resolve().parent / "frameworks"
ROOT = SCRIPTS.parent.parent


def launch(script: str, out: Path, *scenarios: str, processes: int = 2,
           timeout: float = 240) -> None:
    """Run tests/frameworks/`script` on `processes` CPU processes (torchrun; one process:
    plain python, no launcher), every scenario in turn."""
    out.mkdir(parents=True, exist_ok=True)
    launcher = (torchrun_standalone(processes, out / "torchelastic") if processes > 1
                else [sys.executable])
    proc = subprocess.run([*launcher, str(SCRIPTS / script), str(out), *scenarios], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:  # pytest.fail shows the text whole; an assertion's repr is cut
        pytest.fail(f"{script} {' '.join(scenarios)} exited {proc.returncode}\n"
                    f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-6000:]}")


def launch_nodes(script: str, out: Path, *scenarios: str, nodes: int = 2, per_node: int = 2,
                 timeout: float = 300) -> None:
    """Run tests/frameworks/`script` on `nodes` torchrun agents of `per_node` CPU processes
    each, one per node as on separate machines (``--nnodes``, ``--node-rank``: the ranks'
    ``GROUP_RANK`` tells their node), meeting at a store on 127.0.0.1."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
         f"--node-rank={node}", f"--nproc-per-node={per_node}", "--master-addr=127.0.0.1",
         f"--master-port={port}", f"--log-dir={out / f'torchelastic{node}'}",
         str(SCRIPTS / script), str(out), *scenarios], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for node in range(nodes)]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    failed = [(node, proc.returncode) for node, proc in enumerate(procs) if proc.returncode]
    if failed:
        pytest.fail(f"{script} {' '.join(scenarios)} on {nodes} nodes: {failed} exited; node "
                    f"{failed[0][0]} said:\n{outputs[failed[0][0]][-6000:]}")


def result(out: Path, name: str, rank: int = 0) -> dict:
    return torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)  # our own files


def trained(out: Path, name: str) -> torch.Tensor:
    """The final parameters of scenario `name`, checked equal on both ranks."""
    first, second = result(out, name, 0), result(out, name, 1)
    assert torch.equal(first["params"], second["params"]), f"{name}: ranks differ"
    assert first["error"] is None, first["error"]
    return first["params"]


def falls(losses: list[float]) -> bool:
    """The mean loss of the last 8 steps is under 60% of the first 8's."""
    return sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8


def refused_before_first_step(out: Path, name: str, *needles: str) -> None:
    for rank in (0, 1):
        run = result(out, name, rank)
        assert run["error"] is not None and all(n in run["error"] for n in needles), run["error"]
        assert torch.equal(run["params"], run["initial"]), f"{name}: a step was taken"


# -- the (state, hook) pair, the scaler, checkpoint state: one process ---------------------

def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


@pytest.mark.parametrize("closure", [False, True])
def test_the_pair_refuses_a_step_the_hook_did_not_see(closure):
    """A framework that skips the hook (or runs no DDP): the first optimizer step over the
    model raises before updating it, also where the step runs backward in its closure
    (Lightning's); another model's optimizer is not concerned."""
    model, other = mlp(), mlp()
    state, hook = comm_hook(build("topk"), model)
    assert hook is gracecomm.ddp.grace_hook and isinstance(state, GradientExchange)
    before = nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)

    def backward() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(torch.randn(4, 8)).sum() + other(torch.randn(4, 8)).sum()
        loss.backward()
        return loss

    if not closure:
        backward()
    with pytest.raises(ConfigError, match="hook has not run.*GraceStrategy.*register_comm_hook"):
        optimizer.step(backward) if closure else optimizer.step()
    assert torch.equal(nn.utils.parameters_to_vector(model.parameters()), before)
    other_optimizer.step()  # not the model's


def pair_on_ddp(rank: int, world_size: int) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state, hook = comm_hook(build({"name": "topk", "ratio": 0.5}), model, optimizer)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(state, hook)

    def backward() -> torch.Tensor:
        optimizer.zero_grad()
        loss = ddp(torch.randn(4, 8)).square().mean()
        loss.backward()
        return loss

    optimizer.step(backward)  # the closure's backward runs the hook: no error
    assert state.hook_calls > 0 and state.expecting is None
    backward()
    optimizer.step()
    assert state.grace.metrics.pop()["wire_bytes"] > 0


@pytest.mark.slow
def test_the_pair_registered_on_ddp_trains():
    run_ranks(pair_on_ddp, 2, timeout_s=120)


def test_a_hook_on_a_model_that_is_not_ddp_is_refused():
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model.*uncompressed"):
        gracecomm.register_comm_hook(mlp(), build("topk"))


def test_the_scaler_alone_passes_overflows_through():
    grace = build("topk")
    assert grace.check_finite
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradientExchange(grace, mlp(), scaler=torch.amp.GradScaler("cpu"))
    assert not grace.check_finite
    with pytest.raises(ConfigError, match="scaler must be a torch.amp.GradScaler"):
        GradientExchange(build("topk"), mlp(), scaler=object())


def test_passing_nonfinite_steps_without_the_scaler_is_warned_about():
    with pytest.warns(UserWarning, match="no scaler.*scaler=scaler.*loss-scaled"):
        GradientExchange(build("topk", check_finite=False), mlp())


def test_compression_state_round_trips_through_a_checkpoint_file(tmp_path):
    grace = build({"name": "topk", "ratio": 0.1})
    for step in range(3):
        grace.step(torch.randn(100, generator=torch.Generator().manual_seed(step)), "w")
    save_state_file(grace, tmp_path)
    saved = torch.load(tmp_path / "gracecomm.pt", weights_only=True)
    assert saved["world_size"] == 1 and saved["ranks"][0].dtype == torch.uint8
    fresh = build({"name": "topk", "ratio": 0.1})
    load_state_file(fresh, tmp_path, torch.device("cpu"))
    assert same(fresh.state_dict(), grace.state_dict())
    assert same(gather_state(fresh), saved)
    with pytest.raises(ConfigError, match="compression state of 2 ranks, this run has 1"):
        restore_state(fresh, {**saved, "world_size": 2}, torch.device("cpu"), "here")
    with pytest.warns(UserWarning, match="holds no gracecomm compression state"):
        load_state_file(fresh, tmp_path / "elsewhere", torch.device("cpu"))


class Evil:
    """Unpickling it would run a command (a crafted checkpoint)."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def stepped_topk():
    grace = build({"name": "topk", "ratio": 0.1})
    for step in range(2):
        grace.step(torch.randn(100, generator=torch.Generator().manual_seed(step)), "w")
    return grace


def state_bytes(value) -> torch.Tensor:
    import io
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("change, words", [
    (lambda s: [1, 2], ["is not of format 1"]),
    (lambda s: {**s, "format": 7}, ["is not of format 1"]),
    (lambda s: {**s, "world_size": "1"}, ["'world_size' is '1'", "positive integer"]),
    (lambda s: {**s, "world_size": True}, ["'world_size' is True"]),
    (lambda s: {**s, "world_size": 0}, ["'world_size' is 0"]),
    (lambda s: {k: v for k, v in s.items() if k != "ranks"}, ["'ranks' must be 1 uint8"]),
    (lambda s: {**s, "ranks": []}, ["'ranks' must be 1 uint8"]),
    (lambda s: {**s, "ranks": [torch.zeros(3)]}, ["'ranks' must be 1 uint8"]),
    (lambda s: {**s, "ranks": "abc"}, ["'ranks' must be 1 uint8"]),
    (lambda s: {**s, "ranks": [s["ranks"][0][:40]]}, ["rank 0's gracecomm state",
                                                      "not a readable torch file"]),
    (lambda s: {**s, "ranks": [state_bytes([1, 2])]}, ["rank 0's gracecomm state is a list"]),
    (lambda s: {**s, "ranks": [state_bytes({"compressor": 3})]},
     ["rank 0's gracecomm state does not fit this pipeline"]),
    (lambda s: {**s, "ranks": [state_bytes({"x": Evil()})]},
     ["rank 0's gracecomm state is refused", "tensors and plain Python values"]),
    (lambda s: {**s, "parts": "compressor 'powersgd', memory 'powersgd', communicator "
                "'allreduce'"},
     ["holds the compression state of compressor 'powersgd'", "compresses with compressor "
      "'topk'"]),
])
def test_a_malformed_state_file_is_refused_naming_it(tmp_path, change, words):
    """Every malformed ``gracecomm.pt`` is a `ConfigError` naming the file and what is wrong
    (before the fix: IndexError, AttributeError, torch's unpickling text, "state of 1 ranks,
    this run has 1" for ``world_size: "1"``, another method's state loaded silently); the
    pipeline's state is left as it was."""
    save_state_file(stepped_topk(), tmp_path)
    path = tmp_path / "gracecomm.pt"
    torch.save(change(torch.load(path, weights_only=True)), path)
    fresh = build({"name": "topk", "ratio": 0.1})
    before = fresh.state_dict()
    with pytest.raises(ConfigError) as info:
        load_state_file(fresh, tmp_path, torch.device("cpu"))
    for word in [f"compression state file {path}", *words]:
        assert word in str(info.value), str(info.value)
    assert "Please file an issue" not in str(info.value)
    assert same(fresh.state_dict(), before)


def test_another_methods_state_is_refused_with_both_names(tmp_path):
    save_state_file(stepped_topk(), tmp_path)
    with pytest.raises(ConfigError, match=r"compressor 'topk', memory 'residual'.*but this run "
                       r"compresses with compressor 'randomk'"):
        load_state_file(build({"name": "randomk", "ratio": 0.1}), tmp_path, torch.device("cpu"))


@pytest.mark.parametrize("content", [b"", b"not a torch file", None])
def test_a_state_file_that_is_not_a_torch_file_or_a_crafted_pickle_is_named(tmp_path, content):
    path = tmp_path / "gracecomm.pt"
    if content is None:
        torch.save({"format": 1, "x": Evil()}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"compression state file {path} is"):
        load_state_file(build("topk"), tmp_path, torch.device("cpu"))


def test_logged_figures_per_step_and_their_means():
    step = {"wire_bytes": 100.0, "dense_bytes": 500.0, "compress_s": 0.1, "decompress_s": 0.2,
            "memory_s": 0.3, "comm_s": 0.5}
    assert logged_metrics(step) == pytest.approx({
        "gracecomm/wire_bytes": 100.0, "gracecomm/dense_bytes": 500.0,
        "gracecomm/compression_factor": 5.0, "gracecomm/compression_s": 0.6,
        "gracecomm/comm_s": 0.5, "gracecomm/nonfinite_steps": 0.0})
    window = MetricsWindow()
    window.add(step)
    window.add({**step, "wire_bytes": 300.0, "nonfinite_steps": 1.0})
    means = window.means()
    assert means["gracecomm/wire_bytes"] == 200.0 and means["gracecomm/nonfinite_steps"] == 0.5
    assert means["gracecomm/compression_factor"] == 2.5 and window.means() == {}


# -- Lightning ---------------------------------------------------------------------------

def test_grace_strategy_takes_build_specs_and_every_ddp_keyword():
    pytest.importorskip("lightning")
    from gracecomm.lightning import GraceStrategy

    strategy = GraceStrategy({"name": "topk", "ratio": 0.1}, process_group_backend="gloo",
                             timeout=timedelta(seconds=60), start_method="spawn",
                             find_unused_parameters=True, bucket_cap_mb=1)
    assert repr(strategy.grace) == ("Grace(compressor='topk', memory='residual', "
                                    "communicator='allgather')")
    assert strategy.process_group_backend == "gloo"
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 1}
    assert strategy._timeout == timedelta(seconds=60) and strategy._start_method == "spawn"
    assert GraceStrategy(build("fp16")).grace.compressor.registry_name == "fp16"
    with pytest.raises(ConfigError, match="takes no ddp_comm_hook"):
        GraceStrategy("topk", ddp_comm_hook=gracecomm.ddp.grace_hook)
    with pytest.raises(ConfigError, match="unknown compressor .tpok"):
        GraceStrategy("tpok")


@pytest.mark.slow
def test_without_lightning_the_module_names_the_extra():
    code = ("import sys; sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
            "import gracecomm.lightning")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert "MissingDependencyError" in proc.stderr
    assert "pip install 'gracecomm[lightning]'" in proc.stderr


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning")
    launch("lightning_run.py", out, "topk", "plain", "fp16", "torch_fp16")
    return out


@pytest.fixture(scope="module")
def lightning_more(tmp_path_factory):
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning_more")
    launch("lightning_run.py", out, "resume", "dgc_momentum", "dgc", "skipped", "amp")
    return out


@pytest.mark.slow
def test_lightning_strategy_trains_with_compressed_exchange(lightning_runs):
    """The issue's target: ``GraceStrategy({"name": "topk", "ratio": 0.1},
    process_group_backend="gloo")`` on 2 CPU processes: the parameters differ from plain
    DDPStrategy's, both ranks agree bit for bit, the loss falls, and the bytes and timings
    reach Lightning's logger every step."""
    assert not torch.equal(trained(lightning_runs, "topk"), trained(lightning_runs, "plain"))
    assert falls(result(lightning_runs, "topk")["losses"])
    import csv

    with open(lightning_runs / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 32  # 2 epochs of 16 steps, one record each
    # Top-10%: per tensor k values (fp32) and k indices (int32) of 16*32+32+32*4+4 elements
    assert {float(r["gracecomm/wire_bytes"]) for r in rows} == {8 * (51 + 3 + 12 + 1)}
    assert {float(r["gracecomm/dense_bytes"]) for r in rows} == {4 * 676}
    assert float(rows[0]["gracecomm/compression_factor"]) == pytest.approx(2704 / 536)
    assert all(float(r["gracecomm/compression_s"]) > 0 for r in rows)


@pytest.mark.slow
def test_lightning_fp16_is_bit_identical_to_pytorchs_hook(lightning_runs):
    assert torch.equal(trained(lightning_runs, "fp16"), trained(lightning_runs, "torch_fp16"))
    assert not torch.equal(trained(lightning_runs, "fp16"), trained(lightning_runs, "plain"))


@pytest.mark.slow
def test_lightning_checkpoints_carry_the_compression_state(lightning_runs, lightning_more):
    """One epoch, ``trainer.save_checkpoint``, the second epoch resumed from it: the same
    parameters as both epochs in one fit; without the compression state they differ."""
    full = trained(lightning_runs, "topk")
    assert torch.equal(trained(lightning_more, "resume"), full)
    assert not torch.equal(trained(lightning_more, "resume_without_state"), full)
    saved = torch.load(lightning_more / "half.ckpt", weights_only=True)["gracecomm"]
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2


@pytest.mark.slow
def test_lightning_refuses_dgc_with_a_momentum_optimizer_before_the_first_step(lightning_more):
    refused_before_first_step(lightning_more, "dgc_momentum", "memory 'dgc' applies the "
                              "momentum itself", "momentum=0.9", "SGD(params, lr, momentum=0")
    dgc = result(lightning_more, "dgc")  # without momentum it trains
    assert not torch.equal(trained(lightning_more, "dgc"), dgc["initial"])
    assert sum(dgc["losses"][-8:]) < sum(dgc["losses"][:8])


@pytest.mark.slow
def test_lightning_skips_comm_hooks_on_cpu_and_the_pair_says_so(lightning_more):
    """Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers the hook
    only on CUDA (which `GraceStrategy` works around by registering in ``setup``): the pair
    raises at the first step instead of training uncompressed. If Lightning starts
    registering comm hooks on CPU, this fails: the run then trains."""
    refused_before_first_step(lightning_more, "skipped", "hook has not run",
                              "gracecomm.lightning.GraceStrategy")


@pytest.mark.slow
def test_lightning_mixed_precision_needs_no_argument(lightning_more):
    """fp16 autocast with a GradScaler (Lightning's MixedPrecision plugin) overflowing at
    first: the strategy hands the scaler to the hook, whose pipeline then passes overflow
    steps through, and the run trains."""
    import csv

    amp = result(lightning_more, "amp")
    assert amp["error"] is None and amp["check_finite"] is False
    with open(lightning_more / "csv_amp" / "version_0" / "metrics.csv") as f:
        skipped = [float(r["gracecomm/nonfinite_steps"]) for r in csv.DictReader(f)]
    assert 0 < sum(skipped) < 16, skipped
    assert falls(amp["losses"]) and all(math.isfinite(x) for x in amp["losses"])


# -- Accelerate --------------------------------------------------------------------------

@pytest.mark.slow
def test_accelerate_after_prepare(tmp_path):
    pytest.importorskip("accelerate")
    launch("accelerate_run.py", tmp_path, "topk", "none", "fp16", "torch_fp16", "resume")
    topk = trained(tmp_path, "topk")
    assert not torch.equal(topk, trained(tmp_path, "none"))
    assert falls(result(tmp_path, "topk")["losses"])
    logged = result(tmp_path, "topk")["logged"]
    assert len(logged) == 32 and logged[0]["gracecomm/wire_bytes"] == 536
    assert torch.equal(trained(tmp_path, "fp16"), trained(tmp_path, "torch_fp16"))
    # save_state after epoch 1, load_state, epoch 2: as both epochs in one run
    assert (tmp_path / "half_state" / "gracecomm.pt").exists()
    assert torch.equal(trained(tmp_path, "resume"), topk)
    assert not torch.equal(trained(tmp_path, "resume_without_state"), topk)


# -- the Hugging Face Trainer ------------------------------------------------------------

@pytest.mark.slow
def test_hf_trainer_subclass(tmp_path):
    pytest.importorskip("transformers")
    launch("hf_run.py", tmp_path, "topk", "plain", "resume", "dgc_momentum")
    topk = trained(tmp_path, "topk")
    assert not torch.equal(topk, trained(tmp_path, "plain"))
    logs = [h for h in result(tmp_path, "topk")["history"] if "loss" in h]
    assert logs[-1]["loss"] < 0.6 * logs[0]["loss"]
    assert all(h["gracecomm/wire_bytes"] == 536 and h["gracecomm/compression_s"] > 0
               for h in logs)
    assert (tmp_path / "topk_out" / "checkpoint-16" / "gracecomm.pt").exists()
    refused_before_first_step(tmp_path, "dgc_momentum", "memory 'dgc' applies the momentum")
    cannot = result(tmp_path, "resume")["cannot_resume"]
    if cannot:  # transformers 4.x loads the optimizer with map_location="cpu:0"
        pytest.skip(cannot[:300])
    assert torch.equal(trained(tmp_path, "resume"), topk)
    assert not torch.equal(trained(tmp_path, "resume_without_state"), topk)


# -- two levels: the same option in each framework ------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("package", "script"), [
    ("lightning", "lightning_run.py"), ("accelerate", "accelerate_run.py"),
    ("transformers", "hf_run.py")])
def test_two_level_exchange_on_two_nodes_of_two_ranks(tmp_path, package, script):
    """``hierarchy="node"`` given to `GraceStrategy`, `register_comm_hook` or `GraceTrainer`
    on 2 nodes of 2 ranks (a torchrun agent per node): the four ranks end equal and the loss
    falls; each rank's compression state records the two-level layout; each rank compresses
    only the tensors it owns, so that at every logged step a node's two ranks together send
    one Top-10% payload of the model (536 bytes, as one rank sends flat)."""
    pytest.importorskip(package)
    launch_nodes(script, tmp_path, "topk_node")
    runs = [result(tmp_path, "topk_node", rank) for rank in range(4)]
    for rank, run in enumerate(runs):
        assert run["error"] is None, run["error"]
        assert torch.equal(run["params"], runs[0]["params"]), f"rank {rank} differs"
        assert run["state"]["layout"] == {"hierarchy": "node", "nodes": 2,
                                          "ranks_per_node": 2}
        assert run["wire"] and all(0 < w < 536 for w in run["wire"]), run["wire"]
    if "losses" in runs[0]:
        assert falls(runs[0]["losses"])
    else:  # the Trainer's logged losses
        logs = [h for h in runs[0]["history"] if "loss" in h]
        assert logs[-1]["loss"] < 0.6 * logs[0]["loss"]
    for first, second in ((0, 1), (2, 3)):
        sums = [a + b for a, b in zip(runs[first]["wire"], runs[second]["wire"], strict=True)]
        assert sums == pytest.approx([536.0] * len(sums)), sums


def test_grace_trainer_refuses_what_it_can_when_constructed(tmp_path):
    """Before `train` starts Accelerate and the workers' machinery, so that the refusal is
    the first error a user sees: a given optimizer with the momentum DGC's memory applies,
    and arguments that run one process (the Trainer would not wrap the model in DDP)."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from gracecomm.hf import GraceTrainer

    model = mlp()
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ConfigError, match="memory 'dgc' applies the momentum"):
        GraceTrainer(model=model, args=args, optimizers=(momentum, None), grace="dgc")
    with pytest.raises(ConfigError, match="will not wrap the model.*not_parallel.*torchrun"):
        GraceTrainer(model=model, args=args, grace={"name": "topk", "ratio": 0.1})


@pytest.mark.slow
@pytest.mark.parametrize(("package", "script", "who", "how"), [
    ("accelerate", "accelerate_run.py", "Accelerate did not", "--multi_gpu"),
    ("transformers", "hf_run.py", "Trainer will not", "torchrun")])
def test_one_process_says_how_to_start_several(tmp_path, package, script, who, how):
    """Without a launcher the framework wraps nothing: refused before any update (the
    Trainer's when it is constructed, from its arguments)."""
    pytest.importorskip(package)
    launch(script, tmp_path, "one_process", processes=1)
    run = result(tmp_path, "one_process")
    assert f"{who} wrap the model in DistributedDataParallel" in run["error"]
    assert how in run["error"] and torch.equal(run["params"], run["initial"])
