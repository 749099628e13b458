"""Broadcast: each rank in turn broadcasts its payload to all others (GRACE's broadcast
communicator); every rank then averages the decompressed payloads."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grace.communicator import Communicator, Item, payload_device
from grace.exchange import Link, Rounds
from grace.registry import COMMUNICATORS
from grace.wire import payload_nbytes, to_bytes
from gracecomm.communicators.allgather import rank_nbytes


@COMMUNICATORS.register("broadcast")
class Broadcast(Communicator):
    """One size exchange (unless sizes are fixed), then one round of broadcasts: one per rank
    with a non-empty payload; no padding."""

    def exchange(self, items: Sequence[Item], link: Link) -> Rounds:
        local = self.flatten(items)
        own = [payload for payload, _, _ in items]
        status = link.status
        self.count(payload_nbytes(local), payload_nbytes(local) + len(status))
        if self.world_size == 1:
            link.any_nonfinite = bool(link.nonfinite)
            return [] if link.any_nonfinite else self.aggregate_items(items, [own])
        device = payload_device(items)
        sizes = yield from self.size_round(link, [t.numel() for t in local], device)
        nbytes = rank_nbytes(sizes, local)
        mine = torch.tensor(status, dtype=torch.uint8, device=device)
        bufs = [torch.cat([to_bytes(local, device), mine]) if r == self.rank else
                torch.empty(nbytes[r] + len(status), dtype=torch.uint8, device=device)
                for r in range(self.world_size)]
        yield [link.broadcast(buf, r) for r, buf in enumerate(bufs) if buf.numel()]
        if self.any_nonfinite(link, bufs, nbytes):
            return []
        per_rank = [own if r == self.rank else
                    self.rank_payloads(items, bufs[r][: nbytes[r]], sizes[r], r)
                    for r in range(self.world_size)]
        return self.aggregate_items(items, per_rank)
