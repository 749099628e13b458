"""Allreduce: payloads are summed element-wise across ranks, then decompressed once.
Only valid for `summable` compressors (dense, fp16, shared-seed Random-k, PowerSGD)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gracecomm.communicator import Communicator, Item, payload_device
from gracecomm.compressor import Compressor
from gracecomm.exchange import Link, Rounds
from gracecomm.registry import COMMUNICATORS
from gracecomm.validation import ConfigError, IncompatibleError
from gracecomm.wire import payload_nbytes


def flat_copy(tensors: list[torch.Tensor], world: int) -> torch.Tensor:
    """The concatenation of `tensors` (one dtype) as a new flat tensor to allreduce in
    place, divided by `world` if floating (one pass for a single tensor)."""
    floating = tensors[0].is_floating_point()
    if len(tensors) == 1:
        flat = tensors[0].reshape(-1)
        return flat.div(world) if floating else flat.clone()
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat.div_(world) if floating else flat


@COMMUNICATORS.register("allreduce")
class Allreduce(Communicator):
    """One allreduce per payload dtype per call (normally one per DDP bucket).

    Floating-point payloads are divided by the world size before they are summed (as DDP
    and PyTorch's fp16 hook do, so that fp16 sums do not overflow): `decompress` receives
    the mean payload, which for the linear decompression that `summable` promises is the
    mean tensor. Integer payloads are summed, and the decompressed sum divided."""

    def __init__(self, group: Any = None, checksum: bool = False) -> None:
        super().__init__(group)
        if checksum:
            raise ConfigError(f"{self.label}: option 'checksum' is true, but allreduce sums the "
                              "payloads on the way, so no rank can check another's; use "
                              "communicator=allgather or broadcast for checksummed payloads")

    def check(self, compressor: Compressor) -> None:
        super().check(compressor)
        if not compressor.capabilities().summable:
            raise IncompatibleError(
                f"communicator 'allreduce' sums payloads element-wise, which is wrong for "
                f"{compressor.label}: its payloads are not summable (indices, packed bits or "
                f"per-rank scales). Use communicator=allgather or communicator=broadcast, or "
                f"pick a summable compressor (none, fp16, bf16, randomk, powersgd).")

    def exchange(self, items: Sequence[Item], link: Link) -> Rounds:
        local = self.flatten(items)
        self.count(payload_nbytes(local))
        world = self.world_size
        status = [torch.tensor(link.status, dtype=torch.float32, device=payload_device(items))
                  ] if link.status else []  # summed: positive if any rank's input was non-finite
        tensors = [*local, *status]
        self.metrics.add("sent_bytes", 4 * len(status))
        reduced = list(tensors)
        if world > 1:  # every rank's sizes must match before they are summed
            yield from self.size_round(link, items, payload_device(items))
            flats = []
            for dtype in dict.fromkeys(t.dtype for t in tensors):
                where = [i for i, t in enumerate(tensors) if t.dtype == dtype]
                flat = flat_copy([tensors[i] for i in where], world)
                flats.append((where, flat))
            yield [link.all_reduce(flat) for _, flat in flats]
            for where, flat in flats:
                for i, part in zip(where, flat.split([tensors[i].numel() for i in where])):
                    reduced[i] = part.view(tensors[i].shape)
        if status and bool(reduced[-1] > 0):
            link.any_nonfinite = True
            return []
        assert self.compressor is not None, "communicator used before bind()"
        outs, pos = [], 0
        with self.metrics.timer("decompress_s"):
            for payload, ctx, _ in items:
                total = tuple(reduced[pos:pos + len(payload)])
                pos += len(payload)
                out = self.compressor.decompress(total, ctx)
                summed = world > 1 and not all(t.is_floating_point() for t in total)
                outs.append(out.div_(world) if summed else out)
        return outs
