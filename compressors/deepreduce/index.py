"""Lossless index codecs of DeepReduce (paper Sec. 3 and appendix 10.7.1):
raw32, packed, bitmap, run-length (thesis Sec. 2.3.1), Huffman over index bytes,
delta + variable-length integers, and DEFLATE. All are vectorised torch code (DEFLATE runs
zlib on the CPU); the Bloom filter lives in `gracecomm.compressors.deepreduce.bloom`."""

from __future__ import annotations

import functools
import heapq
from abc import abstractmethod
from typing import ClassVar

import torch

from gracecomm.compressors.deepreduce.codec import (
    INDEX_CODECS,
    CodecCtx,
    IndexCodec,
    check_index_set,
    flat_nonzero,
    pack_fields,
    u32_bytes,
    u32_values,
    unpack_fields,
)
from gracecomm.compressors.shared.deflate import deflate, inflate
from gracecomm.validation import PayloadError, check_choice, check_range
from gracecomm.wire import (
    bits_for,
    pack_bits,
    pack_uint,
    packed_nbytes,
    unpack_bits,
    unpack_uint,
    varint_bytes,
    varint_values,
)


class LosslessIndexCodec(IndexCodec):
    """Checks the index set on the way in; subclasses implement `pack` and `unpack`."""

    def encode(self, indices: torch.Tensor, ctx: CodecCtx) -> torch.Tensor:
        check_index_set(indices, ctx.d, self.label, ascending=not self.any_order)
        return self.pack(indices.to(torch.int64), ctx.d)

    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        positions = self.unpack(section, n, ctx.d)
        check_index_set(positions, ctx.d, self.label, ascending=not self.any_order)
        return positions

    @abstractmethod
    def pack(self, indices: torch.Tensor, d: int) -> torch.Tensor:
        """The section for the checked int64 `indices`."""

    @abstractmethod
    def unpack(self, section: torch.Tensor, n: int, d: int) -> torch.Tensor:
        """The n positions (int64) held by `section`."""


@INDEX_CODECS.register("raw32")
class Raw32Index(LosslessIndexCodec):
    """Indices as u32: 4r bytes (the sparsifier's own format); any order."""

    codec_id = 1
    any_order = True

    def pack(self, indices: torch.Tensor, d: int) -> torch.Tensor:
        return u32_bytes(indices)

    def unpack(self, section: torch.Tensor, n: int, d: int) -> torch.Tensor:
        if section.numel() != 4 * n:
            raise PayloadError(f"{self.label}: section holds {section.numel()} bytes, "
                               f"{n} indices need {4 * n}")
        return u32_values(section)


@INDEX_CODECS.register("packed")
class PackedIndex(LosslessIndexCodec):
    """Indices in ceil(log2 d) bits each; any order."""

    codec_id = 2
    any_order = True

    def pack(self, indices: torch.Tensor, d: int) -> torch.Tensor:
        return pack_uint(indices, bits_for(d), check=False)

    def unpack(self, section: torch.Tensor, n: int, d: int) -> torch.Tensor:
        return unpack_uint(section, bits_for(d), n)


@INDEX_CODECS.register("bitmap")
class BitmapIndex(LosslessIndexCodec):
    """A d-bit map of the selected positions: ceil(d / 8) bytes."""

    codec_id = 3

    def pack(self, indices: torch.Tensor, d: int) -> torch.Tensor:
        mask = torch.zeros(d, dtype=torch.bool, device=indices.device)
        mask[indices] = True
        return pack_bits(mask)

    def unpack(self, section: torch.Tensor, n: int, d: int) -> torch.Tensor:
        positions = flat_nonzero(unpack_bits(section, d))
        if positions.numel() != n:
            raise PayloadError(f"{self.label}: bitmap has {positions.numel()} set bits, "
                               f"the header announces {n}")
        return positions


def rle_runs(indices: torch.Tensor, mode: str) -> torch.Tensor:
    """Run lengths of the bitmap of the ascending `indices` (thesis Sec. 2.3.1).

    ``zeros``: per set bit, the zeros since the previous set bit. ``alternate``: lengths
    of alternating zero and one runs, the first a zero run (possibly empty); trailing zeros
    are implied by d in both modes."""
    if mode == "zeros" or indices.numel() == 0:
        prev = torch.cat([indices.new_full((1,), -1), indices[:-1]])
        return indices - prev - 1
    brk = indices[1:] != indices[:-1] + 1
    edge = indices.new_ones(1, dtype=torch.bool)
    starts, ends = indices[torch.cat([edge, brk])], indices[torch.cat([brk, edge])]
    zeros = starts - torch.cat([indices.new_full((1,), -1), ends[:-1]]) - 1
    return torch.stack([zeros, ends - starts + 1], dim=1).reshape(-1)


def rle_positions(runs: torch.Tensor, mode: str) -> torch.Tensor:
    """Inverse of `rle_runs`."""
    if mode == "zeros":
        return torch.cumsum(runs + 1, 0) - 1
    zeros, ones = runs.view(-1, 2).unbind(1)
    starts = torch.cumsum(zeros + ones, 0) - ones
    first = torch.cumsum(ones, 0) - ones
    offset = torch.arange(int(ones.sum()), device=runs.device)
    return torch.repeat_interleave(starts, ones) + offset - torch.repeat_interleave(first, ones)


@INDEX_CODECS.register("rle")
class RLEIndex(LosslessIndexCodec):
    """Run-length encoding of the bitmap with one field width per tensor,
    w = max(1, ceil(log2(max run + 1))): section = w (u8), run count (u32), runs."""

    codec_id = 4
    MODES: ClassVar[tuple[str, ...]] = ("zeros", "alternate")

    def __init__(self, mode: str = "zeros") -> None:
        self.mode = check_choice(mode, self.MODES, self.label, "mode")

    def pack(self, indices: torch.Tensor, d: int) -> torch.Tensor:
        runs = rle_runs(indices, self.mode)
        width = bits_for(int(runs.max()) + 1) if runs.numel() else 1
        return torch.cat([pack_fields("BI", width, runs.numel(), device=indices.device),
                          pack_uint(runs, width, check=False)])

    def unpack(self, section: torch.Tensor, n: int, d: int) -> torch.Tensor:
        (width, count), body = unpack_fields("BI", section, self.label)
        if not 1 <= width <= 32 or count > 2 * max(n, 1):
            raise PayloadError(f"{self.label}: bad header (width {width}, {count} runs for "
                               f"{n} indices)")
        if self.mode == "alternate" and count % 2:
            raise PayloadError(f"{self.label}: {count} runs, expected an even number")
        positions = rle_positions(unpack_uint(body, width, count), self.mode)
        if positions.numel() != n:
            raise PayloadError(f"{self.label}: runs encode {positions.numel()} indices, "
                               f"the header announces {n}")
        return positions


@functools.lru_cache(maxsize=64)
def huffman_code(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths, codes) of the canonical Huffman code over byte values whose histogram is
    that of the 4 little-endian bytes of every integer 0..d-1 (paper appendix 10.7.1: the
    codec is built from all possible indices, so only d is needed to rebuild it). Ties in
    the canonical assignment go by length, then symbol; unused bytes get length 0."""
    freq = [0] * 256
    for byte in range(4):
        block = 256**byte
        full, rem = divmod(d, 256 * block)
        for v in range(256):
            freq[v] += full * block + min(max(rem - v * block, 0), block)
    heap = [(f, v, (v,)) for v, f in enumerate(freq) if f]
    lengths = [0] * 256
    if len(heap) == 1:
        lengths[heap[0][1]] = 1
    heapq.heapify(heap)
    while len(heap) > 1:
        fa, ta, sa = heapq.heappop(heap)
        fb, tb, sb = heapq.heappop(heap)
        for v in sa + sb:
            lengths[v] += 1
        heapq.heappush(heap, (fa + fb, min(ta, tb), sa + sb))
    codes, code, prev = [0] * 256, 0, 0
    for length, v in sorted((n, v) for v, n in enumerate(lengths) if n):
        code <<= length - prev
        codes[v], code, prev = code, code + 1, length
    return torch.tensor(lengths), torch.tensor(codes)


@INDEX_CODECS.register("huffman")
class HuffmanIndex(LosslessIndexCodec):
    """Static canonical Huffman code over the 4 little-endian bytes of each index
    (`huffman_code`); codewords are written most significant bit first. Decoding finds a
    codeword at every bit offset with one table search and the codeword starts by pointer
    doubling, so no sequential loop runs in Python."""

    codec_id = 5

    def pack(self, indices: torch.Tensor, d: int) -> torch.Tensor:
        lengths, codes = (t.to(indices.device) for t in huffman_code(d))
        symbols = u32_bytes(indices).long()
        lens, words = lengths[symbols], codes[symbols]
        owner = torch.repeat_interleave(torch.arange(symbols.numel(), device=indices.device), lens)
        first = torch.cumsum(lens, 0) - lens
        offset = torch.arange(owner.numel(), device=indices.device) - first[owner]
        shift = lens[owner] - 1 - offset
        return pack_bits((words[owner] >> shift) & 1)

    def unpack(self, section: torch.Tensor, n: int, d: int) -> torch.Tensor:
        lengths, codes = (t.to(section.device) for t in huffman_code(d))
        used = lengths.nonzero().view(-1)
        order = torch.argsort(lengths[used] * 256 + used)
        sym, lens = used[order], lengths[used][order]
        top = int(lens.max())
        left = codes[sym] << (top - lens)  # left-justified codewords, increasing
        nbits = 8 * section.numel()
        bits = torch.cat([unpack_bits(section, nbits).long(),
                          torch.zeros(top, dtype=torch.int64, device=section.device)])
        window = torch.zeros(nbits, dtype=torch.int64, device=section.device)
        for b in range(top):
            window |= bits[b:b + nbits] << (top - 1 - b)
        code_at = torch.searchsorted(left, window, right=True) - 1
        count = 4 * n
        nxt = torch.cat([torch.clamp(torch.arange(nbits, device=section.device) + lens[code_at],
                                     max=nbits), torch.tensor([nbits], device=section.device)])
        starts = torch.zeros(min(count, 1), dtype=torch.int64, device=section.device)
        jump = nxt
        while starts.numel() < count:
            starts = torch.cat([starts, jump[starts]])
            jump = jump[jump]
        starts = starts[:count]
        if count:
            last = int(starts[-1])
            if last >= nbits or not 0 <= nbits - (last + int(lens[code_at[last]])) < 8:
                raise PayloadError(f"{self.label}: the stream of {nbits} bits does not hold "
                                   f"exactly {count} codewords")
            hit = code_at[starts]
            if bool(((window[starts] - left[hit]) >> (top - lens[hit])).ne(0).any()):
                raise PayloadError(f"{self.label}: the stream holds an invalid codeword")
        elif section.numel():
            raise PayloadError(f"{self.label}: {section.numel()} bytes for no indices")
        return u32_values(sym[code_at[starts]].to(torch.uint8))


@INDEX_CODECS.register("delta_varint")
class DeltaVarintIndex(LosslessIndexCodec):
    """The first index, then the gaps, as unsigned LEB128 varints (`gracecomm.wire.varint_bytes`:
    7 payload bits per byte, high bit = more bytes follow)."""

    codec_id = 6

    def pack(self, indices: torch.Tensor, d: int) -> torch.Tensor:
        return varint_bytes(torch.cat([indices[:1], indices[1:] - indices[:-1]]))

    def unpack(self, section: torch.Tensor, n: int, d: int) -> torch.Tensor:
        try:
            gaps = varint_values(section, n)
        except PayloadError as err:
            raise PayloadError(f"{self.label}: {err}") from None
        return torch.cumsum(gaps, 0)


@INDEX_CODECS.register("deflate")
class DeflateIndex(LosslessIndexCodec):
    """DEFLATE (zlib level `level`, raw stream after a u32 length) over the ascending raw32
    bytes or the bitmap; CPU."""

    codec_id = 7
    SOURCES: ClassVar[dict[str, type[LosslessIndexCodec]]] = {"raw32": Raw32Index,
                                                               "bitmap": BitmapIndex}

    def __init__(self, source: str = "raw32", level: int = 6) -> None:
        self.source = check_choice(source, tuple(self.SOURCES), self.label, "source")
        self.level = check_range(level, self.label, "level", 0, 9, integer=True)
        self.inner = self.SOURCES[source]()

    def pack(self, indices: torch.Tensor, d: int) -> torch.Tensor:
        return deflate(self.inner.pack(indices, d), self.level)

    def unpack(self, section: torch.Tensor, n: int, d: int) -> torch.Tensor:
        size = 4 * n if self.source == "raw32" else packed_nbytes(d, 1)
        return self.inner.unpack(inflate(section, size), n, d)
