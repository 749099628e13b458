"""Allgather: every rank receives every rank's payload and averages the decompressed results.
Works with any compressor; payload sizes are exchanged first unless they are fixed."""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from grace.communicator import Communicator, Item, payload_device
from grace.exchange import Link, Rounds, Works
from grace.registry import COMMUNICATORS
from grace.wire import payload_nbytes, to_bytes


def rank_nbytes(sizes: Sequence[Sequence[int]], local: Sequence[torch.Tensor]) -> list[int]:
    """Bytes of each rank's serialised payloads, from the exchanged element counts."""
    return [sum(n * t.element_size() for n, t in zip(rank_sizes, local)) for rank_sizes in sizes]


def padded_payloads(comm: Communicator, link: Link, local: Sequence[torch.Tensor],
                    device: torch.device
                    ) -> Generator[Works, None, tuple[torch.Tensor, list[list[int]], list[int]]]:
    """Exchange payload sizes (a round unless they are fixed), then serialise this rank's
    payload tensors, followed by its status (`Link.status`), into one uint8 buffer padded to
    the largest rank's size (at least one byte, so an all-empty step never issues a zero-size
    collective), counted as payload plus the rest. Returns the buffer, every rank's sizes and
    every rank's payload bytes (`rank_payloads` reads a rank's status right after them)."""
    sizes = yield from comm.size_round(link, [t.numel() for t in local], device)
    nbytes = rank_nbytes(sizes, local)
    status = link.status
    width = max(1, max(nbytes) + len(status))
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    own = nbytes[comm.rank]
    buf[:own] = to_bytes(local, device)
    buf[own:own + len(status)] = torch.tensor(status, dtype=torch.uint8)
    comm.count(payload_nbytes(local), width)
    return buf, sizes, nbytes


@COMMUNICATORS.register("allgather")
class Allgather(Communicator):
    """Two rounds per call: the sizes (skipped for fixed-size payloads) and one allgather of
    all payloads, serialised into one uint8 buffer padded to the largest rank's size."""

    def exchange(self, items: Sequence[Item], link: Link) -> Rounds:
        local = self.flatten(items)
        own = [payload for payload, _, _ in items]
        if self.world_size == 1:
            self.count(payload_nbytes(local))
            link.any_nonfinite = bool(link.nonfinite)
            return [] if link.any_nonfinite else self.aggregate_items(items, [own])
        buf, sizes, nbytes = yield from padded_payloads(self, link, local, payload_device(items))
        gathered, work = link.all_gather(buf)
        yield (work,)
        if self.any_nonfinite(link, gathered, nbytes):
            return []
        per_rank = [own if r == self.rank else
                    self.rank_payloads(items, gathered[r][: nbytes[r]], sizes[r], r)
                    for r in range(self.world_size)]
        return self.aggregate_items(items, per_rank)
