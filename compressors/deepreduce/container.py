"""The DeepReduce container: one uint8 tensor on the wire per tensor (paper Sec. 3; the byte
layout is this library's).

    header (24 bytes, little-endian)
      version u8 | index codec id u8 | value codec id u8 | flags u8
      d u32 | n u32 | index section bytes u32 | value section bytes u32 | mapping bytes u32
    index section | value section | mapping section

n is the number of decoded (position, value) pairs: r, or |P| when a Bloom filter sends the
values of all its positives (policy P0). The mapping (paper Sec. 3) is the permutation pi
with pi[i] = sorted rank of the value at the i-th decoded position, in
max(1, ceil(log2 n))-bit fields.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntFlag

import torch

from gracecomm.compressors.shared.deflate import byte_tensor
from gracecomm.validation import PayloadError
from gracecomm.wire import bits_for, pack_uint, packed_nbytes, unpack_uint

VERSION = 1
HEADER = struct.Struct("<BBBBIIIII")
HEADER_BYTES = HEADER.size  # 24


class Flag(IntFlag):
    VALUE_ORDER = 1      # indices are written in the value codec's (sorted) order
    MAPPING = 2          # a mapping section is present
    ALL_POSITIVES = 4    # values for every Bloom positive (P0)
    EMPTY = 8            # r = 0: no sections
    FULL = 16            # r = d: no index section, positions 0..d-1


@dataclass(frozen=True)
class Header:
    index_id: int
    value_id: int
    flags: Flag
    d: int
    n: int


@dataclass(frozen=True)
class Sections:
    header: Header
    index: torch.Tensor
    value: torch.Tensor
    mapping: torch.Tensor


def pack_container(header: Header, index: torch.Tensor, value: torch.Tensor,
                   mapping: torch.Tensor) -> torch.Tensor:
    """Header followed by the three sections, as one uint8 tensor."""
    if header.d >= 2**32 or header.n >= 2**32:
        raise ValueError(f"DeepReduce container: d = {header.d} and n = {header.n} must be "
                         "below 2**32")
    head = HEADER.pack(VERSION, header.index_id, header.value_id, int(header.flags),
                       header.d, header.n, index.numel(), value.numel(), mapping.numel())
    return torch.cat([byte_tensor(head, index.device), index, value, mapping])


def parse_container(buf: torch.Tensor, d: int, index_id: int, value_id: int) -> Sections:
    """Split a container, checking version, codec ids, d and the section lengths."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise PayloadError(f"DeepReduce container must be a 1-D uint8 tensor, got "
                           f"{buf.dtype} of shape {tuple(buf.shape)}")
    if buf.numel() < HEADER_BYTES:
        raise PayloadError(f"DeepReduce container holds {buf.numel()} bytes, shorter than "
                           f"its {HEADER_BYTES}-byte header: truncated")
    (version, got_index, got_value, flags, got_d, n, index_len, value_len,
     mapping_len) = HEADER.unpack(buf[:HEADER_BYTES].cpu().numpy().tobytes())
    if version != VERSION:
        raise PayloadError(f"DeepReduce container version {version}, expected {VERSION}")
    if (got_index, got_value) != (index_id, value_id):
        raise PayloadError(f"DeepReduce container uses index codec {got_index} and value codec "
                           f"{got_value}, this rank is configured for {index_id} and {value_id}")
    if got_d != d:
        raise PayloadError(f"DeepReduce container is for a tensor of {got_d} elements, "
                           f"expected {d}")
    if flags & ~0x1F:
        raise PayloadError(f"DeepReduce container has unknown flags {flags:#x}")
    total = HEADER_BYTES + index_len + value_len + mapping_len
    if total != buf.numel():
        raise PayloadError(f"DeepReduce container holds {buf.numel()} bytes, its header "
                           f"announces {total}{': truncated' if total > buf.numel() else ''}")
    a, b = HEADER_BYTES + index_len, HEADER_BYTES + index_len + value_len
    return Sections(Header(got_index, got_value, Flag(flags), got_d, n),
                    buf[HEADER_BYTES:a], buf[a:b], buf[b:])


def pack_mapping(order: torch.Tensor) -> torch.Tensor:
    """The mapping pi = order^-1 (pi[i] = sorted rank of the value at the i-th position)."""
    n = order.numel()
    pi = torch.empty_like(order)
    pi[order] = torch.arange(n, dtype=order.dtype, device=order.device)
    return pack_uint(pi, bits_for(n), check=False)


def unpack_mapping(section: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_mapping`; raises unless the section holds a permutation of 0..n-1."""
    width = bits_for(n)
    if section.numel() != packed_nbytes(n, width):
        raise PayloadError(f"mapping section holds {section.numel()} bytes, {n} fields of "
                           f"{width} bits need {packed_nbytes(n, width)}")
    pi = unpack_uint(section, width, n)
    if n and (int(pi.max()) >= n or
              not bool(torch.bincount(pi, minlength=n).eq(1).all())):
        raise PayloadError(f"mapping is not a permutation of 0..{n - 1}")
    return pi
