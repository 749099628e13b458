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
import torch.distributed as dist

from gracecomm.compressor import Compressor, Payload
from gracecomm.exchange import Continuations, Exchange, Link, Rounds, Works
from gracecomm.metrics import Metrics
from gracecomm.state import Stateful
from gracecomm.validation import IncompatibleError, PayloadError, check_choice, nonfinite_among
from gracecomm.wire import DTYPES, dtype_code, from_bytes, payload_nbytes, to_bytes

Item = tuple[Payload, Any, str]  # (payload, ctx, tensor name)


class Communicator(Stateful, ABC):
    """Base class of all communicators."""

    registry_name: ClassVar[str] = ""

    def __init__(self, group: Any = None, checksum: bool = False) -> None:
        self.group = group
        self.checksum = check_choice(checksum, (False, True), self.label, "checksum")
        self.compressor: Compressor | None = None
        self.metrics = Metrics()
        self._continuations: Continuations | None = None
        self._agreed: dict[tuple[tuple[str, Hashable], ...], list[tuple[int, torch.dtype]]] = {}
        # fixed payload layouts, per tensors and phase

    @property
    def label(self) -> str:
        return f"communicator '{self.registry_name or type(self).__name__}'"

    # -- process group --------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if self.distributed else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.distributed else 0

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # -- set-up ---------------------------------------------------------------------------
    def check(self, compressor: Compressor) -> None:
        """Raise `IncompatibleError` if this communicator cannot carry `compressor`'s payloads."""
        allowed = compressor.capabilities().communicators
        if allowed is not None and self.registry_name not in allowed:
            raise IncompatibleError(
                f"{compressor.label} runs only with communicator "
                f"{' or '.join(repr(a) for a in allowed)}, not {self.registry_name!r}; "
                f"set communicator={allowed[0]}")

    def bind(self, compressor: Compressor, metrics: Metrics) -> None:
        self.check(compressor)
        self.compressor = compressor
        self.metrics = metrics

    # -- the pipeline's entry points -------------------------------------------------------
    @abstractmethod
    def exchange(self, items: Sequence[Item], link: Link) -> Rounds:
        """The exchange of `items` as rounds of collectives launched through `link` (each
        round yields its Works; see `gracecomm.exchange`); returns the mean over ranks of every
        item as a dense tensor, in order. One DDP bucket is one call: as few collectives as
        the method allows (one, plus the sizes where they vary)."""

    def start(self, items: Sequence[Item],
              finish: Callable[[list[torch.Tensor]], Any] | None = None) -> Exchange:
        """Launch the first round of exchanging `items` on this rank's thread; `Exchange.wait`
        or `Exchange.submit` runs the rest (`finish` transforms the means). No items: no
        collective."""
        link = self.link()
        rounds = self.exchange(items, link) if items else nothing()
        return Exchange(self, rounds, link, [name for _, _, name in items], finish)

    def link(self, nonfinite: bool | None = None) -> Link:
        """The accounted asynchronous collectives of one new exchange (`nonfinite`: this
        rank's status, where non-finite steps pass through; see `Link`)."""
        return Link(self, self.group, nonfinite)

    def continuations(self) -> Continuations:
        """The worker that runs later rounds of submitted exchanges (created on first use;
        every rank reaches its first asynchronous exchange at the same point)."""
        if self._continuations is None:
            self._continuations = Continuations(self.group)
        return self._continuations

    def send_receive(self, payload: Payload, ctx: Any, name: str) -> torch.Tensor:
        """Send this rank's payload and return the mean over ranks as a dense tensor."""
        return self.send_receive_many([(payload, ctx, name)])[0]

    def send_receive_many(self, items: Sequence[Item]) -> list[torch.Tensor]:
        """`send_receive` for several tensors at once, synchronously."""
        return self.start(items).wait()

    # -- accounted collectives ------------------------------------------------------------
    def count(self, wire_bytes: int, sent_bytes: int | None = None) -> None:
        """Credit this rank with `wire_bytes` of payload (and `sent_bytes` really moved)."""
        self.metrics.add("wire_bytes", wire_bytes)
        self.metrics.add("sent_bytes", wire_bytes if sent_bytes is None else sent_bytes)

    def wait_for(self, works: Works, key: str = "comm_s") -> None:
        """Wait for launched collectives, adding the time to `key` (``comm_s``: the time the
        training thread waited; ``comm_async_s``: the exchange worker's waits)."""
        if works:
            with self.metrics.timer(key):
                for work in works:
                    work.wait()

    def run_now(self, rounds: Generator[Works, None, Any]) -> Any:
        """Run rounds of collectives on this thread and return what they return."""
        try:
            while True:
                self.wait_for(next(rounds))
        except StopIteration as stop:
            return stop.value

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over ranks in place (counted as payload)."""
        self.count(payload_nbytes([tensor]))
        if self.world_size > 1:
            self.wait_for([Link(self, self.group).all_reduce(tensor)])
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all ranks), in rank order (counted)."""
        self.count(payload_nbytes([tensor]))
        if self.world_size == 1:
            return [tensor]
        out, work = Link(self, self.group).all_gather(tensor)
        self.wait_for([work])
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite `tensor` with rank `src`'s copy; the bytes are credited to `src`."""
        if self.rank == src:
            self.count(payload_nbytes([tensor]))
        if self.world_size > 1:
            self.wait_for([Link(self, self.group).broadcast(tensor, src)])
        return tensor

    def gather_sizes(self, numels: Sequence[int], device: torch.device) -> list[list[int]]:
        """Every rank's `numels` (one small allgather on this thread; counted as sent)."""
        if self.world_size == 1:
            return [list(numels)]
        return self.run_now(self._gather_ints(Link(self, self.group), numels, device))

    def _gather_ints(self, link: Link, numels: Sequence[int], device: torch.device
                     ) -> Generator[Works, None, list[list[int]]]:
        local = torch.tensor(list(numels), dtype=torch.int64, device=device)
        self.metrics.add("sent_bytes", local.numel() * 8)
        out, work = link.all_gather(local)
        yield (work,)
        return [o.tolist() for o in out]

    def size_round(self, link: Link, items: Sequence[Item], device: torch.device
                   ) -> Generator[Works, None, list[list[int]]]:
        """Every rank's byte count of each payload tensor of `items`, exchanged in one small
        allgather and checked before anything is allocated for them (none negative, no
        rank's total beyond `Link.max_nbytes`). For a compressor whose payload sizes are
        fixed by the shapes (``fixed_size``) they are exchanged once per set of tensors and
        phase (`Compressor.layout_phase`), to agree on them, and from then on only this rank's
        payload (sizes and dtypes) is checked against the agreed layout, with no round,
        before it goes on the wire: a collective whose sizes differ between ranks would abort
        the process."""
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
        """Its status (`Link.status`) and, with ``checksum``, a CRC-32 of its payload bytes."""
        return len(link.status) + 4 * self.checksum

    def serialise(self, link: Link, local: Sequence[torch.Tensor], device: torch.device,
                  announced: int) -> torch.Tensor:
        """This rank's payload tensors as bytes, followed by its trailer. They must be the
        `announced` bytes (what this rank's size round told every rank, and what they post
        for it): a collective whose sizes differ between ranks aborts the receiving process
        inside the backend, so a payload that differs is refused here, naming this rank."""
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
        """Check every peer's checksum (`PayloadError` naming the rank) and read every
        rank's status (None: this rank's own buffer) into `link.any_nonfinite`."""
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
        return [t for payload, _, _ in items for t in payload]

    @staticmethod
    def rank_payloads(items: Sequence[Item], buf: torch.Tensor, sizes: Sequence[int],
                      owner: int) -> list[Payload]:
        """Parse one rank's serialised payloads from the byte count of each tensor, using
        the local payloads as templates for dtypes and the number of tensors per payload."""
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
        """Decompress and average every item over ranks (rank order, so all ranks agree),
        after `check_finite_fields`; a payload the compressor refuses names its rank."""
        assert self.compressor is not None, "communicator used before bind()"
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
        """The integrity check of every exchange (`check_finite_fields`), always on; its
        cost is measured by ``gracecomm-bench suite=integrity``, which times the exchange
        with and without it."""
        check_finite_fields(self.label, items, per_rank, senders)

    def culprit(self, payloads: Sequence[Payload], ctx: Any) -> str:
        """``'the payload from rank r: '`` for the first rank whose payload alone does not
        decompress (after an aggregate refused them together), else ``''``."""
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
