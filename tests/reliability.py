"""The reliability suite: replays, as a new user or an attacker would, the ways a run can go
wrong (hostile configs, failing, hung and killed ranks, killed launchers, torn and edited
checkpoints, non-deterministic resume, runs started at once) and prints one line per case
and the count of cases tried and cases that went wrong.

    python -m tests.reliability                   # every case
    python -m tests.reliability -k checkpoint     # cases whose name has it
    python -m tests.reliability --trials 13       # more trials of timed faults
    python -m tests.reliability --repeat 10       # the whole suite 10 times

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

from gracecomm.validation import ConfigError

CaseFn = Callable[[Path], str]
FAULT_S = 5.0  # the target: a failure reaches the user, named, within this many seconds
ESCAPES = ("gracecomm.experiments.training.checkpoint.torch.load",
           "torch.nn.modules.module.torch.load", "gracecomm.experiments.training.train.os.system")


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
    return [sys.executable, "-m", "gracecomm.experiments.training", *where,
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
    from gracecomm.experiments.training.config import compose_config
    from gracecomm.experiments.training.config import validate as check
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
    from gracecomm.experiments.training.config import compose_config
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
             (("+trainer.lrr=0.1",), ("unknown option 'lrr'", "Did you mean 'lr'")),
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


HELPER = "gracecomm.experiments.cluster.topologies._run"  # a package function that runs a command


def _touch_spec(marker: Path) -> dict[str, Any]:
    return {"_target_": HELPER, "_args_": ["touch", str(marker)]}


@case("config")
def a_package_function_is_not_a_target(tmp: Path) -> str:
    from gracecomm import build
    marker = tmp / "MARKER"
    (tmp / "compressor").mkdir()
    (tmp / "compressor" / "evil.yaml").write_text(
        f"_target_: {HELPER}\n_args_: [touch, {marker}]\n")
    overrides = [[f"compressor._target_={HELPER}", f"+compressor._args_=[touch,{marker}]"],
                 ["compressor=deepreduce", f"compressor.sparsifier._target_={HELPER}",
                  f"+compressor.sparsifier._args_=[touch,{marker}]"],
                 [f"hydra.searchpath=[file://{tmp}]", "compressor=evil"]]
    for given in overrides:  # compose_config: as the command line composes
        refused(lambda g=given: validate(*g), HELPER, "may be instantiated")
    spec = _touch_spec(marker)
    calls = [lambda: build(spec), lambda: build("topk", memory=spec),
             lambda: build("topk", communicator=spec),
             lambda: build({"name": "deepreduce", "sparsifier": spec}),
             lambda: build({"name": "compose", "compressors": ["topk", spec]})]
    for call in calls:
        refused(call, HELPER, "may be instantiated")
    expect(not marker.exists(), "a package function ran")
    return f"{len(overrides) + len(calls)} ways refused (overrides, nested, search path, build)"


@case("config")
def loaders_and_instantiate_are_not_targets(tmp: Path) -> str:
    from gracecomm import build
    from gracecomm.config import instantiate
    from gracecomm.experiments.training.config import part_config
    marker = tmp / "MARKER"
    (tmp / "side_effect_module.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp / "evil.yaml").write_text(f"_target_: {HELPER}\n_args_: [touch, {marker}]\n")
    sys.path.insert(0, str(tmp))
    try:
        for name in ("gracecomm.config.resolve_target", "gracecomm.config.check_target"):
            refused(lambda n=name: build({"_target_": n, "target": "side_effect_module.x"}),
                    "may be instantiated")
        loader = {"_target_": "gracecomm.experiments.training.config.part_config",
                  "group": f"../../../../../../../..{tmp}", "name": "evil"}
        refused(lambda: build({"_target_": "gracecomm.config.instantiate", "cfg": loader,
                               "allow_any_target": True}), "gracecomm.config.instantiate")
        refused(lambda: instantiate(loader), "part_config")
        refused(lambda: part_config(loader["group"], "evil"), "leaves the config tree")
    finally:
        sys.path.remove(str(tmp))
    expect(not marker.exists(), "a loader or an import ran the attacker's code")
    return "resolve_target, check_target, instantiate and part_config refused; nothing imported"


@case("config")
def hydra_nodes_are_checked_before_they_run(tmp: Path) -> str:
    from gracecomm.experiments.training.config import compose_config
    (tmp / "memory").mkdir()
    logging = ['formatters: {evil: {"()": ' + HELPER + ', command: "touch x"}}',
               "handlers: {file: {class: " + HELPER + "}}",
               "handlers: {console: {stream: ext://os.system}}"]
    for i, node in enumerate(logging):
        (tmp / "memory" / f"log{i}.yaml").write_text(
            "# @package _global_\nmemory: {_target_: gracecomm.memories.none.NoneMemory}\n"
            f"hydra:\n  job_logging:\n    {node}\n")
    tried = [(["+hydra.callbacks.x._target_=builtins.print"], "hydra.callbacks.x"),
             ([f"hydra.launcher._target_={HELPER}"], "hydra.launcher"),
             ([f"hydra.sweeper._target_={HELPER}"], "hydra.sweeper"),
             (["+hydra.job.env_set.PYTHONPATH=/tmp"], "env_set"),
             (["+hydra.job.env_set.LD_PRELOAD=/tmp/x.so"], "env_set"),
             *(([f"hydra.searchpath=[file://{tmp}]", f"memory=log{i}"], "hydra.job_logging")
               for i in range(len(logging)))]
    for overrides, word in tried:
        refused(lambda o=overrides: compose_config(*o), word)
    compose_config("hydra/launcher=joblib", "+hydra.job.env_set.OMP_NUM_THREADS=1")
    return f"{len(tried)} hydra.* nodes refused at composition; an installed launcher allowed"


@case("config")
def group_choices_stay_in_the_config_tree(tmp: Path) -> str:
    marker = tmp / "MARKER"
    (tmp / "evil.yaml").write_text(f"_target_: {HELPER}\n_args_: [touch, {marker}]\n")
    group = Path(__file__).resolve().parent.parent / "configs" / "compressor"
    up = "../" * len(group.parts[1:]) + str(tmp)[1:] + "/evil"
    refused(lambda: validate(f"compressor={up}"), "leaves the config tree")
    refused(lambda: validate("compressor=deepreduce", "compressor/sparsifier=../compose"),
            "leaves the config tree")
    expect(not marker.exists(), "a config outside the tree ran")
    return "choices with '..' refused (one reached a YAML outside the tree before)"


@case("config")
def allow_any_target_comes_only_from_the_command_line(tmp: Path) -> str:
    from omegaconf import OmegaConf

    from gracecomm.config import check_composed, instantiate
    from gracecomm.experiments.training.config import compose_config
    (tmp / "experiment").mkdir()
    (tmp / "experiment" / "open.yaml").write_text("# @package _global_\nallow_any_target: true\n")
    refused(lambda: compose_config(f"hydra.searchpath=[file://{tmp}]", "+experiment=open"),
            "a config file sets allow_any_target", "command line")
    sweep = OmegaConf.create({"hydra": {"sweeper": {"params": {"allow_any_target": "true"}}}})
    refused(lambda: check_composed(sweep, []), "sweeps allow_any_target")
    cfg = compose_config("allow_any_target=true")
    expect(instantiate({"_target_": "collections.OrderedDict"},
                       allow_any_target=cfg.allow_any_target) == {}, "the opt-in failed")
    return "a config file and a sweeper refused; the command line opts in"


@case("config", slow=True)
def the_issue_command_lines_run_nothing(tmp: Path) -> str:
    marker = tmp / "MARKER"
    (tmp / "conf" / "experiment").mkdir(parents=True)
    (tmp / "conf" / "experiment" / "open.yaml").write_text(
        f"# @package _global_\nallow_any_target: true\ncompressor:\n  _target_: {HELPER}\n"
        f"  _args_: [touch, {marker}]\n")
    runs = [(["trainer.max_steps=1", f"compressor._target_={HELPER}",
              f"+compressor._args_=[touch,{marker}]"], "may be instantiated"),
            (["trainer.max_steps=1", "+hydra.callbacks.x._target_=builtins.print",
              "+hydra.callbacks.x._args_=[CALLBACK_RAN]"], "hydra.callbacks.x"),
            (["trainer.max_steps=1", "+experiment=open"], "a config file sets allow_any_target")]
    for i, (overrides, word) in enumerate(runs):
        cmd = train_cmd(tmp / f"run{i}", *overrides)
        if i == 2:
            cmd[3:3] = ["--config-dir", str(tmp / "conf")]
        proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
        expect(proc.returncode != 0 and word in proc.stderr
               and "CALLBACK_RAN" not in proc.stdout + proc.stderr, proc.stderr[-800:])
    expect(not marker.exists(), "a command line ran the attacker's code")
    return f"{len(runs)} command lines refused before anything ran"


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
    from gracecomm.experiments.training.launch import WorkerError, spawn
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


def _exits_early(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    dist.barrier()
    if rank == 1:
        os._exit(0)
    dist.all_reduce(torch.ones(4))  # rank 0 waits here for a peer that is gone


@case("faults", slow=True)
def rank_exiting_with_code_0_is_named(tmp: Path) -> str:
    from gracecomm.experiments.training.launch import WorkerError, spawn
    message = refused(lambda: spawn(_exits_early, 2, timeout_s=60, collective_timeout_s=30),
                      kind=WorkerError)
    first = message.split("\n")[0]
    expect(first.startswith("worker rank 1 of 2 exited with code 0 before its work was done"),
           first)
    return "named as the rank that exited with code 0 (not its peer's lost connection)"


@case("numerics")
def finite_overflow_is_not_called_nan(tmp: Path) -> str:
    from gracecomm import NonFiniteError, build
    x = torch.full((1000,), 1e38)
    x[::2] = -1e38
    message = refused(lambda: build("gaussiank").compressor.compress(x, "w"),
                      "holds no NaN or Inf", "1.000e+38", kind=NonFiniteError)
    expect("0 NaN" not in message, message)
    return "gaussiank on finite 1e38: 'holds no NaN or Inf, but values up to 1.000e+38'"


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
    from gracecomm.experiments.training.launch import torchrun_standalone
    return [*torchrun_standalone(2, run_dir.parent / "torchelastic"),
            "-m", "gracecomm.experiments.training",
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


# -- hostile peers ----------------------------------------------------------------------------

def _lie_about_sizes(comm: Any, by: int) -> None:
    """This rank announces its first payload tensor `by` bytes longer than it is."""
    gather = comm._gather_ints
    comm._gather_ints = lambda link, ints, device: gather(link, [ints[0] + by, *ints[1:]],
                                                           device)


def _nan_in_first_field(payload: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    first = payload[0].clone()
    first.view(-1)[0] = float("nan")
    return (first, *payload[1:])


def _header_word(index: int, value: int) -> Callable[..., Any]:
    """The parameter server's downlink header (``[items, dtype, ndim, *shape, tensors,
    (dtype, ndim, *shape) per tensor, ...]``) with one word replaced."""
    def edit(meta: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        meta = meta.clone()
        meta[index] = value
        return meta, buf
    return edit


_THRESHOLD = {"name": "threshold", "threshold": 0.5}
# name -> the method, its communicator, what the faulty rank does and which rank it is
PEER_CASES: dict[str, dict[str, Any]] = {
    **{f"{comm}_announces_{'less' if by < 0 else 'more'}": {
        "spec": _THRESHOLD, "comm": comm, "lie": by, "faulty": 1}
       for comm in ("broadcast", "allgather", "parameter_server") for by in (-16, 16)},
    "allreduce_announces_less": {"spec": "randomk", "comm": "allreduce", "lie": -16,
                                 "faulty": 1, "step": 0},  # fixed sizes: agreed at step 0
    # the first item is "w" (8, 12): one float32 tensor of 96 values on a dense downlink
    "downlink_result_dtype_minus_1": {"spec": "none", "comm": "parameter_server",
                                      "header": (1, -1), "faulty": 0},
    "downlink_tensor_dtype_minus_9": {"spec": "none", "comm": "parameter_server",
                                      "header": (6, -9), "faulty": 0},
    "downlink_result_dim_minus_5": {"spec": "none", "comm": "parameter_server",
                                    "header": (3, -5), "faulty": 0},
    "downlink_result_of_another_shape": {"spec": "none", "comm": "parameter_server",
                                         "header": (3, 12), "faulty": 0},
    **{f"nan_in_{spec}_{comm}": {"spec": spec, "comm": comm, "corrupt": True, "faulty": 1}
       for spec in ("topk", "qsgd", "terngrad")
       for comm in ("allgather", "broadcast", "parameter_server")},
    "nan_in_fp16_allreduce": {"spec": "fp16", "comm": "allreduce", "corrupt": True,
                              "faulty": 1},
}
PEER_SHAPES = {"w": (8, 12), "b": (40,)}


def peer_worker(rank: int, world_size: int, name: str, out: str) -> None:
    """Three exchanges of `PEER_CASES[name]`, the faulty rank turning hostile at the second
    (or the given step); every rank writes the error it ended with to ``out.<rank>``."""
    from gracecomm import build
    from gracecomm.communicators import parameter_server
    setup = PEER_CASES[name]
    pipe = build(setup["spec"], communicator=setup["comm"])
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(3):
            hostile = rank == setup["faulty"] and step == setup.get("step", 1)
            if hostile and "lie" in setup:
                _lie_about_sizes(pipe.communicator, setup["lie"])
            if hostile and setup.get("corrupt"):
                compress = pipe.compressor.compress_rounds

                def corrupted(named: Any, link: Any) -> Any:
                    done = yield from compress(named, link)
                    return [(_nan_in_first_field(p), c) if i == 0 else (p, c)
                            for i, (p, c) in enumerate(done)]

                pipe.compressor.compress_rounds = corrupted  # type: ignore[method-assign]
            if hostile and "header" in setup:
                pack, edit = parameter_server.pack, _header_word(*setup["header"])
                parameter_server.pack = lambda payloads: edit(*pack(payloads))
            grads = [(n, torch.randn(*s, generator=gen)) for n, s in PEER_SHAPES.items()]
            for (n, grad), mean in zip(grads, pipe.step_many(grads)):
                expect(mean.dtype == grad.dtype and mean.shape == grad.shape,
                       f"tensor '{n}': a {mean.dtype} mean of shape {tuple(mean.shape)}")
                expect(bool(torch.isfinite(mean).all()), f"tensor '{n}': a non-finite mean")
    except Exception as err:
        Path(out).with_suffix(f".{rank}").write_text(json.dumps([type(err).__name__, str(err)]))
        raise


def named_by_a_payload_error(tmp: Path, name: str) -> str:
    """Run `PEER_CASES[name]` on 2 ranks: it must end in a `PayloadError` naming the faulty
    rank, never a signal (an abort inside Gloo); the message that named it."""
    from gracecomm.experiments.training.launch import WorkerError, spawn
    out = tmp / name
    message = refused(lambda: spawn(peer_worker, 2, name, str(out), timeout_s=60,
                                    collective_timeout_s=30), "PayloadError", kind=WorkerError)
    expect("signal" not in message.split("\n")[0], message[:300])
    faulty = f"rank {PEER_CASES[name]['faulty']}"
    errors = [json.loads(p.read_text()) for p in tmp.glob(f"{name}.*")]
    named = [m for kind, m in errors if kind == "PayloadError" and faulty in m]
    expect(bool(named), f"no PayloadError names {faulty}: {errors}")
    return named[0]


def _peer_cases(tmp: Path, part: str) -> str:
    chosen = [name for name in PEER_CASES if part in name]
    for name in chosen:
        named_by_a_payload_error(tmp, name)
    return f"{len(chosen)} cases, each a PayloadError naming the faulty rank, no abort"


@case("peers", slow=True)
def a_peer_announcing_other_sizes_is_named(tmp: Path) -> str:
    return _peer_cases(tmp, "announces")


@case("peers", slow=True)
def a_malformed_downlink_is_named(tmp: Path) -> str:
    return _peer_cases(tmp, "downlink")


@case("peers", slow=True)
def nan_in_a_peers_float_fields_is_named(tmp: Path) -> str:
    return _peer_cases(tmp, "nan_in")


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
    from gracecomm.experiments.training import checkpoint
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


_ONE_RANK = ("trainer.world_size=1", "trainer.exchange=step", "trainer.progress=false",
             "compressor=topk")


def _train_here(tmp: Path, name: str, *overrides: str) -> Path:
    """One rank trains in this process (no process group), its run directory `tmp/name`."""
    from omegaconf import OmegaConf

    from gracecomm.experiments.training.config import compose_config
    from gracecomm.experiments.training.config import validate as check
    from gracecomm.experiments.training.worker import train_worker
    cfg = compose_config(*_ONE_RANK, *overrides)
    check(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # its summary: the case prints one line
        train_worker(0, 1, OmegaConf.to_container(cfg, resolve=True), str(tmp / name), None)
    return tmp / name


@case("checkpoint", slow=True)
def resume_refuses_every_changed_setting(tmp: Path) -> str:
    folder = tmp / "ckpt"
    _train_here(tmp, "first", "trainer.max_steps=10", "trainer.checkpoint_every=10",
                f"trainer.checkpoint_dir={folder}")  # step 10 of epoch 0
    changes = [("trainer.batch_size=16", "trainer.batch_size is 16 here but 32"),
               ("data.test_fraction=0.5", "data.test_fraction is 0.5 here but 0.2"),
               ("seed=1", "seed is 1 here but 0"),
               ("compressor.ratio=0.1", "compressor.ratio is 0.1 here but 0.01"),
               ("compressor=randomk", "compressor._target_"),
               ("memory=none", "memory._target_"),
               ("trainer.optimizer=adam", "trainer.optimizer is 'adam' here"),
               ("trainer.exchange=hook", "trainer.exchange is 'hook' here"),
               ("check_finite=false", "check_finite is False here")]
    for override, words in changes:
        refused(lambda o=override: validate(*_ONE_RANK, f"trainer.resume={folder}",
                                            "trainer.max_steps=12", o), words,
                "in the checkpoint's run")
    run = _train_here(tmp, "resumed", f"trainer.resume={folder}", "trainer.max_steps=12",
                      "trainer.lr=0.01")
    summary = json.loads((run / "summary.json").read_text())
    expect(summary["resume"]["changed"] == {"trainer.lr": [0.05, 0.01]}, str(summary["resume"]))
    return f"{len(changes)} changed settings refused, naming both values; a new lr applied and " \
        "recorded"


@case("checkpoint")
def malformed_manifests_are_named(tmp: Path) -> str:
    from gracecomm.experiments.training import checkpoint
    good = {"version": checkpoint.FORMAT_VERSION, "step": 4, "world_size": 2,
            "fingerprint": "f", "settings": {},
            "ranks": [{"file": checkpoint.file_name(r, 4), "bytes": 1, "sha256": "0" * 64}
                      for r in range(2)]}
    edits = [({"ranks": ["x", "y"]}, "'ranks' must be a list of objects"),
             ({"step": "ten"}, "'step' must be an integer"), ({"settings": None}, "'settings'"),
             ({"world_size": True}, "'world_size'"), ({"version": 2}, "format 2")]
    texts = [(json.dumps({**good, **edit}), words) for edit, words in edits]
    texts += [("{", "not JSON"), ('["x", "y"]', "holds a list"), ("null", "malformed")]
    for text, words in texts:
        (tmp / "manifest.json").write_text(text)
        refused(lambda: checkpoint.manifest(tmp, 2), words, kind=ConfigError)
    return f"{len(texts)} malformed manifests refused, naming the field"


@case("checkpoint", slow=True)
def a_full_disk_keeps_the_last_checkpoint(tmp: Path) -> str:
    if os.geteuid() != 0:
        return "skipped: mounting a small tmpfs needs root"
    from gracecomm.experiments.training import checkpoint
    size = base_checkpoint(tmp.parent).joinpath("rank0-step4.pt").stat().st_size
    disk = tmp / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={3 * size + 65536}", "tmpfs",
                    str(disk)], check=True)
    try:
        proc = train(tmp / "run", "compressor=topk", "trainer.max_steps=6",
                     "trainer.checkpoint_every=1", f"trainer.checkpoint_dir={disk}")
        left = sorted(p.name for p in disk.iterdir())
        expect(proc.returncode != 0 and "No space left on device" in proc.stderr
               and "is intact" in proc.stderr, proc.stderr[-1500:])
        expect(not [n for n in left if n.endswith(".tmp")], f"temporary files left: {left}")
        step = checkpoint.manifest(disk, 2)["step"]
        expect(left == sorted([checkpoint.MANIFEST, *(checkpoint.file_name(r, step)
                                                      for r in range(2))]), str(left))
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    return f"the disk filled at step {step + 1}; step {step}'s checkpoint intact, no file left"


@case("concurrency", slow=True)
def a_checkpoint_directory_is_never_shared(tmp: Path) -> str:
    folder = tmp / "ckpt"
    with long_run(tmp / "a", "trainer.checkpoint_every=1", f"trainer.checkpoint_dir={folder}"):
        proc = train(tmp / "b", "trainer.max_steps=3", "trainer.checkpoint_every=1",
                     f"trainer.checkpoint_dir={folder}", timeout=120)
        expect(proc.returncode != 0 and "checkpoint directory" in proc.stderr
               and "is in use by another run" in proc.stderr, proc.stderr[-800:])
    after = train(tmp / "c", "trainer.max_steps=3", "trainer.checkpoint_every=1",
                  f"trainer.checkpoint_dir={folder}", timeout=120)
    expect(after.returncode != 0 and "holds the checkpoint of another run" in after.stderr,
           after.stderr[-800:])
    expect((folder / "manifest.json").exists(), "the first run's checkpoint is gone")
    return "a live run's directory locked; a finished run's checkpoint not replaced"


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
