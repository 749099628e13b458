"""Allgather: every rank receives every rank's payload and averages the decompressed results.
Works with any compressor; payload sizes are exchanged first unless they are fixed."""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from gracecomm.communicator import Communicator, Item, payload_device
from gracecomm.exchange import Link, Rounds, Works
from gracecomm.registry import COMMUNICATORS
from gracecomm.wire import payload_nbytes


def padded_payloads(comm: Communicator, link: Link, items: Sequence[Item],
                    device: torch.device
                    ) -> Generator[Works, None, tuple[torch.Tensor, list[list[int]], list[int]]]:
    """Exchange payload sizes (`Communicator.size_round`), then serialise this rank's
    payload tensors and trailer into one uint8 buffer padded to the largest rank's (at
    least one byte, so an all-empty step never issues a zero-size collective), counted as
    payload plus the rest. Returns the buffer, every rank's sizes and every rank's payload
    bytes (its trailer follows them)."""
    local = comm.flatten(items)
    sizes = yield from comm.size_round(link, items, device)
    nbytes = [sum(rank_sizes) for rank_sizes in sizes]
    width = max(1, max(nbytes) + comm.trailer_nbytes(link))
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    own = comm.serialise(link, local, device, nbytes[comm.rank])
    buf[:own.numel()] = own
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
        buf, sizes, nbytes = yield from padded_payloads(self, link, items, payload_device(items))
        gathered, work = link.all_gather(buf)
        yield (work,)
        if self.read_trailers(link, [None if r == self.rank else g for r, g in
                                     enumerate(gathered)], nbytes):
            return []
        per_rank = [own if r == self.rank else
                    self.rank_payloads(items, gathered[r][: nbytes[r]], sizes[r], r)
                    for r in range(self.world_size)]
        return self.aggregate_items(items, per_rank)
