"""Exchanges as rounds of asynchronous collectives.

A communicator describes one exchange (the payloads of a DDP bucket, or of one `step_many`)
as a generator of *rounds*: each round launches collectives with ``async_op=True`` through a
`Link` and yields them; the generator resumes once they have completed and finally returns
the mean over ranks of every tensor. Dependent rounds (payload sizes before an allgather of
payloads that vary in size, a parameter server's gather before its broadcast) are later
rounds of the same generator.

`Exchange` drives such a generator. Its first round is always launched by the caller, in the
order the caller starts exchanges, which every rank shares (DDP hands buckets to the hook in
bucket order). Then either

- `Exchange.wait` runs the later rounds on the caller's thread (the synchronous path), or
- `Exchange.submit` hands them to the communicator's `Continuations`: one worker thread that
  runs the later rounds of every submitted exchange in submission order, on a second process
  group. So the collectives of every process group are issued in the same order on every
  rank, whatever the timing, and the caller (DDP's backward pass) goes on while payloads are
  on the wire. ``future`` completes with the means, or with the error that ended the
  exchange.

Both paths run the same generator, so they give identical results.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gracecomm.metrics import Metrics
from gracecomm.network import NODE_PREFIX, bytes_key, calls_key, check_kind
from gracecomm.wire import payload_nbytes


class CommunicationError(RuntimeError):
    """A collective of an exchange failed: a peer died, hung past the collective timeout or
    closed its connection. The message names this rank, the communicator and the tensors."""


Works = Sequence[Any]  # torch.distributed Work objects launched with async_op=True
Rounds = Generator[Works, None, list[torch.Tensor]]


class Link:
    """The accounted collectives of one exchange, launched with ``async_op=True`` on the
    process group of the exchange's current round, and the exchange's non-finite status
    (`Grace`'s pass-through of non-finite steps: each rank's payload carries `status`, and
    the communicator sets `any_nonfinite`). Each records
    ``coll_<kind>_calls``/``coll_<kind>_bytes`` for the network cost model (`gracecomm.network`,
    which defines the message size of each kind) and returns its Work; outputs are valid
    once the round has been waited for."""

    def __init__(self, comm: Collectives, group: Any, nonfinite: bool | None = None) -> None:
        self.comm = comm
        self.group = group
        self.nonfinite = nonfinite  # this rank's input was non-finite; None: not carried
        self.any_nonfinite = False  # set by the communicator: some rank's was
        self.max_nbytes: int | None = None  # the most payload bytes a rank may announce
        self.recorded: dict[str, list[float]] = {}  # {kind: [calls, bytes]} of this exchange

    @property
    def status(self) -> list[int]:
        """The status this rank sends with its payload (empty where the pipeline raises on
        non-finite input instead of passing it through): 1 if its input was non-finite."""
        return [] if self.nonfinite is None else [int(self.nonfinite)]

    def _record(self, kind: str, nbytes: int, source: bool = True) -> None:
        """Count one collective of `kind` and its message size `nbytes`; inside a node
        (`NODE_PREFIX`) also ``intra_node_bytes``, the bytes of this rank's own tensor where
        it is a source of the collective (`source`), as ``wire_bytes`` counts payloads."""
        prefix = self.comm.metric_prefix
        entry = self.recorded.setdefault(kind, [0.0, 0.0])
        entry[0] += 1
        entry[1] += nbytes
        self.comm.metrics.add(prefix + calls_key(check_kind(kind)), 1)
        self.comm.metrics.add(prefix + bytes_key(kind), nbytes)
        if prefix == NODE_PREFIX:
            self.comm.metrics.add("intra_node_bytes", nbytes if source else 0)

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        """Sum `tensor` over ranks, in place."""
        self._record("allreduce", tensor.numel() * tensor.element_size())
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def all_gather(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        """Every rank's `tensor` (same shape on every rank), in rank order."""
        world = self.comm.world_size
        out = [torch.empty_like(tensor) for _ in range(world)]
        self._record("allgather", world * tensor.numel() * tensor.element_size())
        return out, dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True)

    def broadcast(self, tensor: torch.Tensor, src: int, kind: str = "broadcast") -> Any:
        """Overwrite `tensor` with group rank `src`'s copy (`kind` ``ps_pull`` for a
        parameter server's downlink, charged for the bytes every other rank receives)."""
        nbytes = tensor.numel() * tensor.element_size()
        self._record(kind, nbytes if kind == "broadcast" else (self.comm.world_size - 1) * nbytes,
                     self.comm.rank == src)
        return dist.broadcast(tensor, src=self.comm.global_rank(src), group=self.group,
                              async_op=True)

    def reduce(self, tensor: torch.Tensor, dst: int) -> Any:
        """Sum `tensor` over ranks into group rank `dst`'s copy, in place (the others' copies
        are scratch afterwards), counted as the bytes of `tensor` (``reduce``, a kind of
        the collectives inside a node)."""
        self._record("reduce", tensor.numel() * tensor.element_size(), self.comm.rank != dst)
        return dist.reduce(tensor, dst=self.comm.global_rank(dst), group=self.group,
                           async_op=True)

    def gather(self, tensor: torch.Tensor, dst: int) -> tuple[list[torch.Tensor] | None, Any]:
        """Every rank's `tensor` on group rank `dst` (None elsewhere), counted as the bytes
        the destination receives (``ps_push``)."""
        world = self.comm.world_size
        out = ([torch.empty_like(tensor) for _ in range(world)] if self.comm.rank == dst
               else None)
        self._record("ps_push", (world - 1) * tensor.numel() * tensor.element_size())
        return out, dist.gather(tensor, out, dst=self.comm.global_rank(dst), group=self.group,
                                async_op=True)


def together(rounds: Sequence[Rounds]) -> Rounds:
    """Several generators of rounds side by side, as one: each round launches the next round
    of every one not yet finished (in order, the same on every rank); returns their results,
    in order."""
    results: list[Any] = [None] * len(rounds)
    live = list(range(len(rounds)))
    while live:
        works: list[Any] = []
        for i in list(live):
            try:
                works += next(rounds[i])
            except StopIteration as stop:
                results[i] = stop.value
                live.remove(i)
        if live:
            yield works
    return results


class Exchange:
    """One started exchange (see the module docstring) of the tensors `names`, whose rounds
    launch collectives through `links` (one, or a node's and the communicator's for the
    two-level exchange, `gracecomm.hierarchy`). `finish` transforms the communicator's means
    before they are returned (e.g. re-inserting skipped tensors); `worker` gives the
    `Continuations` that `submit` hands it to (default: the communicator's)."""

    def __init__(self, comm: Collectives, rounds: Rounds, links: Sequence[Link],
                 names: Sequence[str], finish: Callable[[list[torch.Tensor]], Any] | None = None,
                 worker: Callable[[], Continuations] | None = None) -> None:
        self.comm = comm
        self.names = names
        self.rounds = rounds
        self.links = links
        self.finish = finish
        self.worker = comm.continuations if worker is None else worker
        self.future: torch.futures.Future[Any] = torch.futures.Future()
        self.works: Works = ()
        self.submitted = False
        self.waited_until = 0.0  # perf_counter() when its last collective completed
        self._advance()  # launch the first round on the caller's thread

    def _advance(self) -> None:
        try:
            self.works = next(self.rounds)
        except StopIteration as stop:
            result = stop.value if self.finish is None else self.finish(stop.value)
            self.future.set_result(result)

    def _run(self, key: str) -> None:
        """Wait for each round (the time added to `key`), then launch the next, until the
        generator returns; any error completes the future with it."""
        try:
            while not self.future.done():
                try:
                    self.comm.wait_for(self.works, key)
                    self.waited_until = time.perf_counter()
                except RuntimeError as err:
                    shown = ", ".join(f"'{n}'" for n in self.names[:3])
                    more = f" and {len(self.names) - 3} more" if len(self.names) > 3 else ""
                    raise CommunicationError(
                        f"{self.comm.label} on rank {self.comm.rank}: the exchange of tensors "
                        f"{shown}{more} failed waiting for its peers, which died, hung or are "
                        f"too slow: {err}") from err
                self._advance()
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
            if not self.future.done():
                self.future.set_exception(err)

    def submit(self) -> torch.futures.Future[Any]:
        """Hand the later rounds to the `Continuations` (asynchronous), each link now on
        the worker's duplicate of its process group; returns `future`."""
        if not self.future.done():
            self.submitted = True
            worker = self.worker()
            for link in self.links:
                link.group = worker.duplicate(link.group)
            worker.put(self)
        return self.future

    def wait(self) -> Any:
        """The result, running the later rounds on this thread unless they were submitted."""
        if not self.submitted:
            self._run("comm_s")
        return self.future.wait()


class Continuations:
    """One worker thread that runs the later rounds of submitted exchanges in submission
    order, on duplicates of the process groups they use, created here collectively: every
    rank constructs it at the same point with the same `groups`, (ranks, group) pairs where
    ranks are the group's global ranks (None: the whole world) and group is this rank's
    process group for them, or None where this rank is not a member. A process group used
    from two threads would mix their collectives' order."""

    def __init__(self, groups: Sequence[tuple[Sequence[int] | None, Any]]) -> None:
        self._duplicates: list[tuple[Any, Any]] = []
        for ranks, group in groups:
            duplicate = dist.new_group(ranks=ranks, backend=dist.get_backend(group))
            if group is not None or ranks is None:
                self._duplicates.append((group, duplicate))
        self._queue: queue.SimpleQueue[Exchange] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="grace-exchange", daemon=True)
        self._thread.start()

    def duplicate(self, group: Any) -> Any:
        """The worker's duplicate of one of this rank's process groups."""
        return next(dup for original, dup in self._duplicates if original is group)

    def put(self, exchange: Exchange) -> None:
        self._queue.put(exchange)

    def _serve(self) -> None:
        while True:  # the training thread goes on meanwhile: not time it spent waiting
            self._queue.get()._run("comm_async_s")



class Collectives:
    """A process group and the accounted collectives on it: the part of a communicator that
    compressors with collectives of their own (PowerSGD's first round, LGC's index
    broadcast) and the exchanges above use, so that every byte is counted the same way.
    `gracecomm.Communicator` derives from it; a compressor reaches it as ``self.comm``.

    Without an initialised process group it acts as a world of one rank.

    Attributes:
        group: The process group (None: the default group).
        metrics: Where bytes and waiting times are recorded.
        label: How messages name the owner (``communicator 'allgather'``).
    """

    group: Any = None
    metrics: Metrics
    label: str
    metric_prefix = ""  # of its ``coll_<kind>_...`` metrics (`NODE_PREFIX` inside a node)
    _continuations: Continuations | None = None  # this instance's, created on first use

    # -- process group --------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """Whether a process group is initialised."""
        return dist.is_available() and dist.is_initialized()

    @property
    def world_size(self) -> int:
        """The number of ranks in the group (1 without a process group)."""
        return dist.get_world_size(self.group) if self.distributed else 1

    @property
    def rank(self) -> int:
        """This rank in the group (0 without a process group)."""
        return dist.get_rank(self.group) if self.distributed else 0

    def global_rank(self, group_rank: int) -> int:
        """The rank in the default group of a rank of this group.

        Args:
            group_rank: A rank of this group.

        Returns:
            Its global rank.
        """
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def link(self, nonfinite: bool | None = None) -> Link:
        """The accounted asynchronous collectives of one new exchange.

        Args:
            nonfinite: This rank's status where non-finite steps pass through (see `Link`);
                None where they raise.

        Returns:
            A new `Link` on this group.
        """
        return Link(self, self.group, nonfinite)

    def continuations(self) -> Continuations:
        """The worker that runs later rounds of submitted exchanges (created on first use;
        every rank reaches its first asynchronous exchange at the same point).

        Returns:
            This instance's `Continuations`.
        """
        if self._continuations is None:
            ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
            self._continuations = Continuations([(ranks, self.group)])
        return self._continuations

    # -- accounted collectives ------------------------------------------------------------
    def count(self, wire_bytes: int, sent_bytes: int | None = None) -> None:
        """Credit this rank with bytes sent.

        Args:
            wire_bytes: Payload bytes (``wire_bytes``).
            sent_bytes: Bytes really moved, headers and padding included (``sent_bytes``);
                None: `wire_bytes`.
        """
        self.metrics.add("wire_bytes", wire_bytes)
        self.metrics.add("sent_bytes", wire_bytes if sent_bytes is None else sent_bytes)

    def wait_for(self, works: Works, key: str = "comm_s") -> None:
        """Wait for launched collectives, adding the time to a metric.

        Args:
            works: The collectives' Works.
            key: ``comm_s`` (the time the training thread waited) or ``comm_async_s`` (the
                exchange worker's waits).
        """
        if works:
            with self.metrics.timer(key):
                for work in works:
                    work.wait()

    def run_now(self, rounds: Generator[Works, None, Any]) -> Any:
        """Run rounds of collectives on this thread.

        Args:
            rounds: A generator of rounds (`gracecomm.exchange`).

        Returns:
            What the generator returns.
        """
        try:
            while True:
                self.wait_for(next(rounds))
        except StopIteration as stop:
            return stop.value

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over ranks, in place (counted as payload).

        Args:
            tensor: This rank's tensor.

        Returns:
            `tensor`, now the sum.
        """
        self.count(payload_nbytes([tensor]))
        if self.world_size > 1:
            self.wait_for([Link(self, self.group).all_reduce(tensor)])
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (counted as payload).

        Args:
            tensor: This rank's tensor, of the same shape and dtype on every rank.

        Returns:
            Every rank's, in rank order.
        """
        self.count(payload_nbytes([tensor]))
        if self.world_size == 1:
            return [tensor]
        out, work = Link(self, self.group).all_gather(tensor)
        self.wait_for([work])
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite a tensor with one rank's copy (the bytes are credited to that rank).

        Args:
            tensor: This rank's tensor, overwritten.
            src: The group rank whose copy every rank receives.

        Returns:
            `tensor`.
        """
        if self.rank == src:
            self.count(payload_nbytes([tensor]))
        if self.world_size > 1:
            self.wait_for([Link(self, self.group).broadcast(tensor, src)])
        return tensor

    def gather_sizes(self, numels: Sequence[int], device: torch.device) -> list[list[int]]:
        """Every rank's integers (one small allgather on this thread; counted as sent).

        Args:
            numels: This rank's integers (as many on every rank).
            device: Where they are exchanged.

        Returns:
            Every rank's, in rank order.
        """
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
