"""Allreduce: payloads are summed element-wise across ranks, then decompressed once.
Only valid for `summable` compressors (dense, fp16, shared-seed Random-k, PowerSGD)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from grace.communicator import Communicator, Item
from grace.compressor import Compressor
from grace.registry import COMMUNICATORS
from grace.validation import IncompatibleError
from grace.wire import payload_nbytes


@COMMUNICATORS.register("allreduce")
class Allreduce(Communicator):
    """One allreduce per payload dtype per call (normally one per DDP bucket).

    `decompress` receives the element-wise sum of all ranks' payloads and the communicator
    divides the dense result by the world size, which is the mean for the linear
    decompression that `summable` promises."""

    def check(self, compressor: Compressor) -> None:
        super().check(compressor)
        if not compressor.summable:
            raise IncompatibleError(
                f"communicator 'allreduce' sums payloads element-wise, which is wrong for "
                f"{compressor.label}: its payloads are not summable (indices, packed bits or "
                f"per-rank scales). Use communicator=allgather or communicator=broadcast, or "
                f"pick a summable compressor (none, fp16, bf16, randomk, powersgd).")

    def send_receive_many(self, items: Sequence[Item]) -> list[torch.Tensor]:
        local = self.flatten(items)
        self.count(payload_nbytes(local))
        summed = list(local)
        if self.world_size > 1:
            for dtype in dict.fromkeys(t.dtype for t in local):
                where = [i for i, t in enumerate(local) if t.dtype == dtype]
                flat = torch.cat([local[i].reshape(-1) for i in where])
                with self.collective("allreduce", payload_nbytes([flat])):
                    dist.all_reduce(flat, group=self.group)
                for i, part in zip(where, flat.split([local[i].numel() for i in where])):
                    summed[i] = part.view(local[i].shape)
        assert self.compressor is not None, "communicator used before bind()"
        outs, pos = [], 0
        with self.metrics.timer("decompress_s"):
            for payload, ctx, _ in items:
                total = tuple(summed[pos:pos + len(payload)])
                pos += len(payload)
                outs.append(self.compressor.decompress(total, ctx).div_(self.world_size))
        return outs
