"""The Grace pipeline: memory -> compressor -> communicator for each tensor.

    g --Memory.compensate--> t --Compressor.compress--> (payload, ctx)
      Memory.update(t, name, compressor, payload, ctx)
    payload --Communicator exchange--> mean over ranks (dense)

Use `build` to assemble one from names, dicts, Hydra configs or instances.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch

from gracecomm.communicator import Communicator, Item
from gracecomm.compressor import Compressor, Payload
from gracecomm.config import instantiate
from gracecomm.exchange import Exchange, Link, Rounds, Works
from gracecomm.memory import Memory
from gracecomm.metrics import Metrics
from gracecomm.needs import Need
from gracecomm.registry import COMMUNICATORS, COMPRESSORS, MEMORIES, Registry
from gracecomm.state import Stateful
from gracecomm.validation import (
    ConfigError,
    NonFiniteError,
    PayloadError,
    check_tensor,
    is_finite,
    nonfinite_among,
)
from gracecomm.wire import contiguous_runs, flat_run

MODEL_ITEM = "model"  # the name of the joint item of a model-level compressor

Named = Sequence[tuple[str, torch.Tensor]]


class Grace(Stateful):
    """One compressor, one memory and one communicator sharing one `Metrics`.

    Non-finite gradients: with `check_finite` (the default) a gradient holding NaN or Inf
    raises `NonFiniteError` naming the tensor, instead of letting a compressor drop or spread
    it silently. Without it (runs with a `torch.amp.GradScaler`, which overflows on purpose)
    a step where any rank's gradient is non-finite passes through: every rank receives NaN
    for the tensors of that exchange, so the scaler skips the step on every rank, and the
    compression state (residuals, momentum, PowerSGD's Q, SIDCo's stages, LGC's autoencoder,
    random streams) is restored to what it was before the step, so the next finite step goes
    on from there. A step is one `step_many` call, or one DDP step of the hook.

    `needs` is what the parts need from the exchange (`gracecomm.needs`): `step_many` gives
    a memory that needs it the norm of the tensors of its call, and `GradientExchange` (the
    DDP hook and custom loops) takes care of the rest.

    `state_dict` holds everything needed to resume bit-identically: the three parts' states
    (plain tensors and Python values; loadable with ``weights_only=True``).

    Most users build one with `build`; the constructor takes instances.

    Args:
        compressor: The compressor (`Compressor`).
        memory: The memory around it (`Memory`), checked against the compressor.
        communicator: The communicator that carries its payloads (`Communicator`).
        check_finite: Raise `NonFiniteError` on a non-finite tensor (True), or pass
            non-finite steps through (False; see above).

    Raises:
        ConfigError: A part is not an instance of its role's base class.
        IncompatibleError: The memory or the communicator cannot work with the compressor
            (e.g. allreduce with Top-k, whose payloads cannot be summed).

    Attributes:
        compressor: The pipeline's compressor.
        memory: The pipeline's memory.
        communicator: The pipeline's communicator.
        metrics: The statistics the three parts share (`Metrics`); ``metrics.pop()`` returns
            and clears one step's.

    Example:
        >>> import torch
        >>> from gracecomm import Grace, create
        >>> grace = Grace(create("compressor", "topk", ratio=0.1), create("memory", "residual"),
        ...               create("communicator", "allgather"))
        >>> grace.step(torch.arange(10.0), "w")  # one process: the mean of one rank
        tensor([0., 0., 0., 0., 0., 0., 0., 0., 0., 9.])
    """

    child_attrs = ("compressor", "memory", "communicator")

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
        self.check_finite = bool(check_finite)
        self.metrics = Metrics()
        self._before_step: dict[str, Any] | None = None  # the state to restore (pass-through)
        self._nonfinite_step = False
        memory.check(compressor)
        communicator.attach(compressor)
        for part in (communicator, compressor, memory):
            part.bind(communicator, self.metrics)
        compressor.warm_up()  # its kernels are loaded now, not in the first step

    def __repr__(self) -> str:
        return (f"Grace(compressor={self.compressor.registry_name!r}, "
                f"memory={self.memory.registry_name!r}, "
                f"communicator={self.communicator.registry_name!r})")

    @property
    def needs(self) -> frozenset[Need]:
        """What the compressor and the memory need from the exchange (`gracecomm.needs`)."""
        return self.compressor.needs() | self.memory.needs()

    def needed_by(self, need: Need) -> str:
        """The labels of the parts that need `need`, for messages.

        Args:
            need: One requirement (`Need`).

        Returns:
            ``"compressor 'dgc' and memory 'dgc'"``, or ``""`` if no part needs it.
        """
        return " and ".join(part.label for part in (self.compressor, self.memory)
                            if need in part.needs())

    def step(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Compress one tensor, exchange it and return the mean over ranks: one step.

        Every rank must call it with the same names in the same order.

        Args:
            tensor: A floating-point tensor (a gradient), on any device.
            name: Its name, which keys per-tensor state (the residual, PowerSGD's Q).

        Returns:
            The mean over ranks, of `tensor`'s shape and dtype.

        Raises:
            NonFiniteError: `tensor` holds NaN or Inf and the pipeline checks
                (``check_finite``).
            TypeError: `tensor` is not a floating-point tensor (the message names it).
            PayloadError: A peer's payload is malformed.
            CommunicationError: A peer died or hung past the collective timeout.

        Example:
            >>> import torch, gracecomm
            >>> grace = gracecomm.build("fp16")
            >>> grace.step(torch.tensor([0.5, -2.0]), "w")
            tensor([ 0.5000, -2.0000])
        """
        return self.step_many([(name, tensor)])[0]

    def step_many(self, named: Named) -> list[torch.Tensor]:
        """`step` for several tensors, exchanged in as few collectives as the communicator
        allows; one step (see the class docstring).

        Pass every gradient of a step in one call where the parts need the whole model or
        the global norm (`needs`).

        Args:
            named: (name, tensor) pairs, in the same order on every rank.

        Returns:
            The mean over ranks of each tensor, in order, of its shape and dtype.

        Raises:
            NonFiniteError: A tensor holds NaN or Inf (with ``check_finite``).
            PayloadError: A peer's payload is malformed.
            CommunicationError: A peer died or hung past the collective timeout.

        Example:
            >>> import torch, gracecomm
            >>> grace = gracecomm.build({"name": "topk", "ratio": 0.5})
            >>> means = grace.step_many([("w", torch.tensor([1.0, -3.0])),
            ...                          ("b", torch.tensor([0.25, 0.0]))])
            >>> torch.cat(means).tolist()  # Top-k kept -3.0 of w and 0.25 of b
            [0.0, -3.0, 0.25, 0.0]
        """
        means = self.start_many(named).wait()
        self.end_step()
        return means

    def start_many(self, named: Named) -> Exchange:
        """Compress `named` on this thread and launch their exchange, without waiting.

        ``wait()`` on the result returns the means (in order, same shapes and dtypes) and
        ``submit()`` lets the later rounds run on the communicator's worker while this
        thread goes on (`gracecomm.exchange`). The call is part of the current step until
        `end_step` (`step_many` is ``start_many(named).wait()`` then ``end_step()``).

        Args:
            named: (name, tensor) pairs, in the same order on every rank.

        Returns:
            The started `gracecomm.exchange.Exchange`.

        Raises:
            NonFiniteError: A tensor holds NaN or Inf (with ``check_finite``).
        """
        metrics = self.metrics
        for name, grad in named:
            check_tensor(grad, name)
            if grad.is_cuda:
                metrics.sync_cuda = True
        dense = sum(g.numel() * g.element_size() for _, g in named)
        metrics.add("dense_bytes", dense)
        metrics.add("tensors", len(named))
        if not self.check_finite and self._before_step is None:
            self._before_step = snapshot(self.state_dict())
        if Need.GLOBAL_NORM in self.memory.needs():
            norms = torch.stack([torch.linalg.vector_norm(g.float()) for _, g in named])
            self.memory.set_local_norm(float(torch.linalg.vector_norm(norms)))
        # detached: no state a part keeps may hold an autograd graph
        live = [(name, grad.detach().contiguous()) for name, grad in named if grad.numel()]
        with metrics.timer("memory_s"):
            compensated = self.memory.compensate_many(live)
        runs = contiguous_runs([t for _, t in compensated])
        finite = self._finite(live, compensated, runs)
        if not finite:  # compressed as zeros; the step's state is restored at `end_step`
            compensated = [(name, torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0))
                           for name, t in compensated]
            runs = [range(i, i + 1) for i in range(len(compensated))]
        if live:
            metrics.add("exchanges", 1)  # the dense-allreduce baseline of gracecomm.network
        link = self.communicator.link(None if self.check_finite else not finite)
        link.max_nbytes = 4 * dense + 65536  # no peer's payload may announce more
        if self.compressor.capabilities().model_level:
            rounds = self._model_rounds(compensated, link)
        elif self.joins_runs:
            rounds = self._run_rounds(compensated, runs, link)
        else:
            rounds = self._rounds(compensated, link)

        def merge(means: list[torch.Tensor]) -> list[torch.Tensor]:
            received = iter(means)  # an empty tensor has the same shape on every rank
            return [next(received) if grad.numel() else grad.clone() for _, grad in named]

        return Exchange(self.communicator, rounds, link, [name for name, _ in live], merge)

    @property
    def joins_runs(self) -> bool:
        """Whether tensors that lie back to back in memory are compressed and exchanged as
        one: an elementwise compressor with a memory that keeps nothing. A DDP bucket can
        then be passed whole, with the same result."""
        caps = self.compressor.capabilities()
        return not caps.model_level and self.memory.identity and caps.elementwise

    def _finite(self, grads: Named, compensated: Named, runs: Sequence[range]) -> bool:
        """Whether every tensor to compress is finite (one read each, one call for each of
        the `runs` of tensors back to back in memory, `gracecomm.wire.contiguous_runs`); with
        `check_finite`, raise `NonFiniteError` naming the first that is not, and whether the
        gradient or the error feedback added to it was non-finite."""
        tensors = [t for _, t in compensated]
        flats = [flat_run(tensors[run.start:run.stop]) for run in runs]
        for j in nonfinite_among(flats):
            for i in runs[j]:
                if not self._finite_one(grads[i], compensated[i]):
                    return False
        return True

    def _finite_one(self, grad: tuple[str, torch.Tensor], compensated: tuple[str, torch.Tensor]
                    ) -> bool:
        """`_finite` for one tensor."""
        name, tensor = compensated
        if is_finite(tensor, name):
            return True
        if not self.check_finite:
            return False
        is_finite(grad[1], name, raise_error=True)
        raise NonFiniteError(
            f"tensor '{name}': adding {self.memory.label}'s error feedback to its finite "
            "gradient overflowed (values beyond the dtype's range); scale the loss or the "
            "gradients down")

    def end_step(self) -> None:
        """Close the step that `start_many` calls opened.

        Where an exchange of the step carried a non-finite gradient on any rank (without
        ``check_finite``), the compression state from before the step is restored (class
        docstring)."""
        if self._nonfinite_step:
            self.load_state_dict(self._before_step)
            self.metrics.add("nonfinite_steps", 1)
        self._before_step, self._nonfinite_step = None, False

    def _rounds(self, compensated: Named, link: Link) -> Rounds:
        """Compression (with any rounds of its own), memory update and the communicator's
        exchange of one call, as one generator of rounds (`gracecomm.exchange`)."""
        if not compensated:
            return []
        metrics = self.metrics
        compressed = yield from self._timed(self.compressor.compress_rounds(compensated, link),
                                            "compress_s")
        items: list[Item] = []
        with metrics.timer("memory_s"):
            for (name, tensor), (payload, ctx) in zip(compensated, compressed):
                self._update_memory(tensor, name, payload, ctx)
                items.append((payload, ctx, name))
        means = yield from self.communicator.exchange(items, link)
        if link.any_nonfinite:
            self._nonfinite_step = True
            return [torch.full_like(t, math.nan) for _, t in compensated]
        if self.memory.wants_mean:
            with metrics.timer("memory_s"):
                self.memory.update_mean_many(compensated, self.compressor,
                                             [ctx for _, ctx, _ in items], means)
        return means

    def _run_rounds(self, compensated: Named, runs: Sequence[range], link: Link) -> Rounds:
        """`_rounds` for an elementwise compressor with a memory that keeps nothing
        (`Capabilities.elementwise`): each run of tensors that lie back to back in memory
        (a DDP bucket's gradients) is compressed and exchanged as one tensor, named after its
        first, and its mean split back into the tensors' shapes."""
        tensors = [t for _, t in compensated]
        if len(runs) == len(tensors):  # nothing to join
            return (yield from self._rounds(compensated, link))
        joint = [(compensated[run.start][0], flat_run(tensors[run.start:run.stop]))
                 for run in runs]
        means = yield from self._rounds(joint, link)
        parts = [mean.reshape(-1).split([tensors[i].numel() for i in run])
                 for run, mean in zip(runs, means)]
        return [part.view_as(tensors[i]) for run, split in zip(runs, parts)
                for i, part in zip(run, split)]

    def _update_memory(self, tensor: torch.Tensor, name: str, payload: Payload,
                       ctx: Any) -> None:
        """`Memory.update` with this rank's own payload; a malformed one names the rank."""
        try:
            self.memory.update(tensor, name, self.compressor, payload, ctx)
        except PayloadError as err:
            raise PayloadError(f"{self.compressor.label} on rank {self.communicator.rank} "
                               f"produced a malformed payload for tensor '{name}': {err}"
                               ) from err

    def _model_rounds(self, compensated: Named, link: Link) -> Rounds:
        """`_rounds` for model-level compressors (`Compressor.compress_model`): compress
        every tensor in one call, update the memory with each tensor's selection, and
        exchange one joint payload whose mean is the concatenation of every tensor's mean
        (flattened, in order)."""
        if not compensated:
            return []
        metrics = self.metrics
        selections, payload, ctx = self._timed_compress(self.compressor.compress_model,
                                                        compensated)
        with metrics.timer("memory_s"):
            for (name, tensor), (sel_payload, sel_ctx) in zip(compensated, selections):
                self._update_memory(tensor, name, sel_payload, sel_ctx)
        means = yield from self.communicator.exchange([(payload, ctx, MODEL_ITEM)], link)
        if link.any_nonfinite:
            self._nonfinite_step = True
            return [torch.full_like(t, math.nan) for _, t in compensated]
        return [part.view_as(t) for part, (_, t) in
                zip(means[0].split([t.numel() for _, t in compensated]), compensated)]

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
        """Tell schedules that change with the epoch (DGC's warm-up of the ratio) which one
        begins.

        Args:
            epoch: The epoch about to start, from 0.
        """
        self.compressor.set_epoch(epoch)



def snapshot(state: Any) -> Any:
    """A copy of a nested state dict whose containers are new and whose tensors are the
    parts' own: valid as long as the parts replace their state tensors instead of writing
    into them, which every part does (tests/test_nonfinite.py and tests/test_core.py
    check it)."""
    if isinstance(state, Mapping):
        return {key: snapshot(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(value) for value in state)
    return state


Spec = str | Mapping[str, Any] | Compressor | Memory | Communicator | None


def make_part(spec: Spec, registry: Registry, base: type) -> Any:
    """One part from any of the forms `build` takes; wrappers such as DeepReduce use it for
    their nested parts.

    Args:
        spec: A registry name, a mapping with ``name`` (and options) or ``_target_``, or an
            instance of `base` (returned as is).
        registry: Where names are looked up (`COMPRESSORS`, ...).
        base: The class the part must be an instance of.

    Returns:
        The part.

    Raises:
        ConfigError: An unknown name or option, a mapping without ``name`` or ``_target_``,
            or a value of another type.
    """
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
    """Assemble a pipeline from names, mappings, Hydra configs or instances.

    This is the one place where a compressor's default memory and communicator are applied
    (the trainer's ``memory=auto`` and ``communicator=auto`` too). A memory or communicator
    left out (or ``"auto"``) is the compressor's default, which may depend on its options
    (Top-k brings residual memory and allgather; summable methods bring allreduce).

    Args:
        compressor: A registry name (``"topk"``; `available` lists them), a mapping with
            ``name`` and options (``{"name": "topk", "ratio": 0.01}``), a config with
            ``_target_``, or a `Compressor` instance.
        memory: The same forms for the memory; None or ``"auto"``: the compressor's
            default.
        communicator: The same forms for the communicator; None or ``"auto"``: the
            compressor's default.
        check_finite: Raise `NonFiniteError` on a non-finite gradient (True), or let a
            step with one pass through for a loss scaler to skip (False; see `Grace`).

    Returns:
        The assembled `Grace` pipeline, its compressor's kernels already loaded.

    Raises:
        ConfigError: An unknown name (the message lists the valid ones), an unknown or
            invalid option (the message names it and what is allowed), or a ``_target_``
            that is not a registered part (old ``grace.*`` paths name the new one).
        IncompatibleError: The parts cannot work together (allreduce with Top-k).
        MissingDependencyError: The chosen option needs a package that is not installed.

    Example:
        >>> import gracecomm
        >>> gracecomm.build({"name": "topk", "ratio": 0.01})
        Grace(compressor='topk', memory='residual', communicator='allgather')
        >>> gracecomm.build("fp16", communicator="allgather")
        Grace(compressor='fp16', memory='none', communicator='allgather')
    """
    comp = make_part(compressor, COMPRESSORS, Compressor)
    caps = comp.capabilities()
    mem = make_part(default_part(memory, caps.default_memory), MEMORIES, Memory)
    comm = make_part(default_part(communicator, caps.default_communicator), COMMUNICATORS,
                     Communicator)
    return Grace(comp, mem, comm, check_finite=check_finite)


AUTO = "auto"  # a memory or communicator chosen by the compressor


def default_part(spec: Spec, default: str) -> Spec:
    """`spec`, or the compressor's `default` name where `spec` is None or ``"auto"``."""
    return default if spec is None or (isinstance(spec, str) and spec == AUTO) else spec
