"""Shared test helpers: composing the Hydra configs, running functions on several ranks,
walking the registry's combinations and comparing nested state dicts."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gracecomm
from gracecomm.experiments.training.config import compose_config as compose_train  # noqa: F401
from gracecomm.experiments.training.launch import spawn
from gracecomm.registry import COMMUNICATORS, COMPRESSORS, MEMORIES
from gracecomm.validation import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def slow_dtypes(*dtypes: torch.dtype) -> list[Any]:
    """`dtypes` as parameters of the slow tier: each compiles its own numba kernels (seconds
    each on a fresh machine), so the fast tier checks float32 and the whole suite the rest."""
    return [pytest.param(d, marks=pytest.mark.slow, id=str(d).removeprefix("torch."))
            for d in dtypes]


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any,
              timeout_s: float = 120) -> None:
    """Run ``fn(rank, world_size, *args)`` on `world_size` Gloo ranks over loopback. `fn`
    must live at module level in a test module; assertion errors inside it fail the test
    with the worker's traceback, and a hang fails it after `timeout_s`."""
    spawn(fn, world_size, *args, timeout_s=timeout_s, collective_timeout_s=min(60, timeout_s))


def agreed_on_every_rank(out: torch.Tensor, what: object) -> None:
    """Assert that `out` is finite and bit for bit the same on every rank of the default
    group (`what` names the case in a failure)."""
    every = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(every, out)
    assert torch.isfinite(out).all(), what
    assert all(torch.equal(e, out) for e in every), what


def buildable(combos: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    """The (compressor, memory, communicator) specs of `combos` that `gracecomm.build` takes
    with its defaults (flat, every tensor compressed); the others are no combination to
    vary."""
    for combo in combos:
        try:
            gracecomm.build(*combo)
        except ConfigError:  # IncompatibleError too
            continue
        yield combo


def registered_combinations() -> list[tuple[str, str, str]]:
    """Every registered compressor x memory x communicator, by name."""
    return [(c, m, k) for c in COMPRESSORS.available() for m in MEMORIES.available()
            for k in COMMUNICATORS.available()]


def free_port() -> int:
    """A port free on 127.0.0.1 now, for launching ranks the way torchrun does, drawn below
    the kernel's ephemeral range (``net.ipv4.ip_local_port_range``, 32768 and up by
    default): a port the kernel handed out could be given again, to another process's
    ``bind(0)`` or outgoing connection, before rank 0 listens on it (EADDRINUSE)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(low // 2, low), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 between {low // 2} and {low}")


def state_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a nested state dict."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in state_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in state_tensors(v)]
    return []


def same(a: Any, b: Any) -> bool:
    """Whether two nested state dicts hold equal values (tensors bit for bit)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def console_script(name: str, tmp_path: Path, *args: str,
                   timeout: float = 240) -> subprocess.CompletedProcess:
    """Run an installed command (``gracecomm-train``, ...) of this environment in `tmp_path`,
    its Hydra run directory under it, and capture its output."""
    exe = Path(sys.executable).parent / name
    return subprocess.run([str(exe), *args, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)


def experiment_dir(tmp_path: Path, name: str, text: str) -> Path:
    """A config directory (for ``--config-dir``) holding the experiment `name`: a
    ``_global_`` YAML file with `text`."""
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True, exist_ok=True)
    (conf / "experiment" / f"{name}.yaml").write_text(f"# @package _global_\n{text}")
    return conf
