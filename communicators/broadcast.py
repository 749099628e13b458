"""Broadcast: each rank in turn broadcasts its payload to all others (GRACE's broadcast
communicator); every rank then averages the decompressed payloads."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from grace.communicator import Communicator, Item, payload_device
from grace.registry import COMMUNICATORS
from grace.wire import payload_nbytes, to_bytes
from gracecomm.communicators.allgather import rank_nbytes


@COMMUNICATORS.register("broadcast")
class Broadcast(Communicator):
    """One size exchange (unless sizes are fixed) and one broadcast per rank with a
    non-empty payload; no padding."""

    def send_receive_many(self, items: Sequence[Item]) -> list[torch.Tensor]:
        local = self.flatten(items)
        own = [payload for payload, _, _ in items]
        self.count(payload_nbytes(local))
        if self.world_size == 1:
            return self.aggregate_items(items, [own])
        device = payload_device(items)
        sizes = self.gather_sizes([t.numel() for t in local], device)
        nbytes = rank_nbytes(sizes, local)
        per_rank = []
        for r in range(self.world_size):
            if r == self.rank:
                buf = to_bytes(local, device)
            else:
                buf = torch.empty(nbytes[r], dtype=torch.uint8, device=device)
            if nbytes[r]:
                with self.collective("broadcast", nbytes[r]):
                    dist.broadcast(buf, src=self.global_rank(r), group=self.group)
            per_rank.append(own if r == self.rank else
                            self.rank_payloads(items, buf, sizes[r], r))
        return self.aggregate_items(items, per_rank)
