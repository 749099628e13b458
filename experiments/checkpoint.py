"""Checkpoints that resume bit-identically.

Each rank writes its own file (``rank<r>.pt``): compression state such as error-feedback
residuals differs between ranks. A file holds the model and optimizer state, the position in
the data (epoch and batches done in it), every RNG stream the loop draws from, the whole
``Grace.state_dict()`` and the running totals of the summary. Files are written atomically
(temporary file, then rename) and read with ``torch.load(..., weights_only=True)``: only
tensors and plain Python values, nothing is unpickled as arbitrary objects.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grace.validation import ConfigError

FORMAT_VERSION = 1


@dataclass
class Position:
    """Where training stands: `step` optimizer steps done, `batch` batches of `epoch` done."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


def rng_state() -> dict[str, Any]:
    """Every RNG stream the training loop uses, as tensors and plain values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32),
                         np_state["pos"], np_state["has_gauss"], np_state["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def path_for(directory: str | os.PathLike[str], rank: int) -> Path:
    return Path(directory) / f"rank{rank}.pt"


def save(directory: str | os.PathLike[str], rank: int, world_size: int, position: Position,
         model: torch.nn.Module, optimizer: torch.optim.Optimizer, grace_state: dict[str, Any],
         totals: dict[str, float], fingerprint: str,
         logger_state: dict[str, Any] | None = None) -> Path:
    """Write this rank's checkpoint atomically and return its path. `logger_state` is what
    the metrics logger needs to continue (rank 0's W&B run id)."""
    target = path_for(directory, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "version": FORMAT_VERSION, "rank": rank, "world_size": world_size,
        "fingerprint": fingerprint,
        "position": {"step": position.step, "epoch": position.epoch, "batch": position.batch},
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "grace": grace_state, "rng": rng_state(), "totals": dict(totals),
        "logger": dict(logger_state or {}),
    }
    tmp = target.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, target)
    return target


def load(directory: str | os.PathLike[str], rank: int, world_size: int,
         fingerprint: str) -> dict[str, Any]:
    """Read this rank's checkpoint, refusing one written by another set-up."""
    source = path_for(directory, rank)
    if not source.exists():
        raise ConfigError(f"trainer: option 'resume' points to {directory}, which has no "
                          f"checkpoint for rank {rank} ({source.name})")
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt or foreign file: say which one
        raise ConfigError(f"checkpoint {source} cannot be read safely: {err}") from None
    if state.get("version") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {source} has format version {state.get('version')}, "
                          f"this code reads version {FORMAT_VERSION}")
    if state["world_size"] != world_size:
        raise ConfigError(f"checkpoint {source} was written by {state['world_size']} ranks; "
                          f"this run has {world_size}")
    if state["fingerprint"] != fingerprint:
        raise ConfigError(f"checkpoint {source} was written with a different compressor, "
                          "memory, communicator or model set-up; resume with the same config")
    return state


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """`directory` if it holds a rank-0 checkpoint, else None."""
    return Path(directory) if path_for(directory, 0).exists() else None
