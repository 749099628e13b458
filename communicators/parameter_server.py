"""Parameter server: every rank sends its payloads to the master rank, which decompresses and
averages them (`Compressor.aggregate`), optionally re-compresses the mean with a downlink
compressor (bidirectional compression), and broadcasts the result; every rank, the master
included, decompresses the same bytes, so all end with identical aggregates.

Bytes: the uplink (this rank's payload, the master's own included) is ``wire_bytes``; the
downlink payload that every worker receives is ``downlink_bytes``. The network cost model sees
the gather as ``ps_push`` and the broadcast as ``ps_pull``. A failure on the master (a
malformed payload, a non-finite reconstruction) is broadcast to the workers, so every rank
raises instead of waiting for a result that never comes.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from gracecomm.communicator import Communicator, Item, crc32, payload_device
from gracecomm.communicators.allgather import padded_payloads
from gracecomm.compressor import Compressor, Payload, TensorInfo
from gracecomm.exchange import Link, Rounds, Works
from gracecomm.pipeline import make_part
from gracecomm.registry import COMMUNICATORS, COMPRESSORS
from gracecomm.validation import (
    ConfigError,
    IncompatibleError,
    PayloadError,
    check_range,
    expect_payload,
)
from gracecomm.wire import pack_described, payload_nbytes, unpack_described

NONFINITE = 2  # the status the master broadcasts when a rank's input was non-finite


class ServerError(RuntimeError):
    """The parameter server failed to aggregate a step; every rank raises this (the master
    raises the original error)."""


def pack(payloads: Sequence[tuple[TensorInfo, Payload]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The downlink: (result shape and dtype, payload) pairs as `gracecomm.wire.pack_described`
    lays them out."""
    return pack_described([(info.shape, info.dtype, payload) for info, payload in payloads])


def unpack(header: torch.Tensor, buf: torch.Tensor) -> list[tuple[TensorInfo, Payload]]:
    """Inverse of `pack`."""
    return [(TensorInfo(shape, dtype), payload)
            for shape, dtype, payload in unpack_described(header, buf)]


@COMMUNICATORS.register("parameter_server")
class ParameterServer(Communicator):
    """Per call: one size exchange (unless sizes are fixed), one gather of every rank's
    payloads to `master_rank` (padded to the largest), one broadcast from the master of the
    status and sizes, and one round of two broadcasts (the header, the result).
    `downlink`: a compressor applied to each
    averaged tensor before the broadcast (e.g. ``fp16``, ``topk``, ``natural``); its ctx must
    be the plain `TensorInfo` of the tensor, since workers decompress without it."""

    child_attrs = ("downlink",)

    def __init__(self, master_rank: int = 0, downlink: Any = None, group: Any = None,
                 checksum: bool = False) -> None:
        super().__init__(group, checksum)
        self.master_rank = check_range(master_rank, self.label, "master_rank", 0, integer=True)
        try:  # null (dense), a registry name, a mapping with name or _target_, or an instance
            self.downlink = (None if downlink is None
                             else make_part(downlink, COMPRESSORS, Compressor))
        except ConfigError as err:
            raise ConfigError(f"{self.label}: option 'downlink' must be null or a compressor: "
                              f"{err}") from err
        if self.downlink is not None and self.downlink.capabilities().model_level:
            raise IncompatibleError(f"{self.label}: option 'downlink' names "
                                    f"{self.downlink.label}, which compresses whole models; "
                                    "pick a per-tensor compressor")

    def exchange(self, items: Sequence[Item], link: Link) -> Rounds:
        if self.master_rank >= self.world_size:
            raise ConfigError(f"{self.label}: option 'master_rank' is {self.master_rank} but the "
                              f"world has {self.world_size} ranks")
        device = payload_device(items)
        master = self.rank == self.master_rank
        received = yield from self.push(items, link, device)
        header = torch.zeros(4, dtype=torch.int64)  # status, header length, buffer bytes, CRC
        meta = torch.zeros(0, dtype=torch.int64)
        buf = torch.zeros(0, dtype=torch.uint8)
        error: Exception | None = None
        if master and link.any_nonfinite:
            header[0] = NONFINITE
        elif master:
            try:
                means = self.aggregate_items(items, received)
                meta, buf = pack([self.encode(mean, name) for mean, (_, _, name)
                                  in zip(means, items)])
            except Exception as err:  # noqa: BLE001 - re-raised below, after telling the workers
                error = err
                buf = torch.tensor(list(f"{type(err).__name__}: {err}".encode()),
                                   dtype=torch.uint8)
            header[:] = torch.tensor([int(error is not None), meta.numel(), buf.numel(),
                                      crc32(buf) if self.checksum else 0])
        header = header.to(device)
        yield self.pull(link, header)
        status, n_meta, n_buf, crc = header.tolist()
        if status == NONFINITE:
            link.any_nonfinite = True
            return []
        if not master:
            self.check_downlink(link, status, n_meta, n_buf)
            meta = torch.empty(n_meta, dtype=torch.int64)
            buf = torch.empty(n_buf, dtype=torch.uint8)
        meta, buf = meta.to(device), buf.to(device)
        yield [*self.pull(link, meta), *self.pull(link, buf)]
        if error is not None:
            raise error
        if status:
            raise ServerError(f"{self.label}: the master (rank {self.master_rank}) failed to "
                              f"aggregate: {bytes(buf.cpu().tolist()).decode(errors='replace')}")
        if self.checksum and crc32(buf) != crc:
            raise PayloadError(f"{self.label}: the aggregate from the master (rank "
                               f"{self.master_rank}) fails its CRC-32 checksum: it was "
                               "corrupted on the way")
        master_label = f"the master (rank {self.master_rank})"
        try:
            results = unpack(meta.cpu(), buf)
            self.check_results(items, results)
        except PayloadError as err:
            raise PayloadError(f"{self.label}: the aggregate from {master_label} is malformed: "
                               f"{err}") from None
        self.check_fields(items, [[p for _, p in results]], [master_label])
        self.metrics.add("downlink_bytes", sum(payload_nbytes(p) for _, p in results))
        with self.metrics.timer("decompress_s"):
            means = [self.decode(info, payload) for info, payload in results]
        for (_, _, name), (info, _), mean in zip(items, results, means):
            if mean.dtype != info.dtype or mean.shape != info.shape:
                raise PayloadError(f"{self.label}: the aggregate of tensor '{name}' from "
                                   f"{master_label} decodes to a {mean.dtype} tensor of shape "
                                   f"{tuple(mean.shape)}, not {info.dtype} {tuple(info.shape)}")
        return means

    def check_results(self, items: Sequence[Item],
                      results: Sequence[tuple[TensorInfo, Payload]]) -> None:
        """The downlink describes one result per item, of the shape and dtype this rank's
        own item has (`result_info`), so no header can make a rank return another."""
        if len(results) != len(items):
            raise PayloadError(f"it holds {len(results)} results for {len(items)} tensors")
        for (payload, ctx, name), (info, _) in zip(items, results):
            expected = self.result_info(payload, ctx)
            if info != expected:
                raise PayloadError(f"tensor '{name}' is described as {info.dtype} of shape "
                                   f"{tuple(info.shape)}; it is {expected.dtype} of shape "
                                   f"{tuple(expected.shape)}")

    def result_info(self, payload: Payload, ctx: Any) -> TensorInfo:
        """The shape and dtype of the dense tensor of this rank's item: its ctx's where the
        ctx says (a `TensorInfo`, or a ctx with an ``info``), else its decompression's."""
        for info in (ctx, getattr(ctx, "info", None)):
            if isinstance(info, TensorInfo):
                return info
        assert self.compressor is not None
        return TensorInfo.of(self.compressor.decompress(payload, ctx))

    def check_downlink(self, link: Link, status: int, n_meta: int, n_buf: int) -> None:
        """Check the status and bound the sizes the master announces before allocating them
        (`Link.max_nbytes`)."""
        if status not in (0, 1):  # NONFINITE returned before
            raise PayloadError(f"{self.label}: the master (rank {self.master_rank}) announced "
                               f"status {status}; allowed: 0 (a result), 1 (its error), "
                               f"{NONFINITE} (a non-finite step)")
        limit = link.max_nbytes
        if min(n_meta, n_buf) < 0 or (limit is not None and max(8 * n_meta, n_buf) > limit):
            raise PayloadError(f"{self.label}: the master (rank {self.master_rank}) announced a "
                               f"{n_meta}-word header and {n_buf} bytes; allowed: none negative "
                               f"and at most {limit} bytes")

    # -- uplink -------------------------------------------------------------------------------
    def push(self, items: Sequence[Item], link: Link, device: torch.device
             ) -> Generator[Works, None, list[list[Payload]] | None]:
        """Gather every rank's payloads to the master: every rank's payloads in rank order
        on the master, None elsewhere."""
        local = self.flatten(items)
        own = [payload for payload, _, _ in items]
        if self.world_size == 1:
            self.count(payload_nbytes(local))
            link.any_nonfinite = bool(link.nonfinite)
            return [own]
        buf, sizes, nbytes = yield from padded_payloads(self, link, items, device)
        bufs, work = link.gather(buf, self.master_rank)
        yield (work,)
        if bufs is None or self.read_trailers(
                link, [None if r == self.rank else b for r, b in enumerate(bufs)], nbytes):
            return None
        return [own if r == self.rank else
                self.rank_payloads(items, bufs[r][: nbytes[r]], sizes[r], r)
                for r in range(self.world_size)]

    # -- downlink -------------------------------------------------------------------------------
    def encode(self, mean: torch.Tensor, name: str) -> tuple[TensorInfo, Payload]:
        info = TensorInfo.of(mean)
        if self.downlink is None:
            return info, (mean.reshape(-1),)
        payload, ctx = self.downlink.compress(mean, name)
        self.downlink.metrics.pop()  # its statistics would mix with the uplink's
        if not isinstance(ctx, TensorInfo) or ctx != info:
            raise IncompatibleError(
                f"{self.label}: the downlink {self.downlink.label} keeps per-call state in its "
                "ctx, which the workers do not have; use a compressor whose ctx is the tensor's "
                "shape and dtype (none, fp16, bf16, topk, threshold, natural)")
        return info, payload

    def decode(self, info: TensorInfo, payload: Payload) -> torch.Tensor:
        if self.downlink is None:
            if len(payload) != 1:
                raise PayloadError(f"a dense aggregate arrived as {len(payload)} tensors")
            expect_payload(payload[0], info.numel, info.dtype, "a dense aggregate")
            return payload[0].view(info.shape)
        return self.downlink.decompress(payload, info)

    def pull(self, link: Link, tensor: torch.Tensor) -> Works:
        """Broadcast `tensor` from the master (the downlink), if there is anything to send."""
        if self.world_size == 1 or not tensor.numel():
            return ()
        return (link.broadcast(tensor, self.master_rank, kind="ps_pull"),)

