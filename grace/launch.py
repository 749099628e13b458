"""Starting and joining process groups: local workers on Gloo over loopback, or the group a
launcher such as `torchrun` prepared. torch.distributed is the engine; this only wires it up.

Every wait is bounded: `spawn` kills all workers and raises when they outlive `timeout_s`,
and process groups are created with a collective timeout so a dead peer ends the run with
an error instead of a hang.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_GRACE_S = 3.0  # after a worker fails: seconds for the others to stop, then SIGTERM, SIGKILL


class WorkerTimeout(TimeoutError):
    """Local workers did not finish within the allowed time."""


class WorkerError(RuntimeError):
    """A local worker died or raised; the others were stopped."""


def launched_externally() -> bool:
    """True under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    return all(v in os.environ for v in LAUNCHER_VARS)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_process_group(backend: str, rank: int, world_size: int, *, timeout_s: float,
                       master_port: int | None = None) -> None:
    """Join a process group. With `master_port`, a local group on 127.0.0.1; otherwise the
    launcher's environment (MASTER_ADDR, MASTER_PORT) is used."""
    if master_port is not None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def finish_process_group() -> None:
    """Wait for every rank, then destroy the group (tearing down connections a peer still
    uses makes Gloo abort at exit)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def _worker(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str,
            timeout_s: float, threads: int, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)
    init_process_group(backend, rank, world_size, timeout_s=timeout_s, master_port=port)
    try:
        fn(rank, world_size, *args)
    finally:
        finish_process_group()
    exit_now()


def exit_now(code: int = 0) -> None:
    """End a worker whose work is done and whose process group is destroyed, skipping the
    interpreter's teardown: C++ threads of communication and kernel libraries (Gloo,
    numba's thread pool) are sometimes still joinable when static destructors run, and the
    process then aborts ("terminate called without an active exception") after a
    successful run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = 300.0, collective_timeout_s: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in `world_size` fresh processes joined in a
    process group on 127.0.0.1. `fn` must be importable (module level). Raises if a worker
    fails (with its traceback) or if the workers together exceed `timeout_s`."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
        # inside a launcher's worker (joblib's loky): a spawned child reads the start method
        # from its parent and cannot find loky's, so fall back to the standard one
        mp.set_start_method("spawn", force=True)
    ctx = mp.start_processes(
        _worker, nprocs=world_size, join=False, start_method="spawn",
        args=(fn, world_size, free_port(), backend,
              collective_timeout_s or timeout_s, threads, args))
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=min(1.0, max(0.0, deadline - time.monotonic())),
                           grace_period=_GRACE_S):
            if time.monotonic() >= deadline:
                raise WorkerTimeout(f"{world_size} local workers did not finish within "
                                    f"{timeout_s:.0f} s; killed them")
    except mp.ProcessExitedException as err:
        how = (f"was killed by signal {err.signal_name}" if err.signal_name
               else f"exited with code {err.exit_code}")
        raise WorkerError(f"worker rank {err.error_index} of {world_size} {how} without "
                          "reporting an error; the other workers were stopped") from None
    except mp.ProcessRaisedException as err:
        hint = ("\n(A peer did not answer within the collective timeout: it died, hung or is "
                "too slow; raise trainer.collective_timeout_s if it is only slow.)"
                if "Timed out" in str(err) else "")
        raise WorkerError(f"worker rank {err.error_index} of {world_size} failed and the other "
                          f"workers were stopped. Its error:\n{err}{hint}") from None
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()
