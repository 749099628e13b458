"""The Grace pipeline: memory -> compressor -> communicator for each tensor.

    g --Memory.compensate--> t --Compressor.compress--> (payload, ctx)
      Memory.update(t, name, compressor, payload, ctx)
    payload --Communicator.send_receive--> mean over ranks (dense)

Use `build` to assemble one from names, dicts, Hydra configs or instances.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from grace.communicator import Communicator, Item
from grace.compressor import Compressor
from grace.config import instantiate
from grace.memory import Memory
from grace.metrics import Metrics
from grace.registry import COMMUNICATORS, COMPRESSORS, MEMORIES, Registry
from grace.validation import ConfigError, check_tensor

MODEL_ITEM = "model"  # the name of the joint item of a model-level compressor


class Grace:
    """One compressor, one memory and one communicator sharing one `Metrics`.

    `check_finite` (default on) raises `NonFiniteError` naming the tensor when a gradient
    holds NaN or Inf, instead of letting a compressor drop or spread it silently.
    """

    def __init__(self, compressor: Compressor, memory: Memory, communicator: Communicator,
                 *, check_finite: bool = True) -> None:
        for obj, base, what in ((compressor, Compressor, "compressor"), (memory, Memory, "memory"),
                                (communicator, Communicator, "communicator")):
            if not isinstance(obj, base):
                raise ConfigError(f"{what} must be a {base.__module__}.{base.__name__}, "
                                  f"got {type(obj).__name__}")
        self.compressor = compressor
        self.memory = memory
        self.communicator = communicator
        self.check_finite = check_finite
        self.metrics = Metrics()
        memory.check(compressor)
        communicator.bind(compressor, self.metrics)
        compressor.bind(communicator, self.metrics)
        memory.bind(self.metrics)

    def __repr__(self) -> str:
        return (f"Grace(compressor={self.compressor.registry_name!r}, "
                f"memory={self.memory.registry_name!r}, "
                f"communicator={self.communicator.registry_name!r})")

    def step(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Compress `tensor`, exchange it and return the mean over ranks (same shape/dtype).
        Every rank must call this with the same names in the same order."""
        return self.step_many([(name, tensor)])[0]

    def step_many(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """`step` for several tensors, exchanged in as few collectives as the communicator
        allows (the DDP hook passes one bucket at a time)."""
        items: list[Item] = []
        outputs: list[torch.Tensor | None] = []
        metrics = self.metrics
        for name, grad in named:
            check_tensor(grad, name, finite=self.check_finite)
            if grad.is_cuda:
                metrics.sync_cuda = True
            metrics.add("dense_bytes", grad.numel() * grad.element_size())
            metrics.add("tensors", 1)
        if self.compressor.model_level:
            return self._step_model(named)
        for name, grad in named:
            if grad.numel() == 0:  # same shape on every rank: nothing to exchange
                outputs.append(grad.clone())
                continue
            with metrics.timer("memory_s"):
                compensated = self.memory.compensate(grad, name)
            payload, ctx = self._timed_compress(self.compressor.compress, compensated, name)
            with metrics.timer("memory_s"):
                self.memory.update(compensated, name, self.compressor, payload, ctx)
            items.append((payload, ctx, name))
            outputs.append(None)
        if items:
            metrics.add("exchanges", 1)  # the dense-allreduce baseline of grace.network
        received = iter(self.communicator.send_receive_many(items) if items else [])
        return [out if out is not None else next(received) for out in outputs]

    def _step_model(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """`step_many` for model-level compressors (`Compressor.compress_model`): compensate
        every tensor, compress all of them in one call, update the memory with each tensor's
        selection, and exchange one joint payload whose mean is the concatenation of every
        tensor's mean (flattened, in order)."""
        metrics = self.metrics
        live = [(name, grad) for name, grad in named if grad.numel()]
        if not live:
            return [grad.clone() for _, grad in named]
        with metrics.timer("memory_s"):
            compensated = [(name, self.memory.compensate(grad, name)) for name, grad in live]
        selections, payload, ctx = self._timed_compress(self.compressor.compress_model,
                                                        compensated)
        with metrics.timer("memory_s"):
            for (name, tensor), (sel_payload, sel_ctx) in zip(compensated, selections):
                self.memory.update(tensor, name, self.compressor, sel_payload, sel_ctx)
        metrics.add("exchanges", 1)
        flat = self.communicator.send_receive_many([(payload, ctx, MODEL_ITEM)])[0]
        means = iter(flat.split([grad.numel() for _, grad in live]))
        return [next(means).view_as(grad) if grad.numel() else grad.clone() for _, grad in named]

    def _timed_compress(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a compression function, adding its time to ``compress_s`` except the time
        of its own collectives (PowerSGD's first round, LGC's index broadcast), which the
        communicator's primitives already add to ``comm_s``."""
        comm_before = self.metrics.get("comm_s")
        with self.metrics.timer("compress_s"):
            result = fn(*args)
        self.metrics.add("compress_s", comm_before - self.metrics.get("comm_s"))
        return result

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to schedules (e.g. a warm-up of the compression ratio)."""
        self.compressor.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically: compressor, memory and communicator
        state (plain tensors and Python values; loadable with ``weights_only=True``)."""
        return {"compressor": self.compressor.state_dict(), "memory": self.memory.state_dict(),
                "communicator": self.communicator.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        self.communicator.load_state_dict(state["communicator"])


Spec = str | Mapping[str, Any] | Compressor | Memory | Communicator | None


def make_part(spec: Spec, registry: Registry, base: type) -> Any:
    """An instance of `base` from a registry name, a mapping with ``name`` (and options) or
    ``_target_``, or an instance (returned as is). Wrappers such as DeepReduce use it for
    their nested parts."""
    if isinstance(spec, base):
        return spec
    if isinstance(spec, str):
        return registry.create(spec)
    if isinstance(spec, Mapping):
        if "_target_" in spec:
            return instantiate(spec)
        params = dict(spec)
        if "name" not in params:
            raise ConfigError(f"a {registry.kind} given as a mapping needs 'name' or "
                              f"'_target_'; got keys {sorted(params)}")
        return registry.create(params.pop("name"), **params)
    raise ConfigError(f"{registry.kind} must be a name, a mapping or a {base.__name__}, "
                      f"got {type(spec).__name__}")


def build(compressor: Spec = "none", memory: Spec = None, communicator: Spec = None,
          *, check_finite: bool = True) -> Grace:
    """Assemble a pipeline. Each part may be a registry name (``"topk"``), a mapping with
    ``name`` and options (``{"name": "topk", "ratio": 0.01}``), a Hydra config with
    ``_target_``, or an instance. A memory or communicator left out is the compressor's
    default (e.g. Top-k brings residual memory and allgather; summable methods allreduce).

        grace = build({"name": "topk", "ratio": 0.01})
    """
    comp = make_part(compressor, COMPRESSORS, Compressor)
    mem = make_part(memory if memory is not None else comp.default_memory, MEMORIES, Memory)
    comm = make_part(communicator if communicator is not None else comp.default_communicator,
                 COMMUNICATORS, Communicator)
    return Grace(comp, mem, comm, check_finite=check_finite)
