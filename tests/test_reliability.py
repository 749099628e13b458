"""Reliability: bit-identical resume of every method family, dead and hung peers, ranks
started with different set-ups. Each failure mode must end with a clear error in bounded
time, never a hang or silent corruption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gracecomm.experiments.training import checkpoint
from gracecomm.experiments.training.worker import train_worker
from tests.helpers import compose_train, free_port, run_ranks
from tests.reliability import long_run, train_cmd, wait_gone, workers_of

ROOT = Path(__file__).resolve().parent.parent

# One method of every family, with phases and schedules short enough to cross a boundary
# inside the first 12 steps (the interruption is at step 7).
FAMILIES = {
    "topk_residual": ["compressor=topk"],
    "randomk": ["compressor=randomk", "memory=none"],
    "sidco_adaptive": ["compressor=sidco", "compressor.ratio=0.01", "compressor.adapt.interval=2"],
    "dgc_momentum": ["compressor=dgc", "compressor.ratio=0.01", "compressor.warmup_epochs=2"],
    "natural": ["compressor=natural"],
    "qsgd": ["compressor=qsgd"],
    "powersgd": ["compressor=powersgd"],
    "efsignsgd": ["compressor=efsignsgd"],
    "deepreduce_bloom_p2": ["compressor=deepreduce", "compressor/index=bloom",
                            "compressor.index.policy=p2", "compressor/value=polyfit"],
    "lgc_rar": ["compressor=lgc_rar", "compressor.ratio=0.01", "compressor.warmup_iters=3",
                "compressor.ae_train_iters=3"],
    "lgc_ps": ["compressor=lgc_ps", "compressor.ratio=0.01", "compressor.warmup_iters=3",
               "compressor.ae_train_iters=3"],
}
STOP, END = 7, 30  # digits: 23 steps per epoch, so the resumed run crosses an epoch end


def tensors_equal(a, b, path=""):
    """Nested state dicts are equal bit for bit (tensors with torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            tensors_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            tensors_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), path  # NaN == NaN here


def run_three_ways(rank, world_size, cfg_dict, root):
    """Uninterrupted to END; stopped at STOP; resumed from STOP to END. Same processes."""
    def run(name, max_steps, resume=None):
        cfg = dict(cfg_dict, trainer=dict(cfg_dict["trainer"], max_steps=max_steps,
                                          checkpoint_every=max_steps, resume=resume,
                                          progress=False, checkpoint_dir=f"{root}/{name}"))
        train_worker(rank, world_size, cfg, f"{root}/{name}_run", None)
        folder = f"{root}/{name}"
        entry = checkpoint.manifest(folder, world_size, [rank])["ranks"][rank]
        return torch.load(f"{folder}/{entry['file']}", weights_only=True)

    full = run("full", END)
    run("first", STOP)
    resumed = run("resumed", END, resume=f"{root}/first")
    assert resumed["position"] == full["position"]
    for key in ("model", "optimizer", "grace", "rng"):
        tensors_equal(full[key], resumed[key], key)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_resume_is_bit_identical(family, tmp_path):
    cfg = compose_train(*FAMILIES[family])
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    run_ranks(run_three_ways, 2, cfg_dict, str(tmp_path), timeout_s=240)


def resume_cli(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "gracecomm.experiments.training", f"hydra.run.dir={tmp_path}/run",
         "trainer.progress=false", *overrides], cwd=ROOT, capture_output=True, text=True,
        timeout=180)


@pytest.mark.slow
def test_resume_refuses_missing_or_foreign_checkpoints(tmp_path):
    proc = resume_cli(tmp_path, f"trainer.resume={tmp_path}/nothing")
    assert proc.returncode != 0 and "holds no complete checkpoint" in proc.stderr
    first = resume_cli(tmp_path / "a", "compressor=topk", "trainer.max_steps=3",
                       "trainer.checkpoint_every=3")
    assert first.returncode == 0, first.stderr[-2000:]
    other = resume_cli(tmp_path / "b", "compressor=randomk", "trainer.max_steps=6",
                       f"trainer.resume={tmp_path}/a/run/checkpoints")
    assert other.returncode != 0
    assert "compressor._target_ is 'gracecomm.compressors.randomk.RandomK' here" in other.stderr


# -- dead and hung peers -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_dead_or_hung_peer_ends_the_run_with_an_error(tmp_path, fault):
    timeout_s = 8
    with long_run(tmp_path, "compressor=topk", f"trainer.collective_timeout_s={timeout_s}") as proc:
        os.kill(workers_of(proc.pid)[1], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        _, err = proc.communicate(timeout=timeout_s + 60)
    assert proc.returncode != 0
    assert time.monotonic() - start < timeout_s + 60
    if fault == "kill":
        assert "worker rank 1 of 2 was killed by signal SIGKILL" in err, err[-2000:]
    else:
        assert "worker rank 1 of 2 did not answer within the collective timeout" in err, \
            err[-2000:]


# starts the command after it with SIGINT ignored, as a shell starts a background job
IGNORING_SIGINT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
                   "signal.SIG_IGN); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_alone_ends_its_workers(tmp_path, sig):
    """SIGINT or SIGTERM to the launcher's process only (not its group, as `kill` sends
    it): its workers are gone within 10 s and it says why, in the run log too; also where
    it inherited SIGINT ignored (a shell's background job), where its workers used to
    train on until killed."""
    run = tmp_path / "run"
    cmd = [*IGNORING_SIGINT, *train_cmd(run, "trainer.epochs=1000")[1:]]
    with long_run(run, cmd=cmd) as proc:
        workers = workers_of(proc.pid)
        assert len(workers) == 2, workers
        os.kill(proc.pid, sig)
        took = wait_gone(workers, 10)
        _, err = proc.communicate(timeout=60)
    assert took <= 10, f"workers outlived {sig.name} to the launcher by {took:.1f} s"
    assert proc.returncode == 128 + sig, err[-2000:]
    assert f"interrupted ({sig.name}): the workers were stopped" in err, err[-2000:]
    assert f"interrupted ({sig.name})" in (run / "train.log").read_text()


def wait_forever_in_rank_1(rank, world_size):
    import torch.distributed as dist
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def sleep_past_the_deadline(rank, world_size):
    time.sleep(3600)


@pytest.mark.slow
def test_hung_local_worker_is_named_with_its_stack():
    from gracecomm.experiments.training.launch import WorkerError, spawn
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(wait_forever_in_rank_1, 2, timeout_s=90, collective_timeout_s=10)
    message = str(info.value)
    assert time.monotonic() - start < 60
    assert "worker rank 1 of 2 did not answer within the collective timeout" in message
    assert "Stacks of rank 1, still running" in message
    assert "in wait_forever_in_rank_1" in message.split("Stacks of rank 1")[1], message


@pytest.mark.slow
def test_workers_past_the_deadline_show_their_stacks():
    from gracecomm.experiments.training.launch import WorkerTimeoutError, spawn
    with pytest.raises(WorkerTimeoutError) as info:
        spawn(sleep_past_the_deadline, 2, timeout_s=15)
    message = str(info.value)
    for rank in (0, 1):
        assert f"Stacks of rank {rank}, still running" in message, message
    assert "in sleep_past_the_deadline" in message


# -- ranks that disagree ------------------------------------------------------------------

def launch_rank(rank, port, tmp_path, *overrides):
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen(
        [sys.executable, "-m", "gracecomm.experiments.training",
         f"hydra.run.dir={tmp_path}/rank{rank}",
         "trainer.progress=false", "trainer.max_steps=3", "trainer.collective_timeout_s=30",
         *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


@pytest.mark.slow
@pytest.mark.parametrize("override,part", [("compressor.ratio=0.02", "compressor"),
                                           ("model.hidden=32", "parameters")])
def test_ranks_with_different_setups_are_refused(tmp_path, override, part):
    port = free_port()
    procs = [launch_rank(0, port, tmp_path, "compressor=topk"),
             launch_rank(1, port, tmp_path, "compressor=topk", override)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    for p, err in zip(procs, errs):
        assert p.returncode != 0
        assert "ranks were started with different set-ups" in err, err[-1500:]
        assert f"'{part}'" in err, err[-1500:]


def check_consistency(rank, world_size):
    from gracecomm.experiments.training.consistency import verify_same_on_all_ranks
    from gracecomm.validation import ConfigError
    verify_same_on_all_ranks({"a": "same", "b": "same"})
    with pytest.raises(ConfigError, match=r"'b' differs between ranks \(rank 0: x; rank 1: y"):
        verify_same_on_all_ranks({"a": "same", "b": "x" if rank == 0 else "y"})


@pytest.mark.slow
def test_consistency_check_names_the_differing_part():
    run_ranks(check_consistency, 2)


# -- long runs ----------------------------------------------------------------------------

@pytest.mark.slow
def test_compression_state_does_not_grow(tmp_path):
    proc = resume_cli(tmp_path, "compressor=topk", "trainer.epochs=6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines() if '"type": "eval"' in line]
    sizes = {e["state_bytes"] for e in evals}
    assert len(evals) == 6 and len(sizes) == 1 and sizes.pop() > 0


KEPT = []  # alive until the process exits, as a module's own temporary directory is


def open_temporary_directory(rank, world_size, out):
    import tempfile
    KEPT.append(tempfile.TemporaryDirectory(prefix="gracecomm-test-"))
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(KEPT[-1].name)


@pytest.mark.slow
def test_workers_remove_their_temporary_directories(tmp_path):
    """Workers end with os._exit, which skips the finalizers that remove temporary
    directories: the launcher's exit removes them first."""
    run_ranks(open_temporary_directory, 2, str(tmp_path))
    names = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert all(name and not os.path.exists(name) for name in names), names
