"""Shared test helpers: composing the Hydra configs and running functions on several ranks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from grace.launch import spawn

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def compose_train(*overrides: str) -> DictConfig:
    """The training config with command-line style overrides."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any,
              timeout_s: float = 120) -> None:
    """Run ``fn(rank, world_size, *args)`` on `world_size` Gloo ranks over loopback. `fn`
    must live at module level in a test module; assertion errors inside it fail the test
    with the worker's traceback, and a hang fails it after `timeout_s`."""
    spawn(fn, world_size, *args, timeout_s=timeout_s, collective_timeout_s=min(60, timeout_s))
