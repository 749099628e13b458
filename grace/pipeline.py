"""The Grace pipeline: memory -> compressor -> communicator for each tensor.

    g --Memory.compensate--> t --Compressor.compress--> (payload, ctx)
      Memory.update(t, name, compressor, payload, ctx)
    payload --Communicator exchange--> mean over ranks (dense)

Use `build` to assemble one from names, dicts, Hydra configs or instances.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch

from grace.communicator import Communicator, Item
from grace.compressor import Compressor
from grace.config import instantiate
from grace.exchange import Exchange, Link, Rounds, Works
from grace.memory import Memory
from grace.metrics import Metrics
from grace.needs import Need
from grace.registry import COMMUNICATORS, COMPRESSORS, MEMORIES, Registry
from grace.validation import ConfigError, check_tensor

MODEL_ITEM = "model"  # the name of the joint item of a model-level compressor

Named = Sequence[tuple[str, torch.Tensor]]


class Grace:
    """One compressor, one memory and one communicator sharing one `Metrics`.

    `check_finite` (default on) raises `NonFiniteError` naming the tensor when a gradient
    holds NaN or Inf, instead of letting a compressor drop or spread it silently.

    `needs` is what the parts need from the exchange (`grace.needs`): `step_many` gives
    a memory that needs it the norm of the tensors of its call, and `GradientExchange` (the
    DDP hook and custom loops) takes care of the rest.
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

    @property
    def needs(self) -> frozenset[Need]:
        return self.compressor.needs() | self.memory.needs()

    def needed_by(self, need: Need) -> str:
        """Labels of the parts that need `need` (for messages)."""
        return " and ".join(part.label for part in (self.compressor, self.memory)
                            if need in part.needs())

    def step(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Compress `tensor`, exchange it and return the mean over ranks (same shape/dtype).
        Every rank must call this with the same names in the same order."""
        return self.step_many([(name, tensor)])[0]

    def step_many(self, named: Named) -> list[torch.Tensor]:
        """`step` for several tensors, exchanged in as few collectives as the communicator
        allows. Pass every gradient of a step in one call where the parts need the whole
        model or the global norm (`needs`)."""
        return self.start_many(named).wait()

    def start_many(self, named: Named) -> Exchange:
        """Compress `named` on this thread and launch their exchange: ``wait()`` returns the
        means (in order, same shapes and dtypes) and ``submit(...)`` lets the later rounds
        run on the communicator's worker while this thread goes on (`grace.exchange`)."""
        metrics = self.metrics
        for name, grad in named:
            check_tensor(grad, name, finite=self.check_finite)
            if grad.is_cuda:
                metrics.sync_cuda = True
            metrics.add("dense_bytes", grad.numel() * grad.element_size())
            metrics.add("tensors", 1)
        if Need.GLOBAL_NORM in self.memory.needs():
            norms = torch.stack([torch.linalg.vector_norm(g.float()) for _, g in named])
            self.memory.set_local_norm(float(torch.linalg.vector_norm(norms)))
        if self.compressor.model_level:
            return self._start_model(named)
        live = [(name, grad) for name, grad in named if grad.numel()]
        with metrics.timer("memory_s"):
            compensated = [(name, self.memory.compensate(grad, name)) for name, grad in live]
        if live:
            metrics.add("exchanges", 1)  # the dense-allreduce baseline of grace.network

        def merge(means: list[torch.Tensor]) -> list[torch.Tensor]:
            received = iter(means)  # an empty tensor has the same shape on every rank
            return [next(received) if grad.numel() else grad.clone() for _, grad in named]

        link = self.communicator.link()
        return Exchange(self.communicator, self._rounds(compensated, link), link,
                        [name for name, _ in live], merge)

    def _rounds(self, compensated: Named, link: Link) -> Rounds:
        """Compression (with any rounds of its own), memory update and the communicator's
        exchange of one call, as one generator of rounds (`grace.exchange`)."""
        if not compensated:
            return []
        metrics = self.metrics
        compressed = yield from self._timed(self.compressor.compress_rounds(compensated, link),
                                            "compress_s")
        items: list[Item] = []
        with metrics.timer("memory_s"):
            for (name, tensor), (payload, ctx) in zip(compensated, compressed):
                self.memory.update(tensor, name, self.compressor, payload, ctx)
                items.append((payload, ctx, name))
        means = yield from self.communicator.exchange(items, link)
        if self.memory.wants_mean:
            with metrics.timer("memory_s"):
                for (name, tensor), (_, ctx, _), mean in zip(compensated, items, means):
                    self.memory.update_mean(tensor, name, self.compressor, ctx, mean)
        return means

    def _timed(self, rounds: Generator[Works, None, Any], key: str
               ) -> Generator[Works, None, Any]:
        """`rounds`, with the time spent advancing it (not waiting for its collectives)
        added to `key`."""
        while True:
            with self.metrics.timer(key):
                try:
                    works = next(rounds)
                except StopIteration as stop:
                    result = stop.value
                    break
            yield works
        return result

    def _start_model(self, named: Named) -> Exchange:
        """`start_many` for model-level compressors (`Compressor.compress_model`): compensate
        every tensor, compress all of them in one call, update the memory with each tensor's
        selection, and exchange one joint payload whose mean is the concatenation of every
        tensor's mean (flattened, in order)."""
        metrics = self.metrics
        live = [(name, grad) for name, grad in named if grad.numel()]
        if not live:
            return self.communicator.start([], lambda _: [grad.clone() for _, grad in named])
        with metrics.timer("memory_s"):
            compensated = [(name, self.memory.compensate(grad, name)) for name, grad in live]
        selections, payload, ctx = self._timed_compress(self.compressor.compress_model,
                                                        compensated)
        with metrics.timer("memory_s"):
            for (name, tensor), (sel_payload, sel_ctx) in zip(compensated, selections):
                self.memory.update(tensor, name, self.compressor, sel_payload, sel_ctx)
        metrics.add("exchanges", 1)

        def split(means: list[torch.Tensor]) -> list[torch.Tensor]:
            parts = iter(means[0].split([grad.numel() for _, grad in live]))
            return [next(parts).view_as(grad) if grad.numel() else grad.clone()
                    for _, grad in named]

        return self.communicator.start([(payload, ctx, MODEL_ITEM)], split)

    def _timed_compress(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a compression function, adding its time to ``compress_s`` except the time
        of its own collectives (PowerSGD's first round, LGC's index broadcast), which the
        communicator's primitives add to ``comm_s`` on this thread."""
        comm_before = self.metrics.added_here("comm_s")
        with self.metrics.timer("compress_s"):
            result = fn(*args)
        self.metrics.add("compress_s", comm_before - self.metrics.added_here("comm_s"))
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
