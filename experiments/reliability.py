"""The reliability suite: replays, as a new user or an attacker would, the ways a run can go
wrong (hostile configs, failing, hung and killed ranks, killed launchers, torn and edited
checkpoints, non-deterministic resume, runs started at once) and prints one line per case
and the count of cases tried and cases that went wrong.

    python -m gracecomm.experiments.reliability                   # every case
    python -m gracecomm.experiments.reliability -k checkpoint     # cases whose name has it
    python -m gracecomm.experiments.reliability --trials 13       # more trials of timed faults
    python -m gracecomm.experiments.reliability --repeat 10       # the whole suite 10 times

A case is one function registered with ``@case("group")``: it gets a fresh directory,
raises (an `AssertionError` with what went wrong) when the behaviour is wrong, and returns a
short note of what it measured when it is right. Adding a case is adding a function.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CaseFn = Callable[[Path], str]
FAULT_S = 5.0  # the target: a failure reaches the user, named, within this many seconds
ESCAPES = ("gracecomm.experiments.checkpoint.torch.load", "torch.nn.modules.module.torch.load",
           "gracecomm.experiments.train.os.system")


@dataclass
class Case:
    group: str
    name: str
    fn: CaseFn
    slow: bool  # starts training runs (seconds each); the rest run in this process


CASES: list[Case] = []
OPTIONS = {"trials": 2}


def case(group: str, *, slow: bool = False) -> Callable[[CaseFn], CaseFn]:
    """Register a case of `group`; its name is the function's name."""

    def decorator(fn: CaseFn) -> CaseFn:
        CASES.append(Case(group, fn.__name__, fn, slow))
        return fn

    return decorator


# -- running training as a user does -----------------------------------------------------

ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def train_cmd(run_dir: Path | str | None, *overrides: str) -> list[str]:
    """The training command (in `run_dir` when given, else in Hydra's default directory)."""
    where = [f"hydra.run.dir={run_dir}"] if run_dir is not None else []
    return [sys.executable, "-m", "gracecomm.experiments.train", *where,
            "trainer.progress=false", *overrides]


def train(run_dir: Path | str | None, *overrides: str, cwd: Path | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """One training run on the command line; its exit code and output."""
    return subprocess.run(train_cmd(run_dir, *overrides), cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def workers_of(pid: int) -> list[int]:
    """Process ids of the local workers a launcher started (oldest first)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                found.append((int(fields[19]), int(entry.name)))
    return [p for _, p in sorted(found)]


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def long_run(run_dir: Path, *overrides: str, session: bool = False,
             cmd: list[str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """A run that trains until stopped; yields once it has logged steps. Everything it
    started is killed on exit."""
    cmd = cmd or train_cmd(run_dir, "trainer.epochs=1000", *overrides)
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=session)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count('"type": "step"') >= 2):
            seen.update(descendants(proc.pid))
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"training did not start: {proc.communicate()[1][-1500:]}")
            time.sleep(0.1)
        seen.update(descendants(proc.pid))
        yield proc
    finally:
        for pid in [proc.pid, *seen]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def describe(pids: list[int]) -> str:
    """What the live processes among `pids` are and where each thread waits (for the
    message of a case that found them still alive)."""
    out = []
    for pid in filter(alive, pids):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[-70:]
            waits = sorted({(Path(t) / "wchan").read_text() for t in
                            Path(f"/proc/{pid}/task").iterdir()})
            out.append(f"pid {pid} ({cmd.decode(errors='replace')}) waiting in {waits}")
    return "; ".join(out)


def wait_gone(pids: list[int], limit: float) -> float:
    """Seconds until none of `pids` is alive (`limit` + 1 if some outlive `limit`)."""
    start = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - start > limit:
            return limit + 1
        time.sleep(0.05)
    return time.monotonic() - start


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def refused(fn: Callable[[], Any], *words: str, kind: type[BaseException] = Exception) -> str:
    """Call `fn`, which must raise `kind` with every one of `words` in its message."""
    try:
        fn()
    except kind as err:
        message = str(err)
        missing = [w for w in words if w not in message]
        expect(not missing, f"the error does not say {missing}: {message[:600]}")
        return message
    raise AssertionError(f"accepted, expected a refusal saying {list(words)}")


def evil_pickle(folder: Path) -> tuple[Path, Path]:
    """(file, marker): unpickling `file` creates `marker`, as an attacker's checkpoint would."""

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {folder / 'pwned'}",))

    path = folder / "evil.pt"
    path.write_bytes(pickle.dumps(Payload()))
    return path, folder / "pwned"


def validate(*overrides: str) -> None:
    """The entry point's checks on the config of these command-line overrides."""
    from gracecomm.experiments.train import compose_config
    from gracecomm.experiments.train import validate as check
    check(compose_config(*overrides))


# -- hostile configs ----------------------------------------------------------------------

@case("config", slow=True)
def target_escapes_from_the_command_line(tmp: Path) -> str:
    evil, marker = evil_pickle(tmp)
    for target in ESCAPES:
        options = ([f"+compressor.command=touch {marker}"] if target.endswith("system") else
                   [f"+compressor.f={evil}", "+compressor.weights_only=false"])
        proc = train(tmp / "run", "compressor=none", f"compressor._target_={target}", *options,
                     timeout=120)
        expect(proc.returncode != 0 and "may be instantiated" in proc.stderr,
               f"{target} was not refused: {proc.stderr[-800:]}")
        expect(not marker.exists(), f"{target} ran the attacker's code")
    return f"{len(ESCAPES)} escapes refused, nothing ran"


@case("config")
def target_escapes_from_a_yaml_on_the_search_path(tmp: Path) -> str:
    evil, marker = evil_pickle(tmp)
    for group in ("compressor", "compressor/sparsifier", "memory"):
        (tmp / group).mkdir(parents=True, exist_ok=True)
    tried = 0
    for i, target in enumerate(ESCAPES):
        text = (f"_target_: {target}\ncommand: touch {marker}\n" if target.endswith("system")
                else f"_target_: {target}\nf: {evil}\nweights_only: false\n")
        for group in ("compressor", "compressor/sparsifier", "memory"):
            (tmp / group / f"evil{i}.yaml").write_text(text)
        for choice in ([f"compressor=evil{i}"], ["compressor=deepreduce",
                                                 f"compressor/sparsifier=evil{i}"],
                       ["compressor=topk", f"memory=evil{i}"]):
            refused(lambda c=choice: validate(f"hydra.searchpath=[file://{tmp}]", *c),
                    "may be instantiated")
            tried += 1
    expect(not marker.exists(), "a config on the search path ran the attacker's code")
    return f"{tried} configs (top level and nested) refused"


@case("config")
def target_escapes_through_grace_build(tmp: Path) -> str:
    from gracecomm import build
    evil, marker = evil_pickle(tmp)
    tried = 0
    for target in ESCAPES:
        spec = ({"_target_": target, "command": f"touch {marker}"} if target.endswith("system")
                else {"_target_": target, "f": str(evil), "weights_only": False})
        for call in (lambda s=spec: build(s),
                     lambda s=spec: build("topk", memory=s),
                     lambda s=spec: build("topk", communicator=s),
                     lambda s=spec: build({"name": "deepreduce", "sparsifier": s}),
                     lambda s=spec: build({"name": "compose", "compressors": ["topk", s]})):
            refused(call, "may be instantiated")
            tried += 1
    expect(not marker.exists(), "gracecomm.build ran the attacker's code")
    return f"{tried} specs refused"


@case("config")
def project_and_opted_in_targets_still_work(tmp: Path) -> str:
    from gracecomm.config import instantiate
    from gracecomm.experiments.train import compose_config
    cfg = compose_config("compressor=deepreduce", "compressor/index=bloom")
    for group in ("compressor", "memory", "communicator", "model", "data"):
        instantiate(cfg[group])
    layer = instantiate({"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1})
    odd = instantiate({"_target_": "collections.OrderedDict"}, allow_any_target=True)
    expect(isinstance(layer, torch.nn.Linear) and odd == {}, "an allowed target failed")
    return "configs, torch.nn and allow_any_target=true instantiate"


@case("config")
def invalid_options_are_named(tmp: Path) -> str:
    cases = [(("trainer.eval_every=0",), ("eval_every", "[1, inf)")),
             (("trainer.collective_timeout_s=-5",), ("collective_timeout_s", "(0.0, inf)")),
             (("trainer.collective_timeout_s=0",), ("collective_timeout_s", "(0.0, inf)")),
             (("+trainer.lrr=0.1",), ("unknown option 'lrr'", "did you mean 'lr'")),
             (("logger=wandb", "logger.mode=bogus"), ("'mode'", "online")),
             (("logger=wandb", "+logger.projcet=x"), ("projcet", "project"))]
    for overrides, words in cases:
        refused(lambda o=overrides: validate(*o), *words)
    saved = sys.modules.get("wandb")
    sys.modules["wandb"] = None  # type: ignore[assignment]  # as if not installed
    try:
        refused(lambda: validate("logger=wandb"), "pip install", kind=ImportError)
    finally:
        if saved is None:
            del sys.modules["wandb"]
        else:
            sys.modules["wandb"] = saved
    from gracecomm.experiments.bench.__main__ import check_overrides
    from gracecomm.plugins import import_submodules
    import_submodules("gracecomm.experiments.bench")
    refused(lambda: check_overrides("quantizers", ["suite=quantizers", "sizes=[1000]"]),
            "'sizes'", "+quantizers.sizes")
    check_overrides("quantizers", ["+quantizers.sizes=[1000]"])
    return f"{len(cases) + 2} bad settings refused before any worker starts"


@case("config", slow=True)
def bad_logger_fails_before_workers(tmp: Path) -> str:
    start = time.monotonic()
    proc = train(tmp / "run", "logger=wandb", "logger.mode=bogus", timeout=120)
    took = time.monotonic() - start
    expect(proc.returncode != 0 and "option 'mode' must be one of" in proc.stderr,
           f"not refused: {proc.stderr[-800:]}")
    expect("worker rank" not in proc.stderr, "workers were started")
    return f"refused in {took:.1f} s (process start included)"


# -- failing, hung and killed ranks --------------------------------------------------------

def _fault_worker(rank: int, world_size: int, fault: str, stamp: str) -> None:
    import torch.distributed as dist
    dist.barrier()
    if rank == 1:
        Path(stamp).write_text(str(time.time()))
        if fault == "raise":
            raise ValueError("rank 1's own error")
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    dist.all_reduce(torch.ones(4))  # rank 0 waits here for a peer that never comes
    time.sleep(60)


def _fault(tmp: Path, fault: str, collective_timeout_s: float, words: tuple[str, ...]) -> float:
    """Seconds from rank 1's fault until `spawn` raised an error with `words`."""
    from gracecomm.experiments.launch import WorkerError, spawn
    stamp = tmp / f"{fault}.time"
    message = refused(lambda: spawn(_fault_worker, 2, fault, str(stamp), timeout_s=120,
                                    collective_timeout_s=collective_timeout_s),
                      *words, kind=WorkerError)
    expect("Connection closed" not in message.split("\n")[0], message[:300])
    return time.time() - float(stamp.read_text())


@case("faults", slow=True)
def failing_rank_is_named_within_seconds(tmp: Path) -> str:
    delays = [_fault(tmp, "raise", 60, ("worker rank 1 of 2 failed", "rank 1's own error"))
              for _ in range(OPTIONS["trials"])]
    expect(max(delays) < FAULT_S, f"reported after {max(delays):.1f} s")
    return f"named after {min(delays):.2f}-{max(delays):.2f} s ({len(delays)} trials)"


@case("faults", slow=True)
def killed_rank_is_named_within_seconds(tmp: Path) -> str:
    delays = [_fault(tmp, "kill", 60, ("worker rank 1 of 2 was killed by signal SIGKILL",))
              for _ in range(OPTIONS["trials"])]
    expect(max(delays) < FAULT_S, f"reported after {max(delays):.1f} s")
    return f"named after {min(delays):.2f}-{max(delays):.2f} s ({len(delays)} trials)"


@case("faults", slow=True)
def hung_rank_is_named_after_the_collective_timeout(tmp: Path) -> str:
    timeout = 3.0
    said = "worker rank 1 of 2 did not answer within the collective timeout"
    delay = _fault(tmp, "stop", timeout, (said,))
    expect(delay < timeout + FAULT_S, f"reported after {delay:.1f} s")
    return f"hung rank 1 named after {delay:.1f} s (collective timeout {timeout:g} s)"


def _launcher_signal(tmp: Path, sig: signal.Signals) -> str:
    delays = []
    for trial in range(OPTIONS["trials"]):
        with long_run(tmp / f"run{trial}") as proc:
            workers = workers_of(proc.pid)
            expect(len(workers) == 2, f"found workers {workers}")
            os.kill(proc.pid, sig)
            delays.append(wait_gone(workers, 30))
    expect(max(delays) <= FAULT_S, f"workers outlived the launcher by {max(delays):.1f} s")
    return f"workers gone {min(delays):.2f}-{max(delays):.2f} s after it ({len(delays)} trials)"


@case("faults", slow=True)
def no_orphans_after_launcher_sigterm(tmp: Path) -> str:
    return _launcher_signal(tmp, signal.SIGTERM)


@case("faults", slow=True)
def no_orphans_after_launcher_sigkill(tmp: Path) -> str:
    return _launcher_signal(tmp, signal.SIGKILL)


@case("faults", slow=True)
def ctrl_c_stops_every_process(tmp: Path) -> str:
    return _ctrl_c(tmp, train_cmd(tmp / "run", "trainer.epochs=1000"))


def _ctrl_c(tmp: Path, cmd: list[str]) -> str:
    """Ctrl-C (SIGINT to the command's process group, as a terminal sends it) ends the
    workers of a running `cmd` within `FAULT_S`, and the launcher soon after."""
    with long_run(tmp / "run", session=True, cmd=cmd) as proc:
        workers = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        took = wait_gone(workers, FAULT_S)
        left = describe([proc.pid, *workers])
        launcher = wait_gone([proc.pid], 30)
    expect(took <= FAULT_S, f"child processes outlived Ctrl-C by {took:.1f} s: {left}")
    expect(launcher <= 30, f"the launcher outlived Ctrl-C by {launcher:.1f} s")
    return (f"its {len(workers)} child processes gone after {took:.2f} s, the launcher after "
            f"{launcher:.2f} s")


def torchrun_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "gracecomm.experiments.train",
            f"hydra.run.dir={run_dir}", "trainer.progress=false", *overrides]


@case("faults", slow=True)
def ctrl_c_under_torchrun(tmp: Path) -> str:
    return _ctrl_c(tmp, torchrun_cmd(tmp / "run", "trainer.epochs=1000"))


@case("faults", slow=True)
def failing_rank_under_torchrun_is_named(tmp: Path) -> str:
    edited = edited_checkpoint(tmp, 1, edit_position)
    start = time.monotonic()
    proc = subprocess.run(torchrun_cmd(tmp / "run", "compressor=topk", "trainer.max_steps=8",
                                       f"trainer.resume={edited}",
                                       "trainer.collective_timeout_s=120"),
                          env=ENV, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    expect(proc.returncode != 0 and "rank 1 of 2 failed" in proc.stderr
           and "which is not a position of this run" in proc.stderr,
           f"rank 1's error not shown: {proc.stderr[-1500:]}")
    expect(took < 60, f"took {took:.0f} s (collective timeout 120 s)")
    return f"rank 1's own error shown; run ended after {took:.1f} s (process starts included)"


# -- checkpoints ------------------------------------------------------------------------------

@functools.cache
def base_checkpoint(base: Path) -> Path:
    """A complete checkpoint of 4 Top-k steps on 2 ranks in `base` (made once per suite
    run; cases copy it before changing it)."""
    folder = base / "base-checkpoint"
    proc = train(folder / "run", "compressor=topk", "trainer.max_steps=4",
                 "trainer.checkpoint_every=2", f"trainer.checkpoint_dir={folder}/ckpt")
    expect(proc.returncode == 0, f"the base run failed: {proc.stderr[-1500:]}")
    return folder / "ckpt"


def edited_checkpoint(tmp: Path, rank: int, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the base checkpoint whose rank `rank` file was edited as an attacker would
    edit it: its manifest entry (size, SHA-256) is updated to match."""
    import hashlib
    folder = tmp / "ckpt"
    shutil.copytree(base_checkpoint(tmp.parent), folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["ranks"][rank]
    state = torch.load(folder / entry["file"], weights_only=True)
    edit(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    (folder / entry["file"]).write_bytes(data)
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def edit_position(state: dict[str, Any]) -> None:
    """One batch less in the position: no longer a position of the run."""
    state["position"]["batch"] -= 1


def resume(tmp: Path, folder: Path, max_steps: int = 8) -> subprocess.CompletedProcess[str]:
    """Resume the Top-k run of `folder` up to `max_steps`, with a long collective timeout
    (a failure must be named long before it)."""
    return train(tmp / "resumed", "compressor=topk", f"trainer.max_steps={max_steps}",
                 f"trainer.resume={folder}", "trainer.collective_timeout_s=120")


@case("checkpoint", slow=True)
def killed_run_leaves_a_checkpoint_that_resumes(tmp: Path) -> str:
    steps = []
    for trial in range(OPTIONS["trials"]):
        folder = tmp / f"ckpt{trial}"
        with long_run(tmp / f"run{trial}", "compressor=topk", "trainer.checkpoint_every=1",
                      f"trainer.checkpoint_dir={folder}") as proc:
            time.sleep(0.3 * trial)
            os.kill(workers_of(proc.pid)[trial % 2], signal.SIGKILL)
            proc.wait(timeout=60)
        step = json.loads((folder / "manifest.json").read_text())["step"]
        done = resume(tmp / f"r{trial}", folder, step + 2)
        expect(done.returncode == 0, f"resume failed: {done.stderr[-1500:]}")
        logged = [json.loads(line)["step"] for line in
                  (tmp / f"r{trial}" / "resumed" / "metrics.jsonl").read_text().splitlines()
                  if '"type": "step"' in line]
        expect(logged == [step + 1, step + 2], f"resumed steps {logged} after step {step}")
        steps.append(step)
    return f"killed at steps {steps}; each resumed in step on both ranks"


@case("checkpoint", slow=True)
def missing_or_mismatched_rank_files_are_refused(tmp: Path) -> str:
    from gracecomm.experiments import checkpoint
    source = base_checkpoint(tmp.parent)
    folder = tmp / "a"
    shutil.copytree(source, folder)
    (folder / "rank1-step4.pt").unlink()
    refused(lambda: checkpoint.manifest(folder, 2), "rank 1", "step 4", "missing")
    shutil.copy(folder / "rank0-step4.pt", folder / "rank1-step4.pt")
    refused(lambda: checkpoint.manifest(folder, 2), "rank 1's file rank1-step4.pt",
            "not the one its manifest.json recorded")
    folder = tmp / "b"
    shutil.copytree(source, folder)
    data = (folder / "rank0-step4.pt").read_bytes()
    (folder / "rank0-step4.pt").write_bytes(data[: len(data) // 2])  # torn
    refused(lambda: checkpoint.manifest(folder, 2), "rank 0", "truncated")
    (folder / "manifest.json").unlink()
    refused(lambda: checkpoint.manifest(folder, 2), "holds no complete checkpoint")
    refused(lambda: checkpoint.manifest(source, 4), "written by 2 ranks; this run has 4")
    return "missing, swapped, torn files and a missing manifest refused, naming the rank"


@case("checkpoint", slow=True)
def hand_edited_position_is_refused(tmp: Path) -> str:
    folder = edited_checkpoint(tmp, 1, edit_position)
    start = time.monotonic()
    proc = resume(tmp, folder)
    took = time.monotonic() - start
    expect(proc.returncode != 0 and "worker rank 1 of 2 failed" in proc.stderr
           and "not a position of this run" in proc.stderr, proc.stderr[-1500:])
    return f"refused, naming rank 1's position, after {took:.1f} s (process start included)"


@case("checkpoint", slow=True)
def wrong_shaped_state_is_refused(tmp: Path) -> str:
    def shrink(state: dict[str, Any]) -> None:
        residuals = state["grace"]["memory"]["residuals"]
        name = next(iter(residuals))
        residuals[name] = residuals[name].flatten()[:3].clone()

    proc = resume(tmp, edited_checkpoint(tmp, 0, shrink))
    expect(proc.returncode != 0 and "memory.residuals." in proc.stderr
           and "has shape [3]" in proc.stderr, proc.stderr[-1500:])
    return "refused, naming the residual and both shapes"


@case("checkpoint", slow=True)
def resuming_a_finished_run_says_so(tmp: Path) -> str:
    proc = resume(tmp, base_checkpoint(tmp.parent), 4)
    expect(proc.returncode == 0 and "holds the end of this run" in proc.stdout,
           proc.stdout[-800:] + proc.stderr[-800:])
    line = next(line for line in proc.stdout.splitlines() if "test accuracy" in line)
    expect(0 < float(line.split()[-1]) <= 1, line)  # NaN fails too
    return f"said so and evaluated it: {line.strip()}"


# -- determinism ----------------------------------------------------------------------------

@case("determinism")
def curve_fits_are_repeatable(tmp: Path) -> str:
    from gracecomm.compressors.deepreduce.fitting import dexp_fit, poly_fit
    torch.manual_seed(0)
    y = torch.sort(torch.rand(3000, dtype=torch.float64) ** 3, descending=True).values
    for fit in (lambda: dexp_fit(y / y.max(), 30), lambda: poly_fit(y, 5)):
        first = fit()
        expect(all(torch.equal(first, fit()) for _ in range(20)), "a fit changed between calls")
    return "dexp and polyfit: 20 calls on the same values, bit-identical"


def _final_state(tmp: Path, name: str, *overrides: str) -> dict[str, Any]:
    folder = tmp / name
    proc = train(tmp / f"{name}_run", *overrides, "trainer.max_steps=12",
                 "trainer.checkpoint_every=12", f"trainer.checkpoint_dir={folder}")
    expect(proc.returncode == 0, proc.stderr[-1500:])
    entry = json.loads((folder / "manifest.json").read_text())["ranks"][0]
    return torch.load(folder / entry["file"], weights_only=True)


@case("determinism", slow=True)
def deepreduce_fit_runs_are_identical(tmp: Path) -> str:
    overrides = ("compressor=deepreduce", "compressor/index=bloom",
                 "compressor.index.policy=naive", "compressor/value=dexp")
    a, b = (_final_state(tmp, name, *overrides) for name in ("a", "b"))
    worst = max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"])
    expect(worst == 0, f"two identical runs differ by {worst:g}")
    return "Bloom naive + dexp: two 12-step runs bit-identical"


# -- concurrency ----------------------------------------------------------------------------

@case("concurrency", slow=True)
def runs_started_together_keep_their_outputs(tmp: Path) -> str:
    # the default directory's pattern with the time fixed, as if both started in one second
    pattern = "hydra.run.dir=outputs/same-second_${hydra.runtime.choices.compressor}_${run_token:}"
    procs = [subprocess.Popen([*train_cmd(None, "compressor=topk", "trainer.max_steps=3"),
                               pattern], cwd=tmp, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    expect(all(p.returncode == 0 for p in procs), outs[0][1][-800:] + outs[1][1][-800:])
    dirs = sorted((tmp / "outputs").glob("same-second_topk_*/summary.json"))
    expect(len(dirs) == 2, f"summaries: {dirs}")
    return f"two summaries in {', '.join(d.parent.name for d in dirs)}"


@case("concurrency", slow=True)
def a_run_directory_in_use_is_refused(tmp: Path) -> str:
    with long_run(tmp / "run"):
        proc = train(tmp / "run", "trainer.max_steps=3", timeout=120)
    expect(proc.returncode != 0 and "is in use by another run" in proc.stderr,
           proc.stderr[-800:])
    return "the second run refused at once"


# -- examples -----------------------------------------------------------------------------------

@case("examples")
def readme_custom_loop_handles_frozen_and_unused_parameters(tmp: Path) -> str:
    readme = Path(__file__).resolve().parent.parent / "README.md"
    if not readme.exists():
        return "README.md not installed with the package; skipped"
    blocks = readme.read_text().split("```python")[1:]
    code = next(b.split("```")[0] for b in blocks if 'build("randomk"' in b)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2),
                                torch.nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)  # frozen; model[0].bias and model[2] get no gradient
    loss = model[1](torch.randn(5, 3)).sum()
    if "loss.backward()" not in code:  # the snippet starts after backward
        loss.backward()
    from gracecomm import build
    env: dict[str, Any] = {"model": model, "torch": torch, "build": build, "loss": loss,
                           "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    exec(compile(code, str(readme), "exec"), env)  # noqa: S102 - this project's own README
    expect(model[1].weight.grad is not None and model[0].weight.grad is None,
           "gradients were not exchanged as the README says")
    return "the README's custom loop runs with a frozen and an unused parameter"


# -- the runner ----------------------------------------------------------------------------------

def run(cases: list[Case], base: Path) -> list[tuple[Case, bool, float, str]]:
    rows = []
    for c in cases:
        folder = Path(tempfile.mkdtemp(prefix=f"{c.name[:40]}-", dir=base))
        start = time.monotonic()
        try:
            note, ok = c.fn(folder), True
        except Exception as err:  # noqa: BLE001 - a case that raises went wrong
            note, ok = f"{type(err).__name__}: {err}".splitlines()[0][:300], False
            traceback.print_exc(file=sys.stderr)
        rows.append((c, ok, time.monotonic() - start, note))
        print(f"{'ok   ' if ok else 'WRONG'} {c.group:<12} {c.name:<55} "
              f"{rows[-1][2]:6.1f} s  {note}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="pattern", default="", help="only cases whose group or "
                        "name contains this")
    parser.add_argument("--quick", action="store_true", help="only the cases that start no "
                        "training runs")
    parser.add_argument("--trials", type=int, default=OPTIONS["trials"],
                        help="trials of each timed fault (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=1, help="run the selection this often")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # clean up runs
    OPTIONS["trials"] = args.trials
    chosen = [c for c in CASES if args.pattern in f"{c.group} {c.name}"
              and not (args.quick and c.slow)]
    wrong = tried = 0
    with tempfile.TemporaryDirectory(prefix="gracecomm-reliability-") as base:
        for round_ in range(args.repeat):
            if args.repeat > 1:
                print(f"-- round {round_ + 1} of {args.repeat}", flush=True)
            rows = run(chosen, Path(base))
            tried += len(rows)
            wrong += sum(not ok for _, ok, _, _ in rows)
    print(f"\ncases tried: {tried}, went wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
