"""The Communicator abstraction: moves payloads between ranks and returns the mean over ranks.

A communicator describes one exchange as rounds of asynchronous collectives (`exchange`, a
generator: see `gracecomm.exchange`), so the same description runs synchronously (`send_receive`,
`send_receive_many`) or overlapped with the backward pass (`start`, which the DDP hook uses).

Communicators are the only place where bytes are counted: ``wire_bytes`` is the sum of
numel * element_size over the payload tensors this rank contributes, ``sent_bytes`` adds the
size headers and padding that the collectives really carry. Compressors with collectives of
their own (PowerSGD's first round, LGC's index broadcast) use the accounted primitives below
through ``compressor.comm`` so their bytes are counted the same way.

Without an initialised process group a communicator acts as a world of one rank, so the
pipeline also runs in a single process (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import Any, ClassVar

import torch

from gracecomm.compressor import Compressor, Payload
from gracecomm.exchange import Collectives, Exchange, Link, Rounds, Works
from gracecomm.part import Part
from gracecomm.validation import IncompatibleError, PayloadError, check_choice, nonfinite_among
from gracecomm.wire import DTYPES, dtype_code, from_bytes, to_bytes

Item = tuple[Payload, Any, str]  # (payload, ctx, tensor name)


class Communicator(Part, Collectives, ABC, kind="communicator"):
    """Base class of all communicators: the exchange of payloads (`exchange`) on top of the
    process group and accounted collectives of `gracecomm.exchange.Collectives`.

    Args:
        group: The process group to exchange on (None: the default group).
        checksum: Append a CRC-32 of its payload bytes to what each rank sends, checked
            on receipt (`PayloadError` naming the rank whose bytes were corrupted).

    Raises:
        ConfigError: `checksum` is not a bool.

    A subclass implements `exchange` and registers itself
    (``@COMMUNICATORS.register("name")``); the helpers below serialise payloads, exchange
    their sizes and check what peers send.

    Example:
        In one process a communicator is a world of one rank:

        >>> import torch, gracecomm
        >>> grace = gracecomm.build({"name": "topk", "ratio": 0.5})
        >>> payload, ctx = grace.compressor.compress(torch.tensor([1.0, -3.0]), "w")
        >>> grace.communicator.send_receive(payload, ctx, "w")
        tensor([ 0., -3.])
        >>> grace.metrics.pop()["wire_bytes"]  # one float32 value and one int32 index
        8.0
    """

    sums_payloads: ClassVar[bool] = False  # each rank decompresses one summed payload

    def __init__(self, group: Any = None, checksum: bool = False) -> None:
        super().__init__()
        self.group = group
        self.checksum = check_choice(checksum, (False, True), self.label, "checksum")
        self.compressor: Compressor | None = None
        self._agreed: dict[tuple[tuple[str, Hashable], ...], list[tuple[int, torch.dtype]]] = {}
        # fixed payload layouts, per tensors and phase

    # -- set-up ---------------------------------------------------------------------------
    def check(self, compressor: Compressor) -> None:
        """Check that this communicator can carry a compressor's payloads.

        Args:
            compressor: The compressor.

        Raises:
            IncompatibleError: It cannot (the message names the communicator to set).
        """
        allowed = compressor.capabilities().communicators
        if allowed is not None and self.registry_name not in allowed:
            raise IncompatibleError(
                f"{compressor.label} runs only with communicator "
                f"{' or '.join(repr(a) for a in allowed)}, not {self.registry_name!r}; "
                f"set communicator={allowed[0]}")

    def attach(self, compressor: Compressor) -> None:
        """Carry `compressor`'s payloads from now on (called by the pipeline once).

        Args:
            compressor: The pipeline's compressor.

        Raises:
            IncompatibleError: This communicator cannot carry them (`check`).
        """
        self.check(compressor)
        self.compressor = compressor

    # -- the pipeline's entry points -------------------------------------------------------
    @abstractmethod
    def exchange(self, items: Sequence[Item], link: Link) -> Rounds:
        """The exchange of some payloads as rounds of collectives (`gracecomm.exchange`).

        One DDP bucket is one call: as few collectives as the method allows (one, plus the
        sizes where they vary).

        Args:
            items: (payload, ctx, tensor name) of each tensor, in the same order on every
                rank.
            link: The exchange's accounted collectives; each round launches collectives
                through it and yields their Works.

        Returns:
            A generator of rounds that returns the mean over ranks of every item as a
            dense tensor, in order.

        Raises:
            PayloadError: A peer's payload (or its announced size) is malformed.
        """

    def start(self, items: Sequence[Item],
              finish: Callable[[list[torch.Tensor]], Any] | None = None) -> Exchange:
        """Launch the first round of an exchange on this rank's thread.

        Args:
            items: (payload, ctx, tensor name) of each tensor; none: no collective.
            finish: Transforms the means before they are returned.

        Returns:
            The started `gracecomm.exchange.Exchange`: `Exchange.wait` or `Exchange.submit`
            runs the rest.
        """
        link = self.link()
        rounds = self.exchange(items, link) if items else nothing()
        return Exchange(self, rounds, [link], [name for _, _, name in items], finish)

    def send_receive(self, payload: Payload, ctx: Any, name: str) -> torch.Tensor:
        """Send this rank's payload of one tensor and receive the mean over ranks.

        Args:
            payload: This rank's payload.
            ctx: Its ctx.
            name: The tensor's name, the same on every rank.

        Returns:
            The mean over ranks, a dense tensor of the original shape and dtype.
        """
        return self.send_receive_many([(payload, ctx, name)])[0]

    def send_receive_many(self, items: Sequence[Item]) -> list[torch.Tensor]:
        """`send_receive` for several tensors at once, synchronously.

        Args:
            items: (payload, ctx, tensor name) of each tensor.

        Returns:
            The mean over ranks of each, in order.
        """
        return self.start(items).wait()

    def size_round(self, link: Link, items: Sequence[Item], device: torch.device
                   ) -> Generator[Works, None, list[list[int]]]:
        """Every rank's byte count of each payload tensor of `items`, exchanged in one small
        allgather and checked before anything is allocated for them (none negative, no
        rank's total beyond `Link.max_nbytes`). For a compressor whose payload sizes are
        fixed by the shapes (``fixed_size``) they are exchanged once per set of tensors and
        phase (`Compressor.layout_phase`), to agree on them, and from then on only this rank's
        payload (sizes and dtypes) is checked against the agreed layout, with no round,
        before it goes on the wire: a collective whose sizes differ between ranks would abort
        the process.

        Args:
            link: The exchange's accounted collectives.
            items: (payload, ctx, tensor name) of each tensor.
            device: Where the sizes are exchanged.

        Returns:
            A generator of rounds that returns every rank's byte counts, in rank order.

        Raises:
            PayloadError: A rank announced negative sizes, too many bytes, other dtypes, or
                (fixed size) another layout.
        """
        local = self.flatten(items)
        sizes = [t.numel() * t.element_size() for t in local]
        if self.world_size == 1:
            return [sizes]
        comp = self.compressor
        fixed = comp is not None and comp.capabilities().fixed_size
        names = [name for _, _, name in items]
        key = tuple((name, comp.layout_phase(ctx) if fixed else None) for _, ctx, name in items)
        layout = [(t.numel(), t.dtype) for t in local]
        if fixed and key in self._agreed:
            if layout != self._agreed[key]:
                raise PayloadError(f"{self.compressor.label} on rank {self.rank} produced "
                                   f"payload tensors {layout} for tensors {names[:3]}, but "
                                   f"its payloads are fixed by the shapes: {self._agreed[key]}")
            return [sizes] * self.world_size
        codes = [dtype_code(t.dtype) for t in local]
        every = yield from self._gather_ints(link, sizes + codes, device)
        for owner, announced in enumerate(every):
            rank_sizes, rank_codes = announced[:len(sizes)], announced[len(sizes):]
            every[owner] = rank_sizes
            if rank_codes != codes:
                raise PayloadError(
                    f"rank {owner} announced payload dtypes "
                    f"{[DTYPES[c] if 0 <= c < len(DTYPES) else c for c in rank_codes]} for "
                    f"tensors {names[:3]}; this rank's are {[t.dtype for t in local]}")
            if min(rank_sizes, default=0) < 0 or (link.max_nbytes is not None
                                                  and sum(rank_sizes) > link.max_nbytes):
                raise PayloadError(
                    f"rank {owner} announced payload sizes {rank_sizes} bytes for tensors "
                    f"{names[:3]}; allowed: none negative and at most {link.max_nbytes} "
                    "bytes in all (4x the dense tensors plus 64 KiB)")
            if fixed and rank_sizes != sizes:
                raise PayloadError(f"rank {owner} announced payload sizes {rank_sizes} bytes "
                                   f"for tensors {names[:3]}, but {self.compressor.label}'s "
                                   f"are fixed by the shapes and this rank's are {sizes}")
        if fixed:
            self._agreed[key] = layout
        return every

    # -- the bytes each rank appends to a serialised payload -------------------------------
    def trailer_nbytes(self, link: Link) -> int:
        """The size of the trailer each rank appends to its serialised payload.

        Args:
            link: The exchange's accounted collectives.

        Returns:
            The bytes of its status (`Link.status`) and, with ``checksum``, of a CRC-32.
        """
        return len(link.status) + 4 * self.checksum

    def serialise(self, link: Link, local: Sequence[torch.Tensor], device: torch.device,
                  announced: int) -> torch.Tensor:
        """This rank's payload tensors as bytes, followed by its trailer.

        A collective whose sizes differ between ranks aborts the receiving process inside
        the backend, so a payload that differs from what this rank announced is refused
        here, naming this rank.

        Args:
            link: The exchange's accounted collectives.
            local: This rank's payload tensors.
            device: Where the bytes go.
            announced: The bytes this rank's size round told every rank (what they post
                for it).

        Returns:
            A uint8 tensor.

        Raises:
            PayloadError: The payload's bytes differ from `announced`.
        """
        payload = to_bytes(local, device)
        if payload.numel() != announced:
            raise PayloadError(f"{self.label} on rank {self.rank}: its payload holds "
                               f"{payload.numel()} bytes, but rank {self.rank} announced "
                               f"{announced}; sending it would abort its peers, so it is not "
                               "sent")
        trailer = list(link.status)
        if self.checksum:
            with self.metrics.timer("checksum_s"):
                trailer += list(crc32(payload).to_bytes(4, "little"))
        return torch.cat([payload, torch.tensor(trailer, dtype=torch.uint8, device=device)])

    def read_trailers(self, link: Link, buffers: Sequence[torch.Tensor | None],
                      nbytes: Sequence[int]) -> bool:
        """Check every peer's checksum and read every rank's status.

        Args:
            link: The exchange's accounted collectives; its ``any_nonfinite`` is set.
            buffers: Every rank's serialised bytes, in rank order (None: this rank's own).
            nbytes: The payload bytes of each before its trailer.

        Returns:
            Whether any rank's input was non-finite.

        Raises:
            PayloadError: A peer's bytes fail their checksum (the message names the rank).
        """
        for owner, (buf, n) in enumerate(zip(buffers, nbytes)):
            if buf is None:
                continue
            if self.checksum:
                with self.metrics.timer("checksum_s"):
                    sent = int.from_bytes(bytes(buf[n + len(link.status):][:4].tolist()),
                                          "little")
                    if crc32(buf[:n]) != sent:
                        raise PayloadError(f"{self.label}: the payload from rank {owner} fails "
                                           f"its CRC-32 checksum: it was corrupted on the way")
            if link.status and buf[n]:
                link.any_nonfinite = True
        link.any_nonfinite = link.any_nonfinite or bool(link.nonfinite)
        return link.any_nonfinite

    # -- helpers for communicators that move serialised payloads --------------------------
    @staticmethod
    def flatten(items: Sequence[Item]) -> list[torch.Tensor]:
        """Every payload tensor of some items, in order.

        Args:
            items: (payload, ctx, tensor name) of each tensor.

        Returns:
            Their payloads' tensors, one list.
        """
        return [t for payload, _, _ in items for t in payload]

    @staticmethod
    def rank_payloads(items: Sequence[Item], buf: torch.Tensor, sizes: Sequence[int],
                      owner: int) -> list[Payload]:
        """Parse one rank's serialised payloads.

        Args:
            items: This rank's items: templates for the dtypes and the number of tensors
                of each payload.
            buf: The rank's bytes.
            sizes: The byte count of each of its payload tensors.
            owner: The rank, for messages.

        Returns:
            Its payload of each item, in order.

        Raises:
            PayloadError: The bytes do not fit the sizes and dtypes (names the rank).
        """
        local = Communicator.flatten(items)
        try:
            for size, ref in zip(sizes, local):
                if size % ref.element_size():
                    raise PayloadError(f"a payload tensor of {size} bytes is not a whole "
                                       f"number of {ref.dtype} elements")
            tensors = from_bytes(buf, [n // t.element_size() for n, t in zip(sizes, local)],
                                 local)
        except PayloadError as err:
            raise PayloadError(f"payload from rank {owner}: {err}") from None
        out, pos = [], 0
        for payload, _, _ in items:
            out.append(tuple(tensors[pos:pos + len(payload)]))
            pos += len(payload)
        return out

    def aggregate_items(self, items: Sequence[Item],
                        per_rank: Sequence[Sequence[Payload]]) -> list[torch.Tensor]:
        """Decompress and average every item over ranks, after `check_finite_fields`.

        Args:
            items: This rank's items (their ctx decompress every rank's payload).
            per_rank: Every rank's payloads, in rank order (so all ranks agree).

        Returns:
            The mean over ranks of each item, in order.

        Raises:
            PayloadError: A payload is malformed or carries NaN/Inf in a float field
                (names the rank and the tensor).
        """
        assert self.compressor is not None, "communicator used before attach()"
        self.check_fields(items, per_rank)
        outs = []
        with self.metrics.timer("decompress_s"):
            for i, (_, ctx, name) in enumerate(items):
                payloads = [rank_items[i] for rank_items in per_rank]
                try:
                    outs.append(self.compressor.aggregate(payloads, ctx))
                except PayloadError as err:
                    raise PayloadError(f"tensor '{name}': {self.culprit(payloads, ctx)}"
                                       f"{err}") from None
        return outs

    def check_fields(self, items: Sequence[Item], per_rank: Sequence[Sequence[Payload]],
                     senders: Sequence[str] | None = None) -> None:
        """The integrity check of every exchange (`check_finite_fields`), always on.

        Its cost is measured by ``gracecomm-bench suite=integrity``, which times the
        exchange with and without it.

        Args:
            items: This rank's items.
            per_rank: Every rank's payloads, in rank order.
            senders: Who sent each of `per_rank` (default ``rank r``).

        Raises:
            PayloadError: A floating-point field holds NaN or Inf (names the sender).
        """
        check_finite_fields(self.label, items, per_rank, senders)

    def culprit(self, payloads: Sequence[Payload], ctx: Any) -> str:
        """Which rank's payload a refused aggregate came from.

        Args:
            payloads: Every rank's payload of one tensor, in rank order.
            ctx: This rank's ctx for the tensor.

        Returns:
            ``'the payload from rank r: '`` for the first rank whose payload alone does not
            decompress, else ``''``.
        """
        assert self.compressor is not None
        for owner, payload in enumerate(payloads):
            try:
                self.compressor.decompress(payload, ctx)
            except PayloadError:
                return f"the payload from rank {owner}: "
        return ""


def check_finite_fields(owner: str, items: Sequence[Item],
                        per_rank: Sequence[Sequence[Payload]],
                        senders: Sequence[str] | None = None) -> None:
    """The integrity check of every exchange: the floating-point tensors of every rank's
    payloads (Top-k's values, QSGD's norms, TernGrad's scales, fp16 values) must be finite.
    A compressor never puts NaN or Inf into the payload of a finite tensor (casts saturate,
    scales are checked), and a step whose input was not finite never gets this far (it
    raises, or passes through by its status), so a non-finite field was corrupted on the way
    or by its sender: `PayloadError` naming the sender (``rank r`` for the r-th of
    `per_rank`, or `senders`), the tensor and the field. One sum per field
    (`nonfinite_among`)."""
    fields = [(r, i, j, t) for r, payloads in enumerate(per_rank)
              for i, payload in enumerate(payloads) for j, t in enumerate(payload)
              if t.is_floating_point() and t.numel()]
    bad = nonfinite_among([t for *_, t in fields])
    if bad:
        r, i, j, t = fields[bad[0]]
        sender = senders[r] if senders is not None else f"rank {r}"
        n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        raise PayloadError(f"{owner}: the payload from {sender} for tensor '{items[i][2]}' "
                           f"holds {n_nan} NaN and {n_inf} Inf values in its {t.dtype} field "
                           f"{j} (of {t.numel()} values), though its input was finite: it "
                           "was corrupted on the way or by its sender")


def crc32(data: torch.Tensor) -> int:
    """CRC-32 (zlib's) of a uint8 tensor's bytes."""
    return zlib.crc32(data.cpu().numpy().tobytes())


def nothing() -> Rounds:
    """The exchange of no items: no round, no means."""
    return []
    yield  # a generator that returns at once


def payload_device(items: Sequence[Item]) -> torch.device:
    for payload, _, _ in items:
        for t in payload:
            return t.device
    return torch.device("cpu")
