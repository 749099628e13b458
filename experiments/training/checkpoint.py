"""Checkpoints that resume bit-identically and cannot tear.

Each rank writes its own file (``rank<r>-step<N>.pt``): compression state such as
error-feedback residuals differs between ranks. A file holds the model and optimizer state,
the position in the data (epoch and batches done in it), every RNG stream the loop draws
from, the whole ``Grace.state_dict()`` and the running totals of the summary.

A checkpoint is complete only once ``manifest.json`` names it, and the manifest is written
last: every rank writes its file atomically (temporary file, fsync, rename), the ranks then
exchange the step, size and SHA-256 of their files, and only then is the manifest replaced
(again atomically) and the files of older steps removed. A run killed at any moment leaves
the previous complete checkpoint intact; a file that does not match the manifest (torn,
truncated, hand-edited, from another step) is refused, naming the rank, as is a directory
whose ranks disagree, and so is a manifest that is not what this module writes (every
field is checked before it is used). Files are read with ``torch.load(...,
weights_only=True)``: only tensors and plain Python values, nothing is unpickled as arbitrary
objects. A write that fails (a full disk) leaves no temporary or unlisted file behind.

The manifest also records the run's settings (`settings`: everything that decides what the
next step computes), so that a resumed run can be refused when it would compute other steps
(`compare_settings`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gracecomm.state import load_state
from gracecomm.validation import ConfigError

FORMAT_VERSION = 3  # 3: the manifest records the run's settings
MANIFEST = "manifest.json"


@dataclass
class Position:
    """Where training stands: `step` optimizer steps done, `batch` batches of `epoch` done."""

    step: int = 0
    epoch: int = 0
    batch: int = 0

    def check(self, batches_per_epoch: int, source: str) -> None:
        """Steps count batches, so ``step = epoch * batches_per_epoch + batch``: refuse a
        position that breaks this (hand-edited, or saved with another batch size, data set
        or world size), naming `source`."""
        if not (0 <= self.batch <= batches_per_epoch and self.epoch >= 0
                and self.step == self.epoch * batches_per_epoch + self.batch):
            raise ConfigError(
                f"{source} holds position step {self.step}, epoch {self.epoch}, batch "
                f"{self.batch}, which is not a position of this run ({batches_per_epoch} "
                "batches per epoch: step = epoch * batches + batch); it was edited or written "
                "with another batch size, data set or world size")


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


def file_name(rank: int, step: int) -> str:
    return f"rank{rank}-step{step}.pt"


def _write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file next to `path`, flush it to disk, then rename it
    over `path`: a reader sees the old file or the whole new one, never a torn one. If any
    of it fails (a full disk), the temporary file is removed and the error names `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OSError(err.errno, f"checkpoint: writing {path} ({len(data)} bytes) failed: "
                                     f"{err.strerror or err}; the last complete checkpoint "
                                     f"in {path.parent} is intact") from err
        raise


def _entries(step: int, size: int, digest: str) -> list[tuple[int, int, str]]:
    """(step, bytes, sha256) of every rank's file, exchanged as fixed-size tensors."""
    mine = torch.tensor([step, size, *bytes.fromhex(digest)], dtype=torch.int64)
    if not (dist.is_available() and dist.is_initialized()):
        return [(step, size, digest)]
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [(int(e[0]), int(e[1]), bytes(e[2:].tolist()).hex()) for e in everyone]


def save(directory: str | os.PathLike[str], rank: int, world_size: int, position: Position,
         model: torch.nn.Module, optimizer: torch.optim.Optimizer, grace_state: dict[str, Any],
         totals: dict[str, float], fingerprint: str,
         logger_state: dict[str, Any] | None = None,
         settings: dict[str, Any] | None = None) -> Path:
    """Write this rank's checkpoint, then (once every rank has written its own) the manifest.
    Every rank must call this at the same step (it is one collective). `logger_state` is
    what the metrics logger needs to continue (rank 0's W&B run id); `settings` (plain
    values by dotted name) are recorded in the manifest. If it fails, this rank's new file
    is removed unless a manifest already names it."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "version": FORMAT_VERSION, "rank": rank, "world_size": world_size,
        "fingerprint": fingerprint, "position": asdict(position),
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "grace": grace_state, "rng": rng_state(), "totals": dict(totals),
        "logger": dict(logger_state or {}),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    target = folder / file_name(rank, position.step)
    listed = _listed_step(folder) == position.step  # saved at this step before (resumed)
    _write_atomically(target, data)
    try:
        entries = _entries(position.step, len(data), hashlib.sha256(data).hexdigest())
        if len({step for step, _, _ in entries}) > 1:
            raise RuntimeError(f"ranks saved checkpoints at different steps: "
                               f"{[step for step, _, _ in entries]}")
        manifest = {"version": FORMAT_VERSION, "step": position.step, "world_size": world_size,
                    "fingerprint": fingerprint, "settings": dict(settings or {}),
                    "ranks": [{"file": file_name(r, step), "bytes": size, "sha256": digest}
                              for r, (step, size, digest) in enumerate(entries)]}
        _write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    except BaseException:
        if not listed and _listed_step(folder) != position.step:
            target.unlink(missing_ok=True)  # no manifest names it: nothing would read it
        raise
    for old in folder.glob(f"rank{rank}-step*.pt"):
        if old != target:
            old.unlink(missing_ok=True)
    return target


def _listed_step(folder: Path) -> int | None:
    """The step of `folder`'s manifest, if it has a readable one."""
    try:
        return int(json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(directory: str | os.PathLike[str], world_size: int,
             ranks: list[int] | None = None) -> dict[str, Any]:
    """The manifest of `directory`, after checking it and the files of `ranks` (default:
    all) against it; `ConfigError` naming the rank and file that do not match."""
    folder = Path(directory)
    where = f"trainer: option 'resume' points to {folder}"
    try:
        text = (folder / MANIFEST).read_text(encoding="utf-8")
    except OSError:
        raise ConfigError(f"{where}, which holds no complete checkpoint ({MANIFEST} is "
                          "missing: nothing was saved there, or the run was stopped before "
                          "its first checkpoint was complete)") from None
    try:
        found = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{where}, whose {MANIFEST} is not JSON ({err})") from None
    version = found.get("version") if isinstance(found, dict) else None
    if isinstance(found, dict) and version != FORMAT_VERSION:
        raise ConfigError(f"{where}, written in checkpoint format {version}; this code reads "
                          f"format {FORMAT_VERSION} (which records the run's settings): "
                          "resume it with the version that wrote it, or start a new run")
    _check_fields(found, where)
    step, entries = found["step"], found["ranks"]
    if found["world_size"] != world_size or len(entries) != world_size:
        raise ConfigError(f"{where}, written by {found['world_size']} ranks; this run has "
                          f"{world_size}: each rank's state is a file of its own, so resume "
                          f"with trainer.world_size={found['world_size']} (torchrun: "
                          f"--nproc_per_node), or start a new run")
    for rank in range(world_size) if ranks is None else ranks:
        entry = entries[rank]
        if entry["file"] != file_name(rank, step):
            raise ConfigError(f"{where}: its {MANIFEST} (step {step}) names file "
                              f"{entry['file']!r} for rank {rank}")
        path = folder / entry["file"]
        if not path.exists():
            others = sorted(p.name for p in folder.glob(f"rank{rank}-step*.pt"))
            raise ConfigError(f"{where}: rank {rank}'s checkpoint of step {step} "
                              f"({entry['file']}) is missing (rank {rank} has "
                              f"{', '.join(others) or 'no file'}); the ranks disagree")
        size = path.stat().st_size
        if size != entry["bytes"] or _sha256(path) != entry["sha256"]:
            raise ConfigError(f"{where}: rank {rank}'s file {entry['file']} ({size} bytes) "
                              f"is not the one its {MANIFEST} recorded ({entry['bytes']} "
                              "bytes, SHA-256 differs): it was truncated, edited or replaced")
    return found


# What a manifest holds: field -> (what it must be, check)
_FIELDS: dict[str, tuple[str, Any]] = {
    "step": ("an integer >= 0", lambda v: _integer(v) and v >= 0),
    "world_size": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
    "fingerprint": ("a string", lambda v: isinstance(v, str)),
    "settings": ("an object of settings", lambda v: isinstance(v, dict)),
    "ranks": ("a list of objects with file, bytes and sha256",
              lambda v: isinstance(v, list) and all(_entry(e) for e in v)),
}


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("file"), str)
            and _integer(entry.get("bytes")) and entry["bytes"] >= 0
            and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64)


def _check_fields(found: Any, where: str) -> None:
    """`ConfigError` naming the first field of a manifest that is missing or malformed."""
    if not isinstance(found, dict):
        raise ConfigError(f"{where}, whose {MANIFEST} is malformed: it holds a "
                          f"{type(found).__name__}, not an object")
    for field, (what, ok) in _FIELDS.items():
        if field not in found or not ok(found[field]):
            got = repr(found.get(field, "nothing"))[:80]
            raise ConfigError(f"{where}, whose {MANIFEST} is malformed: '{field}' must be "
                              f"{what}, got {got}; it was edited or not written by gracecomm")


def load(directory: str | os.PathLike[str], rank: int, world_size: int,
         fingerprint: str) -> dict[str, Any]:
    """Read this rank's file of the manifest's step, refusing one written by another
    set-up or that does not match the manifest; the run's settings recorded in the manifest
    are under ``settings``."""
    found = manifest(directory, world_size, [rank])
    source = Path(directory) / found["ranks"][rank]["file"]
    state = load_state(source, f"checkpoint {source}")
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint {source} holds a {type(state).__name__}, not a "
                          "checkpoint (a dict of its rank's state)")
    if state.get("version") != FORMAT_VERSION or state.get("rank") != rank:
        raise ConfigError(f"checkpoint {source} is not rank {rank}'s file of format "
                          f"{FORMAT_VERSION} (it says rank {state.get('rank')}, format "
                          f"{state.get('version')})")
    if state["position"]["step"] != found["step"]:
        raise ConfigError(f"checkpoint {source} holds step {state['position']['step']}, "
                          f"its {MANIFEST} says step {found['step']}")
    if state["fingerprint"] != fingerprint or found.get("fingerprint") != fingerprint:
        raise ConfigError(f"checkpoint {source} was written with a different compressor, "
                          "memory, communicator or model set-up; resume with the same config")
    state["settings"] = found["settings"]
    return state


def _tensors(state: Any, path: str = "") -> Iterator[tuple[str, str, torch.Tensor]]:
    """(path, last key, tensor) of every tensor in a nested state."""
    if isinstance(state, dict):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield f"{path}.{key}", str(key), value
            else:
                yield from _tensors(value, f"{path}.{key}")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _tensors(value, f"{path}[{i}]")


def check_shapes(state: dict[str, Any], model: torch.nn.Module, source: str) -> None:
    """Refuse, naming the part, state whose tensors cannot belong to `model`: per-parameter
    optimizer state (momentum, Adam's moments) and memory state kept per gradient (residuals,
    DGC's u and v) must have their parameter's shape. `load_state_dict` of the model checks
    the model; the optimizer and the memories would take any shape silently."""
    params = list(model.named_parameters())
    by_name = {name: p for name, p in params}
    for index, per_param in state["optimizer"].get("state", {}).items():
        name, param = params[int(index)]
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                raise ConfigError(f"{source}: optimizer state '{key}' of parameter '{name}' "
                                  f"has shape {list(value.shape)}, the parameter has "
                                  f"{list(param.shape)}")
    for path, key, value in _tensors(state["grace"]["memory"], "memory"):
        if key in by_name and value.shape != by_name[key].shape:
            raise ConfigError(f"{source}: {path} has shape {list(value.shape)}, but the "
                              f"memory keeps it per gradient of parameter '{key}', whose "
                              f"shape is {list(by_name[key].shape)}")
