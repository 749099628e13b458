"""How LGC sees a model (Abrahamyan et al., TNNLS, Secs. V-A and VI-A): the partition of the
parameter tensors into F (sent dense), M (top-k, then the autoencoder) and Lambda (plain
top-k), the per-layer sizes k_l and m_l, the layer-wise exact top-k, the innovation of
Algorithm 1 and the DEFLATE-coded index streams.

Vectors follow one convention: the top-k vector g~ holds the layers of M in parameter order,
each layer's k_l values in ascending index order; the Lambda values follow in the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar

import torch

from gracecomm.compressor import Payload, TensorInfo
from gracecomm.compressors.shared.deflate import deflate, inflate
from gracecomm.compressors.shared.exceedance import top_k
from gracecomm.validation import ConfigError, PayloadError
from gracecomm.wire import VARINT_MAX_BYTES, varint_bytes, varint_values

Groups = str | Sequence[str] | None  # "auto", None (no such group) or names / module prefixes


def ceil_fraction(fraction: float, n: int) -> int:
    """ceil(fraction * n) computed exactly on the decimal value of `fraction` (0.001 * 1000
    is 1, not 1.0000000000000002)."""
    return math.ceil(Fraction(repr(float(fraction))) * n)


def module_of(name: str) -> str:
    """The module a parameter belongs to: 'features.0.weight' -> 'features.0'."""
    return name.rpartition(".")[0]


def _members(option: str, spec: Groups, names: Sequence[str], auto: str) -> set[int]:
    if spec == "auto":
        return {i for i, n in enumerate(names) if module_of(n) == auto}
    if spec is None:
        return set()
    if isinstance(spec, str):
        spec = [spec]
    out: set[int] = set()
    for entry in spec:
        hits = {i for i, n in enumerate(names) if n == entry or n.startswith(f"{entry}.")}
        if not hits:
            raise ConfigError(f"compressor 'lgc': option '{option}' names {entry!r}, which is "
                              f"neither a parameter nor a module of the model; parameters: "
                              f"{', '.join(names)}")
        out |= hits
    return out


@dataclass(frozen=True)
class Plan:
    """Partition and sizes of one model's gradients (Sec. VI-A). Positions refer to the
    order of the tensors handed to the compressor (`named_parameters()` order)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dense: tuple[int, ...]   # F
    middle: tuple[int, ...]  # M
    last: tuple[int, ...]    # Lambda
    k: tuple[int, ...]       # per position of `sparse`: k_l
    m: tuple[int, ...]       # per position of `middle`: m_l (innovation sizes)
    offsets: tuple[int, ...] = field(init=False)  # each tensor's start in the flat model vector

    def __post_init__(self) -> None:
        starts, pos = [], 0
        for shape in self.shapes:
            starts.append(pos)
            pos += shape.numel()
        object.__setattr__(self, "offsets", tuple(starts))

    @classmethod
    def build(cls, names: Sequence[str], shapes: Sequence[torch.Size], ratio: float,
              first_layer: Groups = "auto", last_layer: Groups = "auto",
              innovation: tuple[str, float] = ("fraction_of_topk", 0.1)) -> Plan:
        """F: the first parameter-owning module (`first_layer: auto`), Lambda: the last one,
        M: the rest; k_l = max(1, ceil(ratio * n_l)); m_l = max(1, ceil(beta * k_l)) or, with
        ``fraction_of_tensor``, max(1, ceil(gamma * n_l)), at most k_l."""
        names = tuple(names)
        first = _members("first_layer", first_layer, names, module_of(names[0]))
        last = _members("last_layer", last_layer, names, module_of(names[-1])) - first
        middle = tuple(i for i in range(len(names)) if i not in first and i not in last)
        numel = [s.numel() for s in shapes]
        big = [names[i] for i in range(len(names)) if numel[i] >= 2**31]
        if big:
            raise ConfigError(f"compressor 'lgc': tensors {big} have 2**31 or more elements; "
                              "index streams are int32")
        sparse = middle + tuple(sorted(last))
        k = tuple(max(1, ceil_fraction(ratio, numel[i])) for i in sparse)
        mode, fraction = innovation
        base = k[:len(middle)] if mode == "fraction_of_topk" else [numel[i] for i in middle]
        m = tuple(min(k_l, max(1, ceil_fraction(fraction, b))) for k_l, b in zip(k, base))
        return cls(names, tuple(torch.Size(s) for s in shapes), tuple(sorted(first)), middle,
                   tuple(sorted(last)), k, m)

    # -- sizes (Sec. V-A) -------------------------------------------------------------------
    @property
    def sparse(self) -> tuple[int, ...]:
        """Positions of M then Lambda: the layers that are top-k sparsified."""
        return self.middle + self.last

    @property
    def n(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def n_dense(self) -> int:
        return sum(self.shapes[i].numel() for i in self.dense)

    @property
    def mu(self) -> int:
        return sum(self.k[:len(self.middle)])

    @property
    def kappa(self) -> int:
        return sum(self.k[len(self.middle):])

    @property
    def nu(self) -> int:
        return sum(self.m)

    # -- selection --------------------------------------------------------------------------
    def topk(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Exact per-layer top-k of |a_l| on M and Lambda, indices ascending (int64; ties to
        the lowest index, `gracecomm.compressors.shared.exceedance.top_k`)."""
        return [top_k(tensors[i].reshape(-1), k)[0] for i, k in zip(self.sparse, self.k)]

    def values(self, tensors: Sequence[torch.Tensor],
               indices: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(g~ of length mu, the kappa Lambda values) of `tensors` at `indices`."""
        vals = [tensors[i].reshape(-1)[idx] for i, idx in zip(self.sparse, indices)]
        cut = len(self.middle)
        like = tensors[0].reshape(-1)[:0]
        return torch.cat(vals[:cut] or [like]), torch.cat(vals[cut:] or [like])

    def dense_part(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The F tensors, flattened and concatenated (n_F values)."""
        parts = [tensors[i].reshape(-1) for i in self.dense]
        return torch.cat(parts) if parts else tensors[0].reshape(-1)[:0]

    def flat_positions(self, indices: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions in the flat model vector of the M and the Lambda selections."""
        flat = [self.offsets[i] + idx for i, idx in zip(self.sparse, indices)]
        cut = len(self.middle)
        empty = torch.empty(0, dtype=torch.int64, device=indices[0].device if indices else None)
        return torch.cat(flat[:cut] or [empty]), torch.cat(flat[cut:] or [empty])

    def dense_positions(self, device: torch.device) -> torch.Tensor:
        """Positions of the F elements in the flat model vector."""
        parts = [torch.arange(self.offsets[i], self.offsets[i] + self.shapes[i].numel(),
                              device=device) for i in self.dense]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)

    def views(self, tensors: Sequence[torch.Tensor], indices: Sequence[torch.Tensor] | None
              ) -> list[tuple[Payload, TensorInfo]]:
        """Per tensor, what its memory sees (`Compressor.compress_model`): F (and everything
        when `indices` is None) as ``(values,)``, M and Lambda as ``(values, indices)``."""
        out: list[tuple[Payload, TensorInfo]] = [((t.reshape(-1),), TensorInfo.of(t))
                                                 for t in tensors]
        if indices is not None:
            for i, idx in zip(self.sparse, indices):
                flat = tensors[i].reshape(-1)
                out[i] = ((flat[idx], idx.to(torch.int32)), TensorInfo.of(tensors[i]))
        return out

    # -- innovation (Algorithm 1) -------------------------------------------------------------
    def innovation(self, topk_vector: torch.Tensor) -> torch.Tensor:
        """Positions in [0, mu), ascending, of the m_l largest |values| of each M layer's
        k_l entries of the top-k vector."""
        counts = torch.tensor(self.k[:len(self.middle)], dtype=torch.int64,
                              device=topk_vector.device)
        layer = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
        by_size = torch.sort(topk_vector.abs(), descending=True, stable=True).indices
        order = by_size[torch.sort(layer[by_size], stable=True).indices]
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(len(order), device=order.device) - starts[layer[order]]
        m = torch.tensor(self.m, dtype=torch.int64, device=counts.device)
        return order[rank < m[layer[order]]].sort().values

    # -- index streams (Sec. V-A, DEFLATE) --------------------------------------------------
    def encode_indices(self, indices: Sequence[torch.Tensor],
                       coding: IndexCoding) -> torch.Tensor:
        """Idx(I): the M and Lambda selections as a DEFLATE stream."""
        flat = torch.cat(list(indices)) if indices else torch.empty(0, dtype=torch.int64)
        return coding.encode(flat, self.k)

    def decode_indices(self, stream: torch.Tensor, coding: IndexCoding) -> list[torch.Tensor]:
        bounds = [self.shapes[i].numel() for i in self.sparse]
        return list(coding.decode(stream, self.k, bounds).split(list(self.k)))

    def encode_positions(self, positions: torch.Tensor, coding: IndexCoding) -> torch.Tensor:
        """Idx(P): innovation positions, each layer's relative to its offset o_l in g~."""
        return coding.encode(positions - self._layer_starts(positions.device, self.m), self.m)

    def decode_positions(self, stream: torch.Tensor, coding: IndexCoding) -> torch.Tensor:
        local = coding.decode(stream, self.m, self.k[:len(self.middle)])
        return local + self._layer_starts(local.device, self.m)

    def _layer_starts(self, device: torch.device, counts: Sequence[int]) -> torch.Tensor:
        """o_l of each M layer in g~, repeated `counts[l]` times."""
        k = torch.tensor(self.k[:len(self.middle)], dtype=torch.int64, device=device)
        repeats = torch.tensor(counts, dtype=torch.int64, device=device)
        return torch.repeat_interleave(torch.cumsum(k, 0) - k, repeats)


@dataclass(frozen=True)
class IndexCoding:
    """How an index stream is coded (Sec. V-A: "entropy encoded using the DEFLATE compression
    method"): layers in order; per layer the first index, then successive differences (with
    `delta`), written as little-endian int32 (`format="int32"`) or as LEB128 varints
    (`"varint"`, `gracecomm.wire.varint_bytes`), then DEFLATE at `zlib_level`
    (`gracecomm.compressors.shared.deflate`). Indices are ascending within a layer, so every
    written value is non-negative."""

    delta: bool = True
    zlib_level: int = 9
    format: str = "int32"

    FORMATS: ClassVar[tuple[str, ...]] = ("int32", "varint")

    def encode(self, indices: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """The stream of the concatenated per-layer `indices` (layer l holds counts[l])."""
        x = indices.to(torch.int64)
        if self.delta and x.numel():
            d = x.clone()
            d[1:] -= x[:-1]
            starts, _ = _segments(counts, x.device)
            d[starts] = x[starts]
            x = d
        data = (varint_bytes(x.cpu()) if self.format == "varint"
                else x.to(torch.int32).cpu().view(torch.uint8))
        return deflate(data, self.zlib_level).to(indices.device)

    def decode(self, stream: torch.Tensor, counts: Sequence[int],
               bounds: Sequence[int]) -> torch.Tensor:
        """Inverse of `encode`; raises `PayloadError` unless the stream holds exactly
        sum(counts) indices with layer l's in [0, bounds[l])."""
        total = sum(counts)
        if self.format == "varint":
            x = varint_values(inflate(stream, VARINT_MAX_BYTES * total, at_most=True), total)
        else:
            x = inflate(stream, 4 * total).view(torch.int32).to(torch.int64)
        if not total:
            return x
        if self.delta:
            c = torch.cumsum(x, 0)
            starts, sizes = _segments(counts, x.device)
            before = torch.where(starts > 0, c[(starts - 1).clamp(min=0)], 0)
            x = c - torch.repeat_interleave(before, sizes)
        bound = torch.repeat_interleave(
            torch.tensor(bounds, dtype=torch.int64, device=x.device),
            torch.tensor(counts, dtype=torch.int64, device=x.device))
        if bool(((x < 0) | (x >= bound)).any()):
            raise PayloadError("index stream holds indices outside their layers' ranges")
        return x


def _segments(counts: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and size of every non-empty segment of a concatenation with these counts."""
    c = torch.tensor(counts, dtype=torch.int64, device=device)
    keep = c > 0
    return (torch.cumsum(c, 0) - c)[keep], c[keep]
