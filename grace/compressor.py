"""The Compressor abstraction (GRACE, Xu et al. 2021, Sec. 3).

A compressor turns one tensor into a *payload* (a tuple of tensors: exactly what goes on the
wire) and a *ctx* (local metadata needed to decompress). A receiver decompresses a peer's
payload with its own ctx, so whatever `decompress` reads from ctx must be identical on every
rank (shape, dtype, step, shared-seed state).
"""

from __future__ import annotations

import copy
import copyreg
from abc import ABC, abstractmethod
from collections.abc import Generator, Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from gracecomm.buffers import difference
from gracecomm.exchange import Link, Works
from gracecomm.needs import Need
from gracecomm.part import Part
from gracecomm.validation import ConfigError

Payload = tuple[torch.Tensor, ...]
"""What goes on the wire for one tensor: a tuple of tensors, whose bytes are what a method is
credited with (counted by the communicator)."""
PayloadSpec = tuple[tuple[torch.dtype, int], ...]  # (dtype, numel) of each payload tensor
WARM_UP_NUMEL = 65536 - 17  # within one chunk of the fused kernels: their serial paths, which
# every process runs (ranks with one thread run nothing else) and which a launcher that warms
# up while checking the config shares with its ranks through numba's on-disk cache; threaded
# paths compile when a process first splits a tensor over threads
# a wrapper's adopted training defaults are read-only mappings; `warm_up` deep-copies it
copyreg.pickle(MappingProxyType, lambda m: (MappingProxyType, (dict(m),)))


@dataclass(frozen=True)
class Capabilities:
    """What one compressor, with its options, offers the rest of the library; the fields
    are described in `Compressor` (``Compressor.capabilities`` returns them)."""

    summable: bool
    fixed_size: bool
    default_memory: str
    default_communicator: str
    communicators: tuple[str, ...] | None
    elementwise: bool
    model_level: bool


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of the tensor a payload came from (the usual ctx).

    Attributes:
        shape: The tensor's shape.
        dtype: Its dtype.

    Example:
        >>> import torch
        >>> from gracecomm import TensorInfo
        >>> TensorInfo.of(torch.zeros(2, 3)).numel
        6
    """

    shape: torch.Size
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorInfo:
        """The shape and dtype of `tensor`.

        Args:
            tensor: Any tensor.

        Returns:
            Its `TensorInfo`.
        """
        return cls(tensor.shape, tensor.dtype)

    @property
    def numel(self) -> int:
        """The number of elements of the tensor."""
        return self.shape.numel()


class Compressor(Part, ABC, kind="compressor"):
    """Base class of all compressors.

    Capabilities: a class declares them as class attributes, and `capabilities()` is the one
    place they are read from (communicators, `gracecomm.build`, the trainer): it returns the
    class's declarations, and a compressor whose capabilities depend on its options (or on
    its parts) overrides it; no instance overwrites the class attributes.

    - ``summable``: payloads of all ranks may be summed element-wise before decompressing
      (and `decompress` is linear), so the allreduce communicator can carry them.
    - ``fixed_size``: payload tensor sizes depend only on the input's shape (and on the phase
      `layout_phase` names, which every rank shares), so they are equal on every rank and
      need not be exchanged before each collective.
    - ``default_communicator``, ``default_memory``: what `gracecomm.build` and the Hydra config
      pick when the user names none (biased methods bring error feedback).
    - ``communicators``: if set, the only communicators this compressor works with (methods
      with collectives of their own).
    - ``elementwise``: deterministic, with no per-tensor state or statistics, so that the
      payload of a concatenation is the concatenation of the payloads: with a memory that
      keeps nothing (`Memory.identity`) the pipeline compresses a run of tensors that lie
      back to back in memory (a DDP bucket's gradients) as one tensor, with the same result.
    - ``model_level``: the method compresses every gradient of a step at once (LGC
      concatenates all layers): it implements `compress_model` instead of `compress`, and
      needs `Need.WHOLE_MODEL` from the exchange.

    What it needs from the exchange beyond that (`needs`) is honoured by the library: see
    `gracecomm.needs`.

    What the method needs from its training loop, as data (wrappers take their parts'):

    - ``training_defaults``: trainer options the method needs to train, by option name
      (signSGD's ``{"lr": 0.0005}``: its update moves every coordinate by +-lr). Trainers apply
      them to the options the user did not set (`gracecomm.experiments.method_defaults`).
    - ``sensitivities``: the settings the method is known to be sensitive to, one sentence
      each, which a trainer names when a run collapses or diverges.

    A subclass implements `compress` and `decompress` (or, ``model_level``,
    `compress_model`) and registers itself (``@COMPRESSORS.register("name")``), which
    makes ``compressor=name`` a command-line choice (`gracecomm.configstore`); the rest has
    defaults.

    Example:
        Scaled sign: one byte per element and the mean magnitude, biased, so it brings
        error feedback.

        >>> import torch
        >>> from gracecomm import Compressor, TensorInfo
        >>> class ScaledSign(Compressor):
        ...     default_memory = "residual"
        ...     def compress(self, tensor, name):
        ...         scale = tensor.abs().mean().reshape(1)
        ...         return (tensor.sign().to(torch.int8), scale), TensorInfo.of(tensor)
        ...     def decompress(self, payload, ctx):
        ...         signs, scale = payload
        ...         return (signs.to(ctx.dtype) * scale).reshape(ctx.shape)
        >>> payload, ctx = ScaledSign().compress(torch.tensor([1.0, -3.0]), "w")
        >>> ScaledSign().decompress(payload, ctx)
        tensor([ 2., -2.])
    """

    summable: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = False
    default_communicator: ClassVar[str] = "allgather"
    default_memory: ClassVar[str] = "none"
    communicators: ClassVar[tuple[str, ...] | None] = None
    elementwise: ClassVar[bool] = False
    model_level: ClassVar[bool] = False
    training_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    sensitivities: ClassVar[tuple[str, ...]] = ()

    def capabilities(self) -> Capabilities:
        """This compressor's capabilities, the one place they are read from.

        Returns:
            By default its class's declarations; a compressor whose capabilities depend on
            its options (or its parts) overrides this.
        """
        return Capabilities(self.summable, self.fixed_size, self.default_memory,
                            self.default_communicator, self.communicators, self.elementwise,
                            self.model_level)

    def payload_spec(self, info: TensorInfo) -> PayloadSpec | None:
        """For a compressor of fixed size: the layout of the payload of a tensor, so that a
        receiver can split the concatenated bytes of a payload without sizes on the wire
        (DeepReduce's value codec over any compressor).

        Args:
            info: The shape and dtype of the tensor.

        Returns:
            The (dtype, element count) of each payload tensor, or None where the compressor
            does not say.
        """
        return None

    def layout_phase(self, ctx: Any) -> Hashable:
        """For a compressor of fixed size whose payload layout changes once with state that
        every rank shares (PowerSGD's dense warm-up): the phase of a payload.
        Communicators agree on a layout once per set of tensors and phase.

        Args:
            ctx: The ctx the payload came with.

        Returns:
            The phase (None by default: one layout).
        """
        return None

    def needs(self) -> frozenset[Need]:
        """What this compressor needs from the exchange.

        Returns:
            Its requirements (`gracecomm.needs`): `Need.WHOLE_MODEL` where ``model_level``.
        """
        return (frozenset({Need.WHOLE_MODEL}) if self.capabilities().model_level
                else frozenset())

    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        """Compress one tensor.

        Args:
            tensor: The tensor to compress (contiguous, floating point, finite).
            name: Its name, which keys any per-tensor state.

        Returns:
            (payload, ctx): the tensors that go on the wire, and local metadata that
            `decompress` reads (the same on every rank, see the module docstring).
        """

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Rebuild a dense tensor from a payload, this rank's or a peer's.

        Args:
            payload: The payload.
            ctx: This rank's ctx for the same tensor.

        Returns:
            A dense tensor of the original shape and dtype.

        Raises:
            PayloadError: The payload is malformed (a peer's index out of range).
        """

    def subtract_decompressed(self, t: torch.Tensor, payload: Payload, ctx: Any,
                              in_place: bool = False) -> torch.Tensor:
        """Error feedback's update, ``t - decompress(payload, ctx)``.

        A method with a cheaper form of the same bits overrides this (a sparse selection
        subtracts its k values where they were taken; the sign methods decode and subtract
        in one pass). Here the payload or ctx may still view `t`, so `t` is kept.

        Args:
            t: The compressed tensor.
            payload: Its payload.
            ctx: Its ctx.
            in_place: The caller owns `t`: a method whose payload and ctx never view their
                input may write the result into `t`.

        Returns:
            The difference, as a new tensor (a recycled buffer when large) or `t`.
        """
        return difference(t, self.decompress(payload, ctx))

    def compress_rounds(self, named: Sequence[tuple[str, torch.Tensor]], link: Link
                        ) -> Generator[Works, None, list[tuple[Payload, Any]]]:
        """Compress the tensors of one exchange (one DDP bucket), as rounds of collectives.

        By default `compress` each, without collectives. A method whose compression needs
        collectives of its own (PowerSGD's first allreduce) launches them through `link`
        and yields them (`gracecomm.exchange`), so they run asynchronously like the
        exchange.

        Args:
            named: (name, tensor) pairs.
            link: The exchange's accounted collectives.

        Returns:
            A generator of rounds that returns (payload, ctx) for each tensor, in order.
        """
        return [self.compress(tensor, name) for name, tensor in named]
        yield  # a generator: no round

    def feeds_back(self, ctx: Any) -> bool:
        """Whether error feedback applies to a tensor this step.

        Args:
            ctx: The tensor's ctx.

        Returns:
            True by default; False during a dense warm-up that bypasses the memory, as
            PyTorch's PowerSGD hook does.
        """
        return True

    def compress_model(self, named: Sequence[tuple[str, torch.Tensor]]
                       ) -> tuple[list[tuple[Payload, Any]], Payload, Any]:
        """Model-level compressors (``model_level``): compress every tensor of a step at once,
        using the accounted collectives of ``self.comm`` where needed.

        Args:
            named: (name, tensor) pairs: every gradient of the step, in the model's order.

        Returns:
            (selections, payload, ctx): per tensor, the (payload, ctx) its memory sees (the
            selection before any joint re-encoding, e.g. Top-k's values and indices, which
            `decompress` turns into the part of the tensor that was transmitted, so error
            feedback keeps the rest); then one joint payload and ctx for the communicator,
            whose mean over ranks decompresses to the flat concatenation of all tensors.

        Raises:
            NotImplementedError: The class sets ``model_level`` but does not implement it.
        """
        raise NotImplementedError(f"{self.label} sets model_level but does not implement "
                                  "compress_model")

    def transmitted(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """The elements a payload carries (momentum factor masking in DGC's memory).

        Args:
            payload: The payload.
            ctx: Its ctx.

        Returns:
            A flat bool mask: by default the nonzeros of the decompression; sparse and
            dense methods answer exactly.
        """
        return self.decompress(payload, ctx).reshape(-1) != 0

    def aggregate(self, payloads: Sequence[Payload], ctx: Any) -> torch.Tensor:
        """The mean over ranks of the decompressed payloads. Sparse methods override this
        with one scatter, quantizers with kernels that decode every rank's payload into
        one sum a block at a time.

        Args:
            payloads: Every rank's payload for one tensor, in rank order (so every rank
                computes the same bits).
            ctx: This rank's ctx for the tensor.

        Returns:
            The mean, a dense tensor of the original shape and dtype.

        Raises:
            PayloadError: A payload is malformed.
        """
        total = self.decompress(payloads[0], ctx).clone()  # a decompression may be a view
        for payload in payloads[1:]:
            total.add_(self.decompress(payload, ctx))
        return total.div_(len(payloads))

    def warm_up(self) -> None:
        """Compile, or load from numba's on-disk cache, the kernels this compressor runs, so
        that the first training step does not pay for them: a cold cache compiles for
        seconds to tens of seconds, and even a warm one costs numba about 2 s per process to
        set up. The pipeline calls it once when it is built. A copy of the compressor
        compresses and decompresses a float32 CPU tensor (and, if not summable, aggregates
        one payload per rank of its communicator); the compressor, its state and its
        metrics are untouched (other dtypes load their kernels on first use). Methods with
        collectives of their own (``communicators``) or ``model_level`` ones skip it; one
        that cannot compress this tensor stays cold (its first step reports the error)."""
        caps = self.capabilities()
        if caps.model_level or caps.communicators is not None:
            return
        ranks = self.comm.world_size if self.comm is not None else 1
        twin = copy.deepcopy(self, {id(self.comm): None})
        try:
            payload, ctx = twin.compress(torch.linspace(-1.0, 1.0, WARM_UP_NUMEL), "warm_up")
            twin.decompress(payload, ctx)
            if ranks > 1 and not caps.summable:  # receive kernels compile per number of ranks
                twin.aggregate([payload] * ranks, ctx)
        except Exception:  # noqa: BLE001 - a speed-up only: the first step reports any error
            return

    def adopt_training_needs(self, parts: Sequence[Compressor]) -> None:
        """For wrappers: take the ``training_defaults`` and ``sensitivities`` of the
        compressors inside.

        Args:
            parts: The compressors inside this one.

        Raises:
            ConfigError: Two parts need different values of one trainer option.
        """
        defaults: dict[str, Any] = {}
        for part in parts:
            for option, value in part.training_defaults.items():
                if defaults.setdefault(option, value) != value:
                    raise ConfigError(f"{self.label}: its parts need different values of "
                                      f"trainer option '{option}' ({defaults[option]} and "
                                      f"{value} from {part.label}); combine other parts")
        self.training_defaults = MappingProxyType(defaults)
        self.sensitivities = tuple(dict.fromkeys(s for p in parts for s in p.sensitivities))

    def set_epoch(self, epoch: int) -> None:
        """Hook for schedules that change with the epoch (DGC's warm-up of the ratio); by
        default passed on to the compressors inside this one.

        Args:
            epoch: The epoch about to start, from 0.
        """
        for part in self.nearest(Compressor):
            part.set_epoch(epoch)
