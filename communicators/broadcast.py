"""Broadcast: each rank in turn broadcasts its payload to all others (GRACE's broadcast
communicator); every rank then averages the decompressed payloads."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gracecomm.communicator import Communicator, Item, payload_device
from gracecomm.exchange import Link, Rounds
from gracecomm.registry import COMMUNICATORS
from gracecomm.wire import payload_nbytes


@COMMUNICATORS.register("broadcast")
class Broadcast(Communicator):
    """One size exchange (unless sizes are fixed), then one round of broadcasts: one per rank
    with a non-empty payload; no padding."""

    def exchange(self, items: Sequence[Item], link: Link) -> Rounds:
        local = self.flatten(items)
        own = [payload for payload, _, _ in items]
        trailer = self.trailer_nbytes(link)
        self.count(payload_nbytes(local), payload_nbytes(local) + trailer)
        if self.world_size == 1:
            link.any_nonfinite = bool(link.nonfinite)
            return [] if link.any_nonfinite else self.aggregate_items(items, [own])
        device = payload_device(items)
        sizes = yield from self.size_round(link, items, device)
        nbytes = [sum(rank_sizes) for rank_sizes in sizes]
        bufs = [self.serialise(link, local, device, nbytes[r]) if r == self.rank else
                torch.empty(nbytes[r] + trailer, dtype=torch.uint8, device=device)
                for r in range(self.world_size)]
        yield [link.broadcast(buf, r) for r, buf in enumerate(bufs) if buf.numel()]
        if self.read_trailers(link, [None if r == self.rank else b for r, b in enumerate(bufs)],
                              nbytes):
            return []
        per_rank = [own if r == self.rank else
                    self.rank_payloads(items, bufs[r][: nbytes[r]], sizes[r], r)
                    for r in range(self.world_size)]
        return self.aggregate_items(items, per_rank)
