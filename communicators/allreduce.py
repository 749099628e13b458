"""Allreduce: payloads are summed element-wise across ranks, then decompressed once.
Only valid for `summable` compressors (dense, fp16, shared-seed Random-k, PowerSGD)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from gracecomm.communicator import Communicator, Item, payload_device
from gracecomm.compressor import Compressor, Payload
from gracecomm.exchange import Link, Rounds, Works
from gracecomm.registry import COMMUNICATORS
from gracecomm.validation import ConfigError, IncompatibleError, PayloadError, nonfinite_among
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

    sums_payloads = True

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
            every = yield from self.size_round(link, items, payload_device(items))
            self.check_equal_sizes(items, every)
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
        try:  # the integrity check, of the sum: a NaN or Inf from any rank reaches it
            self.check_fields(items, [self.split(items, reduced)])
        except PayloadError:
            yield from self.name_nonfinite(items, link)
        assert self.compressor is not None, "communicator used before bind()"
        outs = []
        with self.metrics.timer("decompress_s"):
            for (_, ctx, _), total in zip(items, self.split(items, reduced)):
                out = self.compressor.decompress(total, ctx)
                summed = world > 1 and not all(t.is_floating_point() for t in total)
                outs.append(out.div_(world) if summed else out)
        return outs

    @staticmethod
    def split(items: Sequence[Item], reduced: Sequence[torch.Tensor]) -> list[Payload]:
        """The summed tensors as one payload per item."""
        out, pos = [], 0
        for payload, _, _ in items:
            out.append(tuple(reduced[pos:pos + len(payload)]))
            pos += len(payload)
        return out

    def check_equal_sizes(self, items: Sequence[Item], every: list[list[int]]) -> None:
        """Every rank must announce this rank's payload sizes: the sum is element-wise, and a
        collective whose sizes differ between ranks aborts the process inside the backend."""
        mine = [t.numel() * t.element_size() for t in self.flatten(items)]
        for owner, announced in enumerate(every):
            if announced != mine:
                raise PayloadError(
                    f"{self.label}: rank {owner} announced payload sizes {announced} bytes "
                    f"for tensors {[name for _, _, name in items][:3]}, this rank's payload "
                    f"has {mine}; an allreduce sums payloads of equal sizes")

    def name_nonfinite(self, items: Sequence[Item], link: Link) -> Generator[Works, None, None]:
        """The summed payload holds NaN or Inf though no rank's input did (the status says
        so, or the pipeline raised on it): one more round, on this failure path only, asks
        every rank whether its own payload was finite, and `PayloadError` names those that
        were not. Every rank sees the same sum, so every rank takes this path."""
        local = [t for t in self.flatten(items) if t.is_floating_point() and t.numel()]
        flag = torch.tensor([int(bool(nonfinite_among(local)))], dtype=torch.int64,
                            device=payload_device(items))
        flags = [flag]
        if self.world_size > 1:
            flags, work = link.all_gather(flag)
            yield (work,)
        bad = [r for r, f in enumerate(flags) if int(f)]
        names = [name for _, _, name in items][:3]
        raise PayloadError(
            f"{self.label}: the summed payload of tensors {names} holds NaN or Inf, though "
            "every rank's input was finite: " + (
                f"the payload from rank {', '.join(map(str, bad))} held them (corrupted on the "
                "way into it or by its compressor)" if bad else
                "every rank's own payload was finite, so it was corrupted on the way"))
