"""What the training-framework integrations share (`gracecomm.lightning`,
`gracecomm.accelerate`, `gracecomm.hf`): attaching the DDP hook to the model a framework
wrapped, the figures its logger shows, and the compression state in its checkpoints.

Every rank keeps its own compression state (its residuals differ from its peers'), while a
framework's checkpoint is written by one rank. `gather_state` collects every rank's state on
rank 0 (serialised with `torch.save` and sent as bytes in tensors, never pickled objects),
and `restore_state` gives each rank its own entry back, read with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gracecomm.ddp import GradientExchange, check_optimizer, register_comm_hook
from gracecomm.hierarchy import FLAT
from gracecomm.pipeline import Grace, Spec, build
from gracecomm.state import load_state
from gracecomm.validation import ConfigError

STATE_FILE = "gracecomm.pt"  # the compression state in a framework's checkpoint folder
STATE_FORMAT = 1
PREFIX = "gracecomm/"  # of the metrics a framework logs


def pipeline(compressor: Spec | Grace, memory: Spec, communicator: Spec, *,
             check_finite: bool = True, hierarchy: str | None = None) -> Grace:
    """A built pipeline as given (its ``hierarchy`` set where given,
    `Grace.use_hierarchy`), or `gracecomm.build` of the part specs."""
    if isinstance(compressor, Grace):
        if memory is not None or communicator is not None:
            raise ConfigError("a built pipeline (gracecomm.Grace) was given with a memory or "
                              "communicator: give the parts to build, or the pipeline alone")
        compressor.use_hierarchy(hierarchy)
        return compressor
    return build(compressor, memory, communicator, check_finite=check_finite,
                 hierarchy=FLAT if hierarchy is None else hierarchy)


def attach(model: Any, grace: Grace, optimizers: Sequence[torch.optim.Optimizer], *,
           framework: str, fix: str, weight_decay: float = 0.0, asynchronous: bool = True,
           scaler: torch.amp.GradScaler | None = None,
           hierarchy: str | None = None) -> GradientExchange:
    """`register_comm_hook` on the model `framework` wrapped, checking every optimizer it
    created; a model that is not DDP (the framework runs one process) is refused with `fix`
    (how to start several)."""
    if not isinstance(model, DistributedDataParallel):
        raise ConfigError(f"{framework} did not wrap the model in DistributedDataParallel "
                          f"(it is a {type(model).__name__}), so the gradients would never "
                          f"reach the gracecomm hook and train uncompressed: {fix}")
    for optimizer in optimizers:
        check_optimizer(grace, optimizer)
    return register_comm_hook(model, grace, optimizers[0] if optimizers else None,
                              weight_decay=weight_decay, asynchronous=asynchronous,
                              scaler=scaler, hierarchy=hierarchy)


def logged_metrics(stats: Mapping[str, float]) -> dict[str, float]:
    """The figures of one step (or the means of several) that a framework's logger shows,
    named ``gracecomm/...``: payload bytes per rank (``wire_bytes``) and the gradients'
    bytes (``dense_bytes``), their ratio (``compression_factor``), the seconds spent
    compressing, decompressing and in the memory (``compression_s``), waiting for
    communication (``comm_s``), and the steps a GradScaler's overflow passed through
    (``nonfinite_steps``)."""
    out = {key: float(stats.get(key, 0.0))
           for key in ("wire_bytes", "dense_bytes", "comm_s", "nonfinite_steps")}
    if out["wire_bytes"] > 0:
        out["compression_factor"] = out["dense_bytes"] / out["wire_bytes"]
    out["compression_s"] = sum(float(stats.get(key, 0.0))
                               for key in ("compress_s", "decompress_s", "memory_s"))
    return {PREFIX + key: value for key, value in out.items()}


class MetricsWindow:
    """Per-step statistics summed between two log calls of a framework that logs every N
    steps (`means` is per step)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add(self, stats: Mapping[str, float]) -> None:
        for key, value in stats.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.steps += 1

    def means(self) -> dict[str, float]:
        """`logged_metrics` of the per-step means since the last call; empty if no step."""
        if not self.steps:
            return {}
        means = {key: value / self.steps for key, value in self.sums.items()}
        self.sums, self.steps = {}, 0
        return logged_metrics(means)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _bytes_device() -> torch.device:
    """Where the default group's collectives take byte tensors: CPU unless it runs only
    NCCL."""
    backend = str(dist.get_backend())
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _to(state: Any, device: torch.device) -> Any:
    """A nested state with every tensor on `device`."""
    if isinstance(state, torch.Tensor):
        return state.detach().to(device)
    if isinstance(state, Mapping):
        return {key: _to(value, device) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to(value, device) for value in state)
    return state


def parts_of(grace: Grace) -> str:
    """The pipeline's parts, as a state file records them and messages name them."""
    return ", ".join(part.label for part in (grace.compressor, grace.memory, grace.communicator))


def gather_state(grace: Grace) -> dict[str, Any] | None:
    """Every rank's ``grace.state_dict()`` on rank 0 (None elsewhere), each as the bytes of
    `torch.save` in a uint8 tensor, with the pipeline's parts (`parts_of`). A collective:
    every rank calls it at the same point."""
    buffer = io.BytesIO()
    torch.save(_to(grace.state_dict(), torch.device("cpu")), buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    rank, world = _world()
    if world == 1:
        return {"format": STATE_FORMAT, "world_size": 1, "parts": parts_of(grace),
                "ranks": [data]}
    device = _bytes_device()
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    width = max(int(s) for s in sizes)
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data.to(device)
    out = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, out, dst=0)
    if out is None:
        return None
    return {"format": STATE_FORMAT, "world_size": world, "parts": parts_of(grace),
            "ranks": [o[:int(s)].cpu() for o, s in zip(out, sizes)]}


def restore_state(grace: Grace, saved: Any, device: torch.device, source: str) -> None:
    """Load this rank's entry of `gather_state`'s output into `grace` (tensors on `device`).
    A checkpoint without one (written before compression was attached) leaves the state as
    it is, with a warning. One of another world size or of other parts (another method), or
    malformed in any way, is refused with `ConfigError` naming `source` and what is wrong;
    the pipeline's state is then as it was."""
    rank, world = _world()
    if saved is None:
        if rank == 0:
            warnings.warn(f"{source} holds no gracecomm compression state: compression "
                          "starts afresh (empty residuals and counters)", UserWarning,
                          stacklevel=3)
        return
    form = (f"a dict of 'format' {STATE_FORMAT}, 'world_size' (the number of ranks), 'parts' "
            "and 'ranks' (one uint8 tensor per rank), as gracecomm writes it")
    if not isinstance(saved, Mapping) or saved.get("format") != STATE_FORMAT:
        raise ConfigError(f"{source}: its gracecomm state is not of format {STATE_FORMAT} "
                          f"(it must be {form})")
    size, ranks, parts = saved.get("world_size"), saved.get("ranks"), saved.get("parts")
    if type(size) is not int or size < 1:
        raise ConfigError(f"{source}: its gracecomm state's 'world_size' is {size!r}; it must "
                          f"be a positive integer (the state must be {form})")
    if size != world:
        raise ConfigError(f"{source} holds the compression state of {size} "
                          f"ranks, this run has {world}: every rank's residuals are its "
                          "own, so resume with the same number of processes")
    if not isinstance(ranks, (list, tuple)) or len(ranks) != size or not all(
            isinstance(r, torch.Tensor) and r.dtype == torch.uint8 and r.dim() == 1
            for r in ranks):
        raise ConfigError(f"{source}: its gracecomm state's 'ranks' must be {size} uint8 "
                          f"tensor(s) of one dimension, one per rank (the state must be {form})")
    if parts is not None and parts != parts_of(grace):
        raise ConfigError(f"{source} holds the compression state of {parts}, but this run "
                          f"compresses with {parts_of(grace)}: resume with the method that "
                          "wrote it, or start without its checkpoint")
    what = f"{source}: rank {rank}'s gracecomm state"
    state = load_state(io.BytesIO(ranks[rank].cpu().numpy().tobytes()), what)
    if not isinstance(state, dict):
        raise ConfigError(f"{what} is a {type(state).__name__}, not a state dict")
    before = grace.state_dict()
    try:
        grace.load_state_dict(_to(state, device))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as err:
        grace.load_state_dict(before)
        raise ConfigError(f"{what} does not fit this pipeline ({parts_of(grace)}): "
                          f"{type(err).__name__}: {err}") from None


def save_state_file(grace: Grace, folder: str | os.PathLike[str]) -> None:
    """`gather_state` into ``folder/gracecomm.pt``, written by rank 0 (every rank calls)."""
    saved = gather_state(grace)
    if saved is None:
        return
    path = Path(folder) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(saved, partial)
    os.replace(partial, path)


def load_state_file(grace: Grace, folder: str | os.PathLike[str],
                    device: torch.device) -> None:
    """`restore_state` from ``folder/gracecomm.pt`` (every rank reads the file)."""
    path = Path(folder) / STATE_FILE
    source = f"compression state file {path}"
    saved = load_state(path, source) if path.exists() else None
    restore_state(grace, saved, device, source if saved is not None else f"checkpoint {folder}")
