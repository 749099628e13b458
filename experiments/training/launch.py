"""Starting and joining process groups: local workers on Gloo over loopback, or the group a
launcher such as `torchrun` prepared. torch.distributed is the engine; this only wires it up.

Every wait is bounded and every failure is named within seconds:

- a rank whose code raises reports its traceback to the launcher at once (local workers:
  through a pipe; under torchrun: on stderr and in torchrun's error file) and exits without
  waiting for its peers, so a peer blocked in a collective cannot hide the error;
- `spawn` stops every worker as soon as one fails and raises the *first* failure: an error
  raised by a rank's own code before a peer's lost connection, and a rank that died
  silently before the peers that lost it (a rank that exits with code 0 before its work is
  done, e.g. through ``os._exit(0)``, died silently too: a finished rank says so); when a
  rank times out in a collective while another rank is alive and silent, the silent rank
  is named as the hung one, and the Python stacks of every rank still running (hung, or
  past `spawn`'s own deadline) are shown, so the error says where it waited;
- workers end with their launcher: they exit on SIGINT even while blocked in a collective,
  and within a fraction of a second after the launcher dies (SIGKILL); SIGINT or SIGTERM
  to the launcher alone (not to its process group) makes `spawn` stop its workers
  (terminate, a short wait, kill) and raise KeyboardInterrupt naming the signal, also where
  the launcher inherited SIGINT ignored (a background job of a shell);
- process groups are created with a collective timeout, so a hung peer ends the run after
  that timeout instead of never.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_POLL_S = 0.25  # how often a worker checks that its launcher is alive
_SETTLE_S = 0.5  # after a failure: time for causally earlier reports to arrive
_REPORT_CHARS = 20_000  # tail of a traceback sent to the launcher
_STACK_WAIT_S = 2.0  # how long `spawn` waits for a running worker to write its stacks
_STACK_SIGNAL = signal.SIGUSR1  # asks a local worker to write its stacks (faulthandler)
_STOP_WAIT_S = 2.0  # after SIGTERM to the workers, before SIGKILL
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # that end `spawn` and its workers
# Gloo raises plain RuntimeErrors; these say a peer went away or did not answer
_COMM_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "Timed out", "/gloo/transport/")
_TIMEOUT_MARKERS = ("Timed out", "timed out", "timeout")


class WorkerTimeoutError(TimeoutError):
    """Local workers did not finish within the allowed time."""


class WorkerError(RuntimeError):
    """A local worker died or raised; the others were stopped."""


def launched_externally() -> bool:
    """True under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    return all(v in os.environ for v in LAUNCHER_VARS)


def host_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of a local group, listening on 127.0.0.1 before any worker
    starts. A port merely found free and handed on can be taken in between, and a worker
    that connects before its rank 0 listens can be given that same port as its own source
    port and connect to itself (TCP simultaneous open), then wait forever; a store that
    already listens rules out both."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def torchrun_standalone(processes: int, log_dir: Path) -> list[str]:
    """The command line of a one-machine ``torchrun`` of `processes` ranks, its agent's
    files under `log_dir` (without ``--log-dir`` every torchrun leaves a ``torchelastic_*``
    directory in the system's temporary folder); the script and its arguments follow."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={processes}", f"--log-dir={log_dir}"]


def init_process_group(backend: str, rank: int, world_size: int, *, timeout_s: float,
                       store_port: int | None = None) -> None:
    """Join a process group. With `store_port`, a local group whose store `spawn` hosts on
    127.0.0.1 (`host_store`); otherwise the launcher's environment (MASTER_ADDR,
    MASTER_PORT) is used. ``nccl`` carries CUDA tensors; CPU tensors (start-up consistency
    checks, checkpoint manifests) go over Gloo in the same group, which NCCL alone would
    refuse."""
    timeout = timedelta(seconds=timeout_s)
    store = None
    if store_port is not None:
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                              timeout=timeout)
    if backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            store=store)


def finish_process_group() -> None:
    """After a successful run: wait for every rank in a barrier, so that no rank leaves
    while a peer still uses its connections. The group is not destroyed: the worker ends
    with `exit_now`, which runs no destructors, and with torch 2.6 the destruction sometimes
    never returned, holding the interpreter's lock, in a rank whose peers had already left
    (found by the stacks `spawn` shows). Never call it after an error: the peers may be
    blocked in another collective and the barrier would wait for them."""
    if dist.is_initialized():
        dist.barrier()


def exit_now(code: int = 0) -> NoReturn:
    """End a worker whose work is done, skipping the interpreter's teardown: C++ threads of
    communication and kernel libraries (Gloo, numba's thread pool) are sometimes still
    joinable when static destructors run, and the process then aborts ("terminate called
    without an active exception") after a successful run. Temporary directories still open
    are removed first (`remove_temporary_directories`)."""
    remove_temporary_directories()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def remove_temporary_directories() -> None:
    """Remove every `tempfile.TemporaryDirectory` still alive in this process (torch's
    remote-module template, wandb's media staging), as the interpreter's exit would: their
    finalizers are `weakref.finalize` callbacks, which `os._exit` skips, and each worker left
    its directories in the system's temporary folder."""
    cleanup = tempfile.TemporaryDirectory._cleanup.__func__  # type: ignore[attr-defined]
    registry = weakref.finalize._registry  # type: ignore[attr-defined]
    for finalizer in list(registry):
        info = registry.get(finalizer)
        if info is not None and getattr(info.func, "__func__", None) is cleanup:
            with warnings.catch_warnings():  # "Implicitly cleaning up": it is deliberate
                warnings.simplefilter("ignore", ResourceWarning)
                finalizer()


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies (even if this
    process is stopped or blocked in C++)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the watchdog polls
            pass


def end_with_launcher(launcher_pid: int, rank: int, *, kernel: bool = False) -> None:
    """Make this rank end promptly when its launcher goes away or interrupts it: a daemon
    thread exits the process on SIGINT (Python would raise KeyboardInterrupt only once the
    main thread leaves a blocking collective) and when the parent is no longer
    `launcher_pid`. With `kernel` (the launcher started this process from the thread that
    waits for it) the kernel also kills it when the launcher dies. Call from the main
    thread, before any collective."""
    if kernel:
        _die_with_parent()
    if os.getppid() != launcher_pid:  # the launcher died before we could watch it
        exit_now(1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            ready, _, _ = select.select([wake_r], [], [], _POLL_S)
            if ready and signal.SIGINT in os.read(wake_r, 64):
                print(f"rank {rank}: interrupted (SIGINT), exiting", file=sys.stderr)
                exit_now(128 + signal.SIGINT)
            if os.getppid() != launcher_pid:
                exit_now(1)

    threading.Thread(target=watch, name="grace-launcher-watch", daemon=True).start()


def failure_kind(err: BaseException) -> str:
    """``timeout``: a peer did not answer within the collective timeout; ``lost``: a peer
    went away (both usually the consequence of another rank's failure or hang); ``error``:
    a failure of this rank's own code."""
    message = str(err)
    if not (isinstance(err, dist.DistError) or (
            isinstance(err, RuntimeError) and any(m in message for m in _COMM_MARKERS))):
        return "error"
    return "timeout" if any(m in message for m in _TIMEOUT_MARKERS) else "lost"


@dataclass
class _Done:
    """What a rank tells its launcher after its work and the final barrier: a worker that
    exits with code 0 without saying so ended early (``os._exit(0)`` in user code)."""

    rank: int


@dataclass
class _Report:
    """What a failed rank tells its launcher (sent through a pipe, plain values only)."""

    rank: int
    at: float  # time.monotonic(): one clock for all processes of a machine
    kind: str  # see `failure_kind`
    text: str


def run_rank(fn: Callable[..., Any], rank: int, world_size: int, args: tuple[Any, ...], *,
             backend: str, collective_timeout_s: float, store_port: int | None = None,
             report: Connection | None = None) -> NoReturn:
    """The whole life of one rank: join the group, run ``fn(rank, world_size, *args)`` and
    exit. On success the ranks meet in a barrier; on an error this rank reports it at once
    (to `report`, a local worker's pipe to `spawn`; else on stderr and, under torchrun, in
    its error file) and exits with code 1 without waiting for its peers. Without `report`
    the process is under an external launcher (its parent), whose end it follows."""
    if report is None:
        end_with_launcher(os.getppid(), rank)
    try:
        init_process_group(backend, rank, world_size, timeout_s=collective_timeout_s,
                           store_port=store_port)
        fn(rank, world_size, *args)
    except BaseException as err:  # noqa: BLE001 - any failure ends the rank, reported
        failure = _Report(rank, time.monotonic(), failure_kind(err),
                          traceback.format_exc()[-_REPORT_CHARS:])
        if report is not None:
            report.send(failure)
        else:
            print(f"rank {rank} of {world_size} failed:\n{failure.text}", file=sys.stderr)
            _record_for_torchrun(err)
        exit_now(1)
    finish_process_group()
    if report is not None:
        report.send(_Done(rank))
    exit_now()


def _record_for_torchrun(err: BaseException) -> None:
    """Write torchrun's error file (TORCHELASTIC_ERROR_FILE), so that its summary shows this
    rank's exception as the root cause."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler
        handler = get_error_handler()
        handler.initialize()
        handler.record_exception(err)
    except Exception:  # noqa: BLE001 - the error is already on stderr  # pragma: no cover
        pass


def _spawned(rank: int, fn: Callable[..., Any], world_size: int, store_port: int, backend: str,
             collective_timeout_s: float, threads: int, launcher_pid: int, report: Connection,
             stack_path: str, args: tuple[Any, ...]) -> None:
    end_with_launcher(launcher_pid, rank, kernel=True)
    if stack_path:  # the file stays open for the life of the process: faulthandler writes to it
        faulthandler.register(_STACK_SIGNAL, file=open(stack_path, "w"),  # noqa: SIM115
                              all_threads=True)
    torch.set_num_threads(threads)
    run_rank(fn, rank, world_size, args, backend=backend,
             collective_timeout_s=collective_timeout_s, store_port=store_port, report=report)


def _stack_file() -> tuple[int, str]:
    """A file with no name for one worker's stacks (Linux O_TMPFILE): the launcher's
    descriptor, and the /proc path the worker opens it by. Nothing is left on disk however
    the launcher ends (a named file would outlive a killed launcher). Elsewhere (-1, ""):
    no stacks are shown."""
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return -1, ""
    fd = os.open(tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR, 0o600)
    return fd, f"/proc/{os.getpid()}/fd/{fd}"


def _stacks(procs: list[Any], files: list[int]) -> str:
    """The Python stacks of the workers still running (faulthandler's dump on
    `_STACK_SIGNAL`), waiting up to `_STACK_WAIT_S` for them; stopped ones (SIGSTOP, a
    debugger) cannot answer and are not asked."""
    alive = [rank for rank, proc in enumerate(procs)
             if files[rank] >= 0 and proc.is_alive() and not _stopped(proc.pid)]
    for rank in alive:
        os.kill(procs[rank].pid, _STACK_SIGNAL)
    deadline = time.monotonic() + _STACK_WAIT_S
    texts = dict.fromkeys(alive, "")
    done: set[int] = set()
    while time.monotonic() < deadline and len(done) < len(alive):
        time.sleep(0.1)
        for rank in set(alive) - done:
            text = os.pread(files[rank], 1 << 20, 0).decode(errors="replace")
            if text and text == texts[rank]:  # written, and unchanged since the last look
                done.add(rank)
            texts[rank] = text
    return "".join(f"\nStacks of rank {rank}, still running:\n{texts[rank][-_REPORT_CHARS:]}"
                   for rank in alive if texts[rank])


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (Linux: state T or t in /proc; elsewhere False)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = 300.0, collective_timeout_s: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in `world_size` fresh processes joined in a
    process group on 127.0.0.1. `fn` must be importable (module level). Raises
    `WorkerError` naming the first rank that failed, with its traceback, as soon as one
    fails (the others are killed), or `WorkerTimeoutError` if the workers together exceed
    `timeout_s`."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    collective_timeout_s = collective_timeout_s or timeout_s
    threads = max(1, (os.cpu_count() or 1) // world_size)
    if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
        # inside a launcher's worker (joblib's loky): a spawned child reads the start method
        # from its parent and cannot find loky's, so fall back to the standard one
        mp.set_start_method("spawn", force=True)
    ctx = mp.get_context("spawn")
    previous = _raise_on_stop_signals()
    procs, readers, files = [], [], []
    try:
        store = host_store(world_size, collective_timeout_s)
        files, paths = zip(*(_stack_file() for _ in range(world_size)))
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_spawned, name=f"grace-rank{rank}", args=(
                rank, fn, world_size, store.port, backend, collective_timeout_s, threads,
                os.getpid(), writer, paths[rank], args))
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        failures = _watch(procs, readers, time.monotonic() + timeout_s)
        if failures:
            message, hung = _describe(failures, procs, collective_timeout_s)
            if hung:
                message += _stacks(procs, list(files))
            for proc in procs:
                proc.kill()
            raise WorkerError(message)
        if any(proc.is_alive() for proc in procs):
            raise WorkerTimeoutError(f"{world_size} local workers did not finish within "
                                f"{timeout_s:.0f} s; killed them" + _stacks(procs, list(files)))
    finally:
        _stop([proc for proc in procs if proc.is_alive()])
        for reader in readers:
            reader.close()
        for fd in files:
            if fd >= 0:
                os.close(fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_on_stop_signals() -> dict[int, Any]:
    """From the main thread: the first SIGINT or SIGTERM raises KeyboardInterrupt (its
    argument the signal's name) and later ones are ignored, so that `spawn` stops its
    workers however the launcher was signalled, and a second Ctrl-C cannot cut that short.
    Returns the handlers to restore (none off the main thread, where Python cannot set
    them)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    raised = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    return previous


def _stop(procs: list[Any]) -> None:
    """End worker processes: SIGTERM, up to `_STOP_WAIT_S` for them to exit, then SIGKILL."""
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + _STOP_WAIT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()


def _watch(procs: list[Any], readers: list[Connection],
           deadline: float) -> list[_Report | tuple[int, int]] | None:
    """Wait until every worker exited successfully (None), the deadline passed (None, some
    alive), or a worker failed: then, after `_SETTLE_S` for reports that precede it, every
    failure seen (reports, and (rank, exit code) of ranks that died without one)."""
    failures: list[_Report | tuple[int, int]] = []
    reported: set[int] = set()
    done: set[int] = set()
    open_readers = list(readers)
    settle_until = None
    while True:
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            return failures
        if all(not p.is_alive() for p in procs) and not open_readers:
            return failures or None
        if settle_until is None and now >= deadline:
            return None
        limit = settle_until if settle_until is not None else deadline
        ready = wait([*open_readers, *(p.sentinel for p in procs if p.exitcode is None)],
                     timeout=min(1.0, max(0.0, limit - now)))
        for reader in [r for r in open_readers if r in ready or r.poll()]:
            try:
                report = reader.recv()
            except (EOFError, OSError):  # the worker exited; nothing (more) to say
                open_readers.remove(reader)
                continue
            if isinstance(report, _Done):
                done.add(report.rank)
                continue
            failures.append(report)
            reported.add(report.rank)
        for rank, proc in enumerate(procs):
            if proc.sentinel in ready:
                proc.join()
                if rank not in reported and (proc.exitcode != 0 or rank not in done):
                    failures.append((rank, proc.exitcode))
                    reported.add(rank)
        if failures and settle_until is None:
            settle_until = time.monotonic() + _SETTLE_S


def _describe(failures: list[_Report | tuple[int, int]], procs: list[Any],
              collective_timeout_s: float) -> tuple[str, bool]:
    """The first failure, in order of blame: an error of a rank's own code (earliest
    first), then a rank that died without a report, then a lost or timed-out connection
    (naming the ranks still alive that never answered); and whether such ranks hung."""
    world_size = len(procs)
    own = sorted((f for f in failures if isinstance(f, _Report) and f.kind == "error"),
                 key=lambda f: f.at)
    silent = [f for f in failures if not isinstance(f, _Report)]
    lost = sorted((f for f in failures if isinstance(f, _Report) and f.kind != "error"),
                  key=lambda f: f.at)
    if own:
        f = own[0]
        return (f"worker rank {f.rank} of {world_size} failed and the other workers were "
                f"stopped. Its error:\n{f.text}"), False
    if silent:
        rank, code = silent[0]
        how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
               else f"exited with code {code}" + (" before its work was done (os._exit or a "
                                                  "library that ends the process)"
                                                  if code == 0 else ""))
        return (f"worker rank {rank} of {world_size} {how} without reporting an error; "
                "the other workers were stopped"), False
    f = lost[0]
    failed = {g.rank for g in lost}
    hung = [r for r, p in enumerate(procs) if r not in failed and p.is_alive()]
    if hung and f.kind == "timeout":
        names = ", ".join(map(str, hung))
        return (f"worker rank {names} of {world_size} did not answer within the collective "
                f"timeout ({collective_timeout_s:g} s) and was still running: it hung, was "
                "stopped or is too slow (raise trainer.collective_timeout_s if it is only "
                f"slow). The other workers were stopped. Rank {f.rank} reported:\n{f.text}"), True
    return (f"worker rank {f.rank} of {world_size} lost its connection to a peer and the "
            f"other workers were stopped. Its error:\n{f.text}"), False
