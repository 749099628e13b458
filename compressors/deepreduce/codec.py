"""The two codec families of DeepReduce (Kostopoulou et al., Sec. 3, Fig. 2): an *index
codec* encodes the index set S of a sparse tensor, a *value codec* its value array V, each
independently of the other. Both are registries (kinds ``index_codec`` and ``value_codec``),
offered as the config groups ``compressor/index`` and ``compressor/value``
(`gracecomm.configstore`), so a new codec is one registered class.

Byte order is little-endian and bit streams are LSB-first (see `gracecomm.wire`); the byte
views used here assume a little-endian host, as every platform torch supports is.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from gracecomm.compressors.shared.deflate import byte_tensor
from gracecomm.compressors.shared.stochastic import kernels_enabled
from gracecomm.configstore import add_group
from gracecomm.registry import Registry, add_registry
from gracecomm.state import Stateful
from gracecomm.validation import PayloadError

INDEX_CODECS = add_registry(Registry("index_codec", builtin="gracecomm.compressors.deepreduce"))
VALUE_CODECS = add_registry(Registry("value_codec", builtin="gracecomm.compressors.deepreduce"))
add_group("compressor/index", "index_codec")  # compressor/index=bloom
add_group("compressor/value", "value_codec")  # compressor/value=polyfit


@dataclass(frozen=True)
class CodecCtx:
    """What a codec may read besides its section; identical on every rank for one call.

    ``tensor_seed`` = H(seed, name) is fixed per tensor (Bloom hashes, so positions can be
    cached); ``step_seed`` = H(seed, name, call) changes every call (priorities of the Bloom
    policies, QSGD's rounding)."""

    d: int
    name: str
    tensor_seed: int
    step_seed: int
    device: torch.device


@dataclass
class Selection:
    """An index codec's decision on the sender: the positions whose values are sent (in
    send order) and those values (usually ``flat[values_at]``), plus statistics."""

    values_at: torch.Tensor
    values: torch.Tensor
    section: torch.Tensor | None = None  # the index section, if selecting already built it
    stats: dict[str, float] = field(default_factory=dict)


class IndexCodec(Stateful, ABC):
    """Encodes an index set. Lossless codecs send S itself; lossy ones (Bloom) decode to a
    selection S~ and say in `select` which values the sender must send for it.

    ``any_order``: the section may list positions in any order (raw32, packed), so a value
    codec that sorts values needs no mapping: the indices are written in value order
    (paper Sec. 3, "index reordering"). Other codecs take and return ascending positions."""

    codec_id: ClassVar[int]
    any_order: ClassVar[bool] = False
    sends_all_positives: bool = False  # Bloom P0: n = |P|, not r
    registry_name: ClassVar[str] = ""

    @property
    def label(self) -> str:
        return f"index codec '{self.registry_name or type(self).__name__}'"

    def select(self, indices: torch.Tensor, flat: torch.Tensor, ctx: CodecCtx) -> Selection:
        """Decide which values to send for the ascending index set `indices` of `flat`."""
        return Selection(indices, flat[indices])

    @abstractmethod
    def encode(self, indices: torch.Tensor, ctx: CodecCtx) -> torch.Tensor:
        """The section (uint8) for `indices` (ascending unless ``any_order``)."""

    @abstractmethod
    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        """The n decoded positions (int64), ascending unless ``any_order``."""


class ValueCodec(Stateful, ABC):
    """Encodes a float32 value array. Order-preserving codecs decode the i-th value as the
    i-th; ``sorts`` codecs (curve fitting) decode values in the canonical sorted order of
    `gracecomm.compressors.deepreduce.fitting.canonical_order` and return that order from
    `encode`."""

    codec_id: ClassVar[int]
    sorts: ClassVar[bool] = False
    registry_name: ClassVar[str] = ""

    @property
    def label(self) -> str:
        return f"value codec '{self.registry_name or type(self).__name__}'"

    @abstractmethod
    def encode(self, values: torch.Tensor,
               ctx: CodecCtx) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(section, order): order[i] is the position in `values` of the i-th decoded value
        for ``sorts`` codecs, None for order-preserving ones."""

    @abstractmethod
    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        """n float32 values (in canonical sorted order for ``sorts`` codecs)."""



# ---------------------------------------------------------------------------------------
# Section helpers shared by the codecs.
# ---------------------------------------------------------------------------------------

def pack_fields(fmt: str, *values: int | float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Little-endian fixed-size fields (``struct`` format without byte-order prefix)."""
    return byte_tensor(struct.pack("<" + fmt, *values), device)


def unpack_fields(fmt: str, section: torch.Tensor,
                  what: str) -> tuple[tuple[Any, ...], torch.Tensor]:
    """Read the fields `fmt` from the start of `section`; return them and the rest."""
    size = struct.calcsize("<" + fmt)
    if section.numel() < size:
        raise PayloadError(f"{what}: section holds {section.numel()} bytes, shorter than its "
                           f"{size}-byte header")
    fields = struct.unpack("<" + fmt, section[:size].cpu().numpy().tobytes())
    return fields, section[size:]


def u32_bytes(values: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 2**32) as 4 little-endian bytes each."""
    return values.to(torch.int64).contiguous().view(torch.uint8).view(-1, 8)[:, :4].reshape(-1)


def u32_values(data: torch.Tensor) -> torch.Tensor:
    """Inverse of `u32_bytes` (int64)."""
    if data.numel() % 4:
        raise PayloadError(f"{data.numel()} bytes are not a whole number of u32 fields")
    wide = torch.zeros(data.numel() // 4, 8, dtype=torch.uint8, device=data.device)
    wide[:, :4] = data.view(-1, 4)
    return wide.view(torch.int64).view(-1)


def f32_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float32).contiguous().view(torch.uint8).reshape(-1)


def f32_values(data: torch.Tensor, n: int, what: str) -> torch.Tensor:
    if data.numel() != 4 * n:
        raise PayloadError(f"{what}: {data.numel()} bytes cannot hold {n} float32 values "
                           f"(need {4 * n})")
    return data.clone().view(torch.float32)  # a fresh copy is aligned for the view


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Ascending positions (int64) of the true elements of the 1-D bool `mask`. On the CPU
    numpy's flatnonzero is an order of magnitude faster than torch.nonzero."""
    if kernels_enabled(mask.device):
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().view(-1)


def check_index_set(indices: torch.Tensor, d: int, what: str, *, ascending: bool = True) -> None:
    """Raise unless `indices` lie in [0, d) and, with `ascending`, strictly increase (numpy
    on the CPU: fewer overheads; elsewhere one read by the host)."""
    if indices.numel() == 0:
        return
    if kernels_enabled(indices.device):
        a = indices.numpy()
        lo, hi = int(a.min()), int(a.max())
        increasing = not ascending or bool((a[1:] > a[:-1]).all())
    else:
        checks = [indices.min(), indices.max()]
        if ascending:
            checks.append((indices[1:] > indices[:-1]).all().to(indices.dtype))
        lo, hi, *rest = torch.stack(checks).tolist()
        increasing = not ascending or bool(rest[0])
    if lo < 0 or hi >= d:
        raise PayloadError(f"{what}: indices span [{lo}, {hi}], outside [0, {d})")
    if not increasing:
        raise PayloadError(f"{what}: indices must be strictly ascending (sort them first; "
                           "only raw32 and packed keep any order)")
