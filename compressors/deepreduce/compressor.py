"""The DeepReduce wrapper compressor (Kostopoulou et al., Sec. 3, Fig. 2).

Any sparsifier (Top-k, Random-k, threshold, DGC, SIDCo, ..., or `NonZero` for inherently
sparse gradients) turns t into r (index, value) pairs; an index codec encodes the index set,
a value codec the values, independently. When the value codec sorts values (curve fitting),
the orders are reconciled: indices written by ``raw32``/``packed`` follow the value order
("index reordering"), otherwise a mapping is sent. Everything travels in one container
(`gracecomm.compressors.deepreduce.container`), so the payload is one uint8 tensor.

Reported per step through the shared metrics: ``index_bytes``, ``value_bytes``,
``mapping_bytes`` and ``header_bytes`` (the sections of the real containers; they add up to
``wire_bytes``), and for Bloom filters ``bloom_positives``, ``bloom_false_positives``,
``bloom_negatives`` (d - r), ``bloom_selected``, ``bloom_policy_errors`` plus per-tensor
samples ``bloom_fpr`` (measured false-positive rate |P \\ S| / (d - r)) and ``bloom_per``
(policy error rate: selected false positives / selections, thesis Sec. 6).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from gracecomm.buffers import dense_zeros
from gracecomm.compressor import Capabilities, Compressor, Payload, TensorInfo
from gracecomm.compressors.cast import saturating_cast
from gracecomm.compressors.deepreduce.codec import (
    INDEX_CODECS,
    VALUE_CODECS,
    CodecCtx,
    IndexCodec,
    Selection,
    ValueCodec,
    check_index_set,
)
from gracecomm.compressors.deepreduce.container import (
    HEADER_BYTES,
    Flag,
    Header,
    pack_container,
    pack_mapping,
    parse_container,
    unpack_mapping,
)
from gracecomm.compressors.shared.stochastic import kernels_enabled
from gracecomm.configstore import add_group
from gracecomm.pipeline import make_part
from gracecomm.registry import COMPRESSORS
from gracecomm.rng import SharedStreams, stable_hash
from gracecomm.sparse import SparseSelection, Sparsifier
from gracecomm.validation import ConfigError, PayloadError


class NonZero(Sparsifier):
    """Keep the nonzero elements (DeepReduce without a sparsifier, for inherently sparse
    gradients such as NCF's embeddings, paper Sec. 6)."""

    has_target = False

    def __init__(self) -> None:
        super().__init__(None)

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return flat.nonzero().view(-1)


@dataclass(frozen=True)
class DeepReduceCtx:
    info: TensorInfo
    codec: CodecCtx


Part = str | Mapping[str, Any] | None

# compressor/sparsifier=dgc: every registered sparsifier with its defaults (and its memory);
# ``none`` (keep the nonzeros, `NonZero`) is configs/compressor/sparsifier/none.yaml
add_group("compressor/sparsifier", "compressor",
          select=lambda cls: issubclass(cls, SparseSelection))


@COMPRESSORS.register("deepreduce")
class DeepReduce(Compressor):
    """DR^{value}_{index} on top of `sparsifier`: ``DeepReduce(sparsifier=TopK(0.01),
    index=BloomIndex(fpr=0.001, policy="p2"), value=PolyFitValues())``. Each part may also be
    a registry name or a mapping with ``name`` and options; ``sparsifier=None`` or ``"none"``
    keeps the nonzeros. `seed` drives the shared Bloom hashes and priorities. Not summable
    (allgather); its default memory is the sparsifier's (DGC's momentum correction for dgc)."""

    default_communicator = "allgather"
    run_keys = {"seed": "seed"}  # shared Bloom hashes and priorities: the run's seed
    child_attrs = ("streams", "sparsifier", "index", "value")

    def __init__(self, sparsifier: Part | Compressor = "topk", index: Part | IndexCodec = "raw32",
                 value: Part | ValueCodec = "raw", seed: int = 0) -> None:
        super().__init__()
        if sparsifier is None or sparsifier == "none":
            sparsifier = NonZero()
        self.sparsifier = make_part(sparsifier, COMPRESSORS, Compressor)
        if not isinstance(self.sparsifier, SparseSelection):
            raise ConfigError(f"{self.label}: option 'sparsifier' must be a sparsifier "
                              "(topk, randomk, threshold, dgc, sidco, ...) or none (keep the "
                              f"nonzeros); got {self.sparsifier.label}")
        self.adopt_training_needs([self.sparsifier])
        self.index: IndexCodec = make_part(index, INDEX_CODECS, IndexCodec)
        self.value: ValueCodec = make_part(value, VALUE_CODECS, ValueCodec)
        self.seed = int(seed)
        self.streams = SharedStreams(self.seed)
        self.tensor_seeds: dict[str, int] = {}  # one per tensor name
        self.flags: dict[Flag, Flag] = {}  # `_expected_flags`, per kind of container

    def capabilities(self) -> Capabilities:
        """Its sparsifier's memory (DGC's momentum correction for dgc); allgather."""
        return replace(super().capabilities(),
                       default_memory=self.sparsifier.capabilities().default_memory)

    def _indices(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The sparsifier's index set, ascending (the project's sparsifiers already send
        them so; on the CPU a sort only where they do not, elsewhere always: sorting k
        indices costs less than the host's read of a check)."""
        payload, ctx = self.sparsifier.compress(flat, name)
        indices = self.sparsifier.kept_indices(payload, ctx).to(torch.int64)
        if kernels_enabled(indices.device):
            a = indices.numpy()
            if a.shape[0] <= 1 or (a[1:] > a[:-1]).all():
                return indices
        return torch.sort(indices).values

    def _tensor_seed(self, name: str) -> int:
        """H(seed, name), once per tensor name."""
        if name not in self.tensor_seeds:
            self.tensor_seeds[name] = stable_hash(self.seed, name)
        return self.tensor_seeds[name]

    def _expected_flags(self, r_flag: Flag) -> Flag:
        """The flags a container with `r_flag` (0, EMPTY or FULL) must carry here."""
        if r_flag not in self.flags:
            self.flags[r_flag] = self._flags_for(r_flag)
        return self.flags[r_flag]

    def _flags_for(self, r_flag: Flag) -> Flag:
        if r_flag == Flag.EMPTY:
            return r_flag
        flags = r_flag
        if self.value.sorts:
            reorder = self.index.any_order and r_flag != Flag.FULL
            flags |= Flag.VALUE_ORDER if reorder else Flag.MAPPING
        if self.index.sends_all_positives and r_flag != Flag.FULL:
            flags |= Flag.ALL_POSITIVES
        return flags

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        d = flat.numel()
        ctx = DeepReduceCtx(TensorInfo.of(tensor),
                            CodecCtx(d, name, self._tensor_seed(name),
                                     self.streams.next_seed(name), flat.device))
        indices = self._indices(flat, name)
        r = indices.numel()
        empty = torch.empty(0, dtype=torch.uint8, device=flat.device)
        index_sec = value_sec = mapping_sec = empty
        if r == 0:
            flags, n = Flag.EMPTY, 0
        else:
            full = r == d
            flags = self._expected_flags(Flag.FULL if full else Flag(0))
            sel = (Selection(indices, flat) if full
                   else self.index.select(indices, flat, ctx.codec))
            values32, saturated = saturating_cast(sel.values, torch.float32)
            if saturated:
                self.metrics.add("saturated", saturated)
            value_sec, order = self.value.encode(values32, ctx.codec)
            positions, n = sel.values_at, sel.values_at.numel()
            if Flag.VALUE_ORDER in flags:
                positions = positions[order]
            if Flag.MAPPING in flags:
                mapping_sec = pack_mapping(order)
            if not full:
                index_sec = (sel.section if sel.section is not None
                             else self.index.encode(positions, ctx.codec))
            self._report_selection(sel)
        container = pack_container(Header(self.index.codec_id, self.value.codec_id, flags, d, n),
                                   index_sec, value_sec, mapping_sec)
        for key, sec in (("index_bytes", index_sec), ("value_bytes", value_sec),
                         ("mapping_bytes", mapping_sec)):
            self.metrics.add(key, sec.numel())
        self.metrics.add("header_bytes", HEADER_BYTES)
        return (container,), ctx

    def _report_selection(self, sel: Selection) -> None:
        for key, value in sel.stats.items():
            self.metrics.add(key, value)
        if sel.stats.get("bloom_negatives"):
            self.metrics.observe("bloom_fpr", sel.stats["bloom_false_positives"]
                                 / sel.stats["bloom_negatives"])
        if sel.stats.get("bloom_selected"):
            self.metrics.observe("bloom_per", sel.stats["bloom_policy_errors"]
                                 / sel.stats["bloom_selected"])

    def decompress(self, payload: Payload, ctx: DeepReduceCtx) -> torch.Tensor:
        if len(payload) != 1:
            raise PayloadError(f"{self.label}: payload has {len(payload)} tensors, expected "
                               "one container")
        info, cctx = ctx.info, ctx.codec
        sec = parse_container(payload[0], info.numel, self.index.codec_id, self.value.codec_id)
        n, flags = sec.header.n, sec.header.flags
        r_flag = flags & (Flag.EMPTY | Flag.FULL)
        expected = self._expected_flags(r_flag)
        if r_flag not in (Flag(0), Flag.EMPTY, Flag.FULL) or flags != expected:
            raise PayloadError(f"{self.label}: container flags {int(flags):#x} do not match "
                               f"this configuration (expected {int(expected):#x})")
        out = dense_zeros(info.numel, info.dtype, payload[0].device)
        if r_flag == Flag.EMPTY:
            if n or payload[0].numel() != HEADER_BYTES:
                raise PayloadError(f"{self.label}: an empty container carries {n} values")
            return out.view(info.shape)
        if r_flag == Flag.FULL:
            if n != info.numel or sec.index.numel():
                raise PayloadError(f"{self.label}: a full container must carry d = "
                                   f"{info.numel} values and no index section")
            positions = torch.arange(n, device=out.device)
        else:
            positions = self.index.decode(sec.index, n, cctx)
            if positions.numel() != n:
                raise PayloadError(f"{self.label}: index section decodes to "
                                   f"{positions.numel()} positions, the header announces {n}")
            ordered = Flag.VALUE_ORDER not in flags
            check_index_set(positions if ordered else torch.sort(positions).values,
                            info.numel, self.index.label)
        values = self.value.decode(sec.value, n, cctx)
        if Flag.MAPPING in flags:
            values = values[unpack_mapping(sec.mapping, n)]
        elif sec.mapping.numel():
            raise PayloadError(f"{self.label}: unexpected mapping section of "
                               f"{sec.mapping.numel()} bytes")
        out.index_copy_(0, positions, values.to(info.dtype))
        return out.view(info.shape)

