"""Shared test helpers: composing the Hydra configs and running functions on several ranks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from grace.launch import spawn
from gracecomm.experiments.train import compose_config as compose_train  # noqa: F401

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any,
              timeout_s: float = 120) -> None:
    """Run ``fn(rank, world_size, *args)`` on `world_size` Gloo ranks over loopback. `fn`
    must live at module level in a test module; assertion errors inside it fail the test
    with the worker's traceback, and a hang fails it after `timeout_s`."""
    spawn(fn, world_size, *args, timeout_s=timeout_s, collective_timeout_s=min(60, timeout_s))
