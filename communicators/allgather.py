"""Allgather: every rank receives every rank's payload and averages the decompressed results.
Works with any compressor; payload sizes are exchanged first unless they are fixed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from grace.communicator import Communicator, Item, payload_device
from grace.registry import COMMUNICATORS
from grace.wire import payload_nbytes, to_bytes


def rank_nbytes(sizes: Sequence[Sequence[int]], local: Sequence[torch.Tensor]) -> list[int]:
    """Bytes of each rank's serialised payloads, from the exchanged element counts."""
    return [sum(n * t.element_size() for n, t in zip(rank_sizes, local)) for rank_sizes in sizes]


def padded_payloads(comm: Communicator, local: Sequence[torch.Tensor], device: torch.device
                    ) -> tuple[torch.Tensor, list[list[int]], list[int]]:
    """Exchange payload sizes, then serialise this rank's payload tensors into one uint8
    buffer padded to the largest rank's size (at least one byte, so an all-empty step never
    issues a zero-size collective), counted as payload plus padding. Returns the buffer,
    every rank's sizes and every rank's byte count."""
    sizes = comm.gather_sizes([t.numel() for t in local], device)
    nbytes = rank_nbytes(sizes, local)
    width = max(1, max(nbytes))
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    buf[: nbytes[comm.rank]] = to_bytes(local, device)
    comm.count(payload_nbytes(local), width)
    return buf, sizes, nbytes


@COMMUNICATORS.register("allgather")
class Allgather(Communicator):
    """Two collectives per call: the sizes (skipped for fixed-size payloads) and one
    allgather of all payloads, serialised into one uint8 buffer padded to the largest rank's
    size (at least one byte, so an all-empty step never issues a zero-size collective)."""

    def send_receive_many(self, items: Sequence[Item]) -> list[torch.Tensor]:
        local = self.flatten(items)
        own = [payload for payload, _, _ in items]
        if self.world_size == 1:
            self.count(payload_nbytes(local))
            return self.aggregate_items(items, [own])
        buf, sizes, nbytes = padded_payloads(self, local, payload_device(items))
        gathered = [torch.empty_like(buf) for _ in range(self.world_size)]
        with self.collective("allgather", self.world_size * buf.numel()):
            dist.all_gather(gathered, buf, group=self.group)
        per_rank = [own if r == self.rank else
                    self.rank_payloads(items, gathered[r][: nbytes[r]], sizes[r], r)
                    for r in range(self.world_size)]
        return self.aggregate_items(items, per_rank)
