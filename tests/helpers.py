"""Shared test helpers: composing the Hydra configs and running functions on several ranks."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gracecomm.experiments.train import compose_config as compose_train  # noqa: F401

from grace.launch import spawn

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any,
              timeout_s: float = 120) -> None:
    """Run ``fn(rank, world_size, *args)`` on `world_size` Gloo ranks over loopback. `fn`
    must live at module level in a test module; assertion errors inside it fail the test
    with the worker's traceback, and a hang fails it after `timeout_s`."""
    spawn(fn, world_size, *args, timeout_s=timeout_s, collective_timeout_s=min(60, timeout_s))


def free_port() -> int:
    """A port free on 127.0.0.1 now, for launching ranks the way torchrun does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
