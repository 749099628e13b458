"""Bloom-filter index codec (paper Sec. 4, Lemmas 2 and 5, Remark 2; thesis Sec. 5).

Sizing follows the reference library pybloom-live: k = ceil(log2(1/eps)) hash functions,
slice width w = ceil(r ln(1/eps) / (k (ln 2)^2)) and m = k w bits, hash i writing only into
slice i. Hashing uses `policies.mix` (this library's fixed 32-bit hash) with int64 torch ops,
so every rank and device agrees. With seed sigma the bit of x in slice i is
i w + mix(x ^ s_i) mod w, with salts s_i = mix(mix(sigma) + i + 1): k independent hashes, as
in pybloom-live. (Double hashing (h1 + i h2) mod w degenerates for small slices: with w = 2,
i.e. r = 1, every slice bit follows the parity of h1 and the measured false-positive rate is
0.5 instead of 0.001; it stays several times above Lemma 2 up to r ~ 100.)

Decoding queries all d positions slice by slice, each slice testing only the survivors of
the previous ones (about half pass each slice). On the CPU (option ``kernel``, numba) insert,
query and the positives' filter bits are one kernel call each (`bloom_kernels`), with
nothing cached between calls; the torch code (any device) queries in chunks and can cache
the positions of the first `table_slices` slices per tensor (the paper's precomputed table
H^{d,k}, 4 d bytes per slice and tensor for the life of the codec; off by default).
Section: k (u8), w (u32), ceil(m / 8) bytes of bits.
"""

from __future__ import annotations

import functools
import io
import math
import struct
import warnings
from typing import Any, ClassVar

import numpy as np
import torch

from gracecomm.compressors.deepreduce.codec import (
    INDEX_CODECS,
    CodecCtx,
    IndexCodec,
    Selection,
    check_index_set,
    flat_nonzero,
    pack_fields,
    unpack_fields,
)
from gracecomm.compressors.deepreduce.policies import P2_MODES, POLICIES, mix, select
from gracecomm.compressors.shared.stochastic import kernels_enabled
from gracecomm.validation import (
    MissingDependencyError,
    PayloadError,
    check_choice,
    check_range,
    numba_available,
    require_numba,
)
from gracecomm.wire import pack_bits, packed_nbytes, unpack_bits


def bloom_size(r: int, fpr: float) -> tuple[int, int]:
    """(k, w) for r items at false-positive rate `fpr` (Remark 2, pybloom-live rounding):
    m = k w bits, about -r ln(eps) / (ln 2)^2."""
    k = int(math.ceil(math.log(1.0 / fpr, 2)))
    w = int(math.ceil((max(r, 1) * abs(math.log(fpr))) / (k * (math.log(2) ** 2))))
    return k, w


def expected_fpr(r: int, k: int, m: int) -> float:
    """Lemma 2: (1 - e^{-k r / m})^k."""
    return (1.0 - math.exp(-k * r / m)) ** k


@functools.lru_cache(maxsize=1024)
def hash_family(seed: int, k: int, w: int) -> HashFamily:
    """`HashFamily(seed, k, w)`, kept for the filters of the last tensors (a few hundred
    bytes each): sender and receiver build the same family per tensor and step."""
    return HashFamily(seed, k, w)


class HashFamily:
    """The k slice hashes of one filter (seed sigma, slice width w)."""

    def __init__(self, seed: int, k: int, w: int) -> None:
        self.k, self.w = k, w
        base = mix(seed)
        self.salts = [mix(base + i + 1) for i in range(k)]
        self.kernel_args: tuple[np.ndarray, int, np.uint64] | None = None  # NumbaBloom's

    def slice(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Bit positions of the elements `x` in slice i."""
        return mix(x ^ self.salts[i]) % self.w + i * self.w

    def positions(self, x: torch.Tensor) -> torch.Tensor:
        """The |x| x k bit positions."""
        return torch.stack([self.slice(x, i) for i in range(self.k)], dim=1)


class BitBackend:
    """A backend on unpacked filter bits (bool, k w of them); the codec exchanges packed
    bits (`gracecomm.wire.pack_bits`) through `insert_packed` and `query_packed`."""

    def insert(self, indices: torch.Tensor, family: HashFamily) -> torch.Tensor:
        raise NotImplementedError

    def query(self, bits: torch.Tensor, family: HashFamily, d: int,
              cache: tuple[str, int] | None) -> torch.Tensor:
        raise NotImplementedError

    def insert_packed(self, indices: torch.Tensor, family: HashFamily) -> torch.Tensor:
        return pack_bits(self.insert(indices, family))

    def query_packed(self, packed: torch.Tensor, family: HashFamily, d: int,
                     cache: tuple[str, int] | None) -> torch.Tensor:
        return self.query(unpack_bits(packed, family.k * family.w), family, d, cache)


class TorchBloom(BitBackend):
    """Vectorised insert and query (CPU or CUDA). `cache` keys the position table of a
    query by (tensor name, seed); None computes every hash."""

    def __init__(self, table_slices: int, chunk: int) -> None:
        self.table_slices = table_slices
        self.chunk = chunk
        self.tables: dict[str, tuple[tuple[Any, ...], list[torch.Tensor]]] = {}

    def insert(self, indices: torch.Tensor, family: HashFamily) -> torch.Tensor:
        bits = torch.zeros(family.k * family.w, dtype=torch.bool, device=indices.device)
        bits[family.positions(indices).reshape(-1)] = True
        return bits

    def _table(self, cache: tuple[str, int], d: int, family: HashFamily,
               device: torch.device) -> list[torch.Tensor]:
        """Cached int32 positions of the first slices for all d elements (one per tensor)."""
        name, seed = cache
        slices = min(self.table_slices, family.k)
        key = (seed, d, family.k, family.w, slices, str(device))
        cached = self.tables.get(name)
        if cached is None or cached[0] != key:
            x = torch.arange(d, device=device)
            cached = (key, [torch.cat([family.slice(x[a:a + self.chunk], i).to(torch.int32)
                                       for a in range(0, d, self.chunk)])
                            for i in range(slices)])
            self.tables[name] = cached
        return cached[1]

    def query(self, bits: torch.Tensor, family: HashFamily, d: int,
              cache: tuple[str, int] | None) -> torch.Tensor:
        """Ascending positives P among 0..d-1."""
        device = bits.device
        table = self._table(cache, d, family, device) if cache and self.table_slices else []
        found = []
        for start in range(0, d, self.chunk):
            stop = min(d, start + self.chunk)
            x = None  # survivors so far (absolute positions); None = the whole chunk
            for i in range(family.k):
                if i < len(table):
                    pos = table[i][start:stop] if x is None else table[i].index_select(0, x)
                else:
                    if x is None:
                        x = torch.arange(start, stop, device=device)
                    pos = family.slice(x, i)
                keep = flat_nonzero(bits.index_select(0, pos))
                x = keep + start if x is None else x.index_select(0, keep)
            found.append(x)
        return torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=device)

    def positions(self, x: torch.Tensor, family: HashFamily) -> torch.Tensor:
        return family.positions(x)


@functools.cache
def _kernels() -> Any:
    """The numba kernels (imported on first use: numba is optional)."""
    from gracecomm.compressors.deepreduce import bloom_kernels

    return bloom_kernels


class NumbaBloom:
    """The kernels of `bloom_kernels` on packed bits (CPU): one call per insert, query and
    positions, no cache."""

    @property
    def kernels(self) -> Any:
        return _kernels()

    def _hash(self, family: HashFamily) -> tuple[np.ndarray, int, np.uint64]:
        if family.kernel_args is None:  # families are shared (`hash_family`): once each
            family.kernel_args = self.kernels.hash_args(family.salts, family.w)
        return family.kernel_args

    def insert_packed(self, indices: torch.Tensor, family: HashFamily) -> torch.Tensor:
        return torch.from_numpy(self.kernels.insert(indices.numpy(), *self._hash(family)))

    def query_packed(self, packed: torch.Tensor, family: HashFamily, d: int,
                     cache: tuple[str, int] | None) -> torch.Tensor:
        expected = family.k * family.w // 4  # about 2 r at the usual rates; the buffer grows
        return torch.from_numpy(self.kernels.query(packed.numpy(), *self._hash(family), d,
                                                   expected))

    def positions(self, x: torch.Tensor, family: HashFamily) -> torch.Tensor:
        return torch.from_numpy(self.kernels.slots(x.numpy(), *self._hash(family)))

    def policy(self, policy: str, mode: str) -> int | None:
        """The kernels' code of a policy they apply in `sender`/`receiver` (P0, P2)."""
        if policy == "p0":
            return self.kernels.P0
        if policy == "p2":
            return self.kernels.P2_ROUND_ROBIN if mode == "round_robin" else self.kernels.P2_COVER
        return None

    def sender(self, indices: torch.Tensor, family: HashFamily, d: int, step_seed: int,
               policy: int) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, int]:
        """(packed filter, number of positives, selection, which of it is true and how
        many)."""
        packed, count, chosen, true, hits = self.kernels.sender(
            indices.numpy(), *self._hash(family), d, mix(step_seed), policy)
        return torch.from_numpy(packed), int(count), torch.from_numpy(chosen), \
            torch.from_numpy(true), int(hits)

    def receiver(self, packed: torch.Tensor, family: HashFamily, d: int, n: int,
                 step_seed: int, policy: int) -> tuple[int, torch.Tensor]:
        """(number of positives, the selection of n)."""
        count, chosen = self.kernels.receiver(packed.numpy(), *self._hash(family), d, n,
                                              mix(step_seed), policy)
        return int(count), torch.from_numpy(chosen)


class PyBloom(BitBackend):
    """pybloom-live as a slow reference backend: its own hashes (no seed), the same
    sizing and section layout; one Python call per inserted and per queried element."""

    def __init__(self, fpr: float) -> None:
        try:
            import pybloom_live
        except ImportError:
            raise MissingDependencyError("backend 'pybloom' needs pybloom-live: pip install "
                                    "'gracecomm[bloom]'") from None
        self.lib = pybloom_live
        self.fpr = fpr

    def _filter(self, bits: torch.Tensor, family: HashFamily) -> Any:
        head = struct.pack(self.lib.BloomFilter.FILE_FMT.decode(), self.fpr, family.k,
                           family.w, 1, 0)
        data = pack_bits(bits).cpu().numpy().tobytes()
        return self.lib.BloomFilter.fromfile(io.BytesIO(head + data))

    def insert(self, indices: torch.Tensor, family: HashFamily) -> torch.Tensor:
        bf = self.lib.BloomFilter(capacity=max(indices.numel(), 1), error_rate=self.fpr)
        for x in indices.tolist():
            bf.add(x, skip_check=True)
        data = torch.frombuffer(bytearray(bf.bitarray.tobytes()), dtype=torch.uint8)
        return unpack_bits(data, family.k * family.w).to(indices.device)

    def query(self, bits: torch.Tensor, family: HashFamily, d: int,
              cache: tuple[str, int] | None) -> torch.Tensor:
        bf = self._filter(bits, family)
        return torch.tensor([x for x in range(d) if x in bf], dtype=torch.int64,
                            device=bits.device)

    def positions(self, x: torch.Tensor, family: HashFamily) -> torch.Tensor:
        bf = self._filter(torch.zeros(family.k * family.w, dtype=torch.bool), family)
        offsets = [i * family.w for i in range(family.k)]
        rows = [[o + h for o, h in zip(offsets, bf.make_hashes(v))] for v in x.tolist()]
        return torch.tensor(rows, dtype=torch.int64, device=x.device).view(-1, family.k)


@INDEX_CODECS.register("bloom")
class BloomIndex(IndexCodec):
    """Bloom-filter index compression with a decoding policy (see
    `gracecomm.compressors.deepreduce.policies`). Except for ``naive``, the sender runs the decoder
    and sends the values of the decoded selection S~ in ascending order (false-positive
    aware): ``value_source: dense`` sends t at false positives, ``sparse`` sends zeros there.

    Options: ``fpr`` (target false-positive rate eps), ``policy``, ``p2_mode``
    (``round_robin``: Algorithm 1; ``cover``: thesis prioritisation), ``backend``
    (``torch`` or ``pybloom``, the slow reference), ``kernel`` (``auto``, ``numba``:
    the numba kernels for CPU tensors and P2; ``python``: the torch code and plain-Python
    P2), ``reseed_every_step`` (new hash seed each step instead of a fixed one per
    tensor), and for the torch code ``table_slices`` (slices whose positions are cached per
    tensor, 4 d bytes each; 0 = compute every hash) and ``chunk`` (positions queried at
    once)."""

    codec_id = 8
    run_keys = {"fpr": "experiment.fpr"}  # an experiment's rate, where it sets one
    BACKENDS: ClassVar[tuple[str, ...]] = ("torch", "pybloom")
    HEADER: ClassVar[str] = "BI"

    def __init__(self, fpr: float = 0.001, policy: str = "p0", p2_mode: str = "round_robin",
                 value_source: str = "dense", backend: str = "torch", kernel: str = "auto",
                 reseed_every_step: bool = False, table_slices: int = 0,
                 chunk: int = 1 << 22) -> None:
        self.fpr = float(check_range(fpr, self.label, "fpr", 0.0, 1.0, low_open=True,
                                     high_open=True))
        self.policy = check_choice(policy, POLICIES, self.label, "policy")
        self.p2_mode = check_choice(p2_mode, P2_MODES, self.label, "p2_mode")
        self.value_source = check_choice(value_source, ("dense", "sparse"), self.label,
                                         "value_source")
        backend = check_choice(backend, self.BACKENDS, self.label, "backend")
        kernel = check_choice(kernel, ("auto", "numba", "python"), self.label, "kernel")
        self.kernel = kernel
        self.compiled = kernel == "numba" or (kernel == "auto" and numba_available())
        if kernel == "numba":
            require_numba(f"{self.label}: kernel 'numba'", "kernel: python")
        self.reseed_every_step = bool(reseed_every_step)
        self.table_slices = check_range(table_slices, self.label, "table_slices", 0,
                                        integer=True)
        self.chunk = check_range(chunk, self.label, "chunk", 1, integer=True)
        self.sends_all_positives = self.policy == "p0"
        self.backend: TorchBloom | PyBloom = (PyBloom(self.fpr) if backend == "pybloom" else
                                              TorchBloom(self.table_slices, self.chunk))
        self.kernels = NumbaBloom() if self.compiled and backend == "torch" else None
        if self.policy == "naive":
            warnings.warn(f"{self.label}: policy 'naive' shifts every value after a false "
                          "positive; with error feedback these errors accumulate (thesis "
                          "Sec. 6.3); prefer p0, p1 or p2", stacklevel=2)

    # -- pieces shared by sender and receiver ----------------------------------------------
    def _seed(self, ctx: CodecCtx) -> int:
        return ctx.step_seed if self.reseed_every_step else ctx.tensor_seed

    def _family(self, ctx: CodecCtx, k: int, w: int) -> HashFamily:
        return hash_family(self._seed(ctx), k, w)

    def _backend(self, device: torch.device) -> TorchBloom | PyBloom | NumbaBloom:
        if self.kernels is None or device.type != "cpu":
            return self.backend
        return self.kernels if self.kernel == "numba" or kernels_enabled(device) else \
            self.backend

    def _query(self, packed: torch.Tensor, family: HashFamily, ctx: CodecCtx) -> torch.Tensor:
        cache = None if self.reseed_every_step else (ctx.name, ctx.tensor_seed)
        return self._backend(packed.device).query_packed(packed, family, ctx.d, cache)

    def _select(self, positives: torch.Tensor, r: int, family: HashFamily,
                ctx: CodecCtx) -> torch.Tensor:
        backend = self._backend(positives.device)
        return select(self.policy, positives, r, ctx.step_seed,
                      lambda x: backend.positions(x, family), self.p2_mode, self.compiled)

    def _fused(self, device: torch.device) -> int | None:
        """The kernels' policy code when one kernel call does a side's whole work."""
        if self._backend(device) is not self.kernels:
            return None
        return self.kernels.policy(self.policy, self.p2_mode)

    def _encode_select(self, indices: torch.Tensor, ctx: CodecCtx
                       ) -> tuple[HashFamily, torch.Tensor, int, torch.Tensor, torch.Tensor, int]:
        """(family, packed filter, number of positives, selection, which of it is true and
        how many)."""
        k, w = bloom_size(indices.numel(), self.fpr)
        family = self._family(ctx, k, w)
        policy = self._fused(indices.device)
        if policy is not None:
            return family, *self.kernels.sender(indices, family, ctx.d, ctx.step_seed, policy)
        packed = self._backend(indices.device).insert_packed(indices, family)
        positives = self._query(packed, family, ctx)
        chosen = self._select(positives, indices.numel(), family, ctx)
        true = torch.isin(chosen, indices)
        return family, packed, positives.numel(), chosen, true, int(true.sum())

    # -- codec interface -------------------------------------------------------------------
    def encode(self, indices: torch.Tensor, ctx: CodecCtx) -> torch.Tensor:
        check_index_set(indices, ctx.d, self.label)
        k, w = bloom_size(indices.numel(), self.fpr)
        family = self._family(ctx, k, w)
        packed = self._backend(indices.device).insert_packed(indices.to(torch.int64), family)
        return self._section(family, packed)

    def _section(self, family: HashFamily, packed: torch.Tensor) -> torch.Tensor:
        return torch.cat([pack_fields(self.HEADER, family.k, family.w, device=packed.device),
                          packed])

    def select(self, indices: torch.Tensor, flat: torch.Tensor, ctx: CodecCtx) -> Selection:
        """Build the filter, run the receiver's decoder and choose the values to send."""
        check_index_set(indices, ctx.d, self.label)
        indices = indices.to(torch.int64)
        r = indices.numel()
        family, packed, count, chosen, true_chosen, hits = self._encode_select(indices, ctx)
        stats = {"bloom_positives": count, "bloom_false_positives": count - r,
                 "bloom_negatives": ctx.d - r, "bloom_selected": chosen.numel(),
                 "bloom_policy_errors": chosen.numel() - hits}
        if self.policy == "naive":
            values_at = indices
            values = flat.index_select(0, indices)
        else:
            values_at = chosen
            values = flat.index_select(0, chosen)
            if self.value_source == "sparse":
                values = torch.where(true_chosen, values, torch.zeros_like(values))
        return Selection(values_at, values, self._section(family, packed), stats)

    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        (k, w), body = unpack_fields(self.HEADER, section, self.label)
        want_k = bloom_size(1, self.fpr)[0]
        if k != want_k or w == 0 or body.numel() != packed_nbytes(k * w, 1):
            raise PayloadError(f"{self.label}: filter of k = {k} slices of {w} bits in "
                               f"{body.numel()} bytes; fpr {self.fpr} needs k = {want_k} and "
                               f"ceil(k w / 8) bytes")
        family = self._family(ctx, k, w)
        policy = self._fused(body.device)
        if policy is not None:
            count, chosen = self.kernels.receiver(body, family, ctx.d, n, ctx.step_seed, policy)
        else:
            positives = self._query(body, family, ctx)
            count = positives.numel()
            chosen = self._select(positives, n, family, ctx) if n <= count else positives
        if n > count or (self.sends_all_positives and n != count):
            why = " (policy p0 sends one per positive)" if self.sends_all_positives else ""
            raise PayloadError(f"{self.label}: the filter has {count} positives, "
                               f"the header announces {n} values{why}")
        return chosen
