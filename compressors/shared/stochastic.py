"""Rank-local random numbers for stochastic rounding (natural compression, dithering, QSGD,
TernGrad).

Unlike `gracecomm.rng.SharedStreams`, whose seeds agree on every rank, these draws must be
independent across ranks (averaging independent roundings is what reduces variance), across
tensors and across steps: the key of one call is H(seed, tensor name, call count, rank).

Two generators with the same distribution (uniform integers in [0, 2**bits)), chosen by the
option ``rng``:

- ``counter``: a keyed counter-based hash of the element index, h(i) = mix(i, key). Any
  element's number can be computed on its own, so a fused kernel can draw and round in one
  pass. The numba kernels (`gracecomm.compressors.shared.quantizer_kernels`, CPU, optional)
  and the torch implementation here (CPU and CUDA) return the same bits.
- ``torch``: ``torch.randint`` with a ``torch.Generator`` seeded with the key.

The mixer is a two-key variant of the MurmurHash3 32-bit finaliser: x = i ^ k1;
x *= 0x9E3779B1; x ^= x >> 16; x += k2; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35;
x ^= x >> 16 (all mod 2**32). For a fixed key it is a bijection of the 32-bit counter, so one
call supports tensors of fewer than 2**32 elements; wider numbers (52 bits for float64)
combine two keys.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gracecomm.rng import SharedStreams, stable_hash
from gracecomm.validation import ConfigError, check_choice, numba_available

RNGS = ("counter", "torch")
MASK32 = 0xFFFFFFFF
MUL1, MUL2, MUL3 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35
COUNTER_LIMIT = 2**32


def check_rng(value: Any, owner: str) -> str:
    """Validate the option ``rng`` (counter | torch)."""
    return check_choice(value, RNGS, owner, "rng")


def split_key(key: int) -> tuple[int, int]:
    """The two 32-bit halves (k1, k2) of a 64-bit key."""
    return key & MASK32, (key >> 32) & MASK32


class RandomStreams(SharedStreams):
    """Per-tensor call counters like `SharedStreams`, with the rank mixed into every key so
    that ranks draw independently. Part of the owning compressor's ``state_dict``."""

    def next_key(self, name: str, rank: int) -> int:
        """The 63-bit key of the next call with `name` on `rank`."""
        return stable_hash(self.next_seed(name), "rank", rank)


# GRACECOMM_KERNELS=0 forces the torch code paths (they give the same bits as the kernels).
KERNELS = os.environ.get("GRACECOMM_KERNELS", "1") != "0"


def kernels_enabled(device: torch.device) -> bool:
    """Whether the CPU fast paths run for data on `device` where a method chooses them
    itself (``auto``): CPU, numba installed, not disabled by GRACECOMM_KERNELS=0 or
    `torch_paths`. Every automatic choice of a CPU-only path asks this: the numba kernels
    (the quantizers' and Random-k's `gracecomm.compressors.shared.quantizer_kernels`, the
    sparsifiers' `gracecomm.compressors.shared.exceedance`, DeepReduce's Bloom filter) and the numpy
    shortcuts of DeepReduce's index checks."""
    return KERNELS and device.type == "cpu" and numba_available()


@contextlib.contextmanager
def torch_paths() -> Iterator[None]:
    """Within the block, methods choose their torch code paths on the CPU too, as they do
    on every other device (kernels asked for by name, ``backend=numba``, still run): the
    code a CUDA tensor takes, run and compared bit for bit on a machine without a GPU
    (`gracecomm.experiments.checks.gpucheck`). Process-wide while it lasts."""
    global KERNELS
    before, KERNELS = KERNELS, False
    try:
        yield
    finally:
        KERNELS = before


def use_kernels(tensor: torch.Tensor) -> bool:
    """`kernels_enabled` for a float32 tensor (the kernels read float32 bit patterns)."""
    return tensor.dtype == torch.float32 and kernels_enabled(tensor.device)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for int64 `x` in [0, 2**32) without overflowing int64: the constant is
    split into 16-bit halves so that every product stays below 2**48."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def counter_hash(index: torch.Tensor, key: int) -> torch.Tensor:
    """mix(index, key) as int64 in [0, 2**32), elementwise, for int64 indices below 2**32
    (the torch implementation of the counter generator; any device)."""
    k1, k2 = split_key(key)
    x = index ^ k1
    x = _mul32(x, MUL1)
    x = x ^ (x >> 16)
    x = (x + k2) & MASK32
    x = _mul32(x, MUL2)
    x = x ^ (x >> 13)
    x = _mul32(x, MUL3)
    return x ^ (x >> 16)


def second_key(key: int) -> int:
    """A key independent of `key`, for the low bits of numbers wider than 32 bits."""
    return stable_hash(key, "low")


def random_bits(n: int, bits: int, key: int, device: torch.device | str, rng: str) -> torch.Tensor:
    """`n` integers uniform in [0, 2**bits), 1 <= bits <= 62, for one call's `key`: int32 for
    up to 31 bits, int64 above."""
    if not 1 <= bits <= 62:
        raise ValueError(f"random_bits: bits must be in [1, 62], got {bits}")
    dtype = torch.int32 if bits <= 31 else torch.int64
    device = torch.device(device)
    if rng == "torch":
        gen = torch.Generator(device=device)
        gen.manual_seed(key)
        return torch.randint(0, 2**bits, (n,), generator=gen, device=device, dtype=dtype)
    if bits > 32:
        high = random_bits(n, 30, key, device, rng).to(torch.int64)
        return (high << (bits - 30)) | random_bits(n, bits - 30, second_key(key), device, rng)
    return (_counter(n, key, device) >> (32 - bits)).to(dtype)


def _counter(n: int, key: int, device: torch.device) -> torch.Tensor:
    """mix(i, key) for i < n as int64 (numba kernel on CPU when installed, else torch)."""
    if n > COUNTER_LIMIT:
        raise ConfigError(f"rng 'counter' draws for tensors of at most 2**32 elements, got {n}; "
                          "use rng=torch")
    if kernels_enabled(device):
        from gracecomm.compressors.shared.quantizer_kernels import hash_array

        return torch.from_numpy(hash_array(n, key).view("int32")).to(torch.int64) & MASK32
    return counter_hash(torch.arange(n, dtype=torch.int64, device=device), key)


def uniform(n: int, key: int, device: torch.device | str, rng: str) -> torch.Tensor:
    """`n` float32 numbers uniform on the grid {j / 2**24 : 0 <= j < 2**24} (exact in float32),
    so P(u < q) = ceil(q * 2**24) / 2**24 for q in [0, 1]."""
    device = torch.device(device)
    if rng == "counter" and kernels_enabled(device) and n <= COUNTER_LIMIT:
        from gracecomm.compressors.shared.quantizer_kernels import uniform_array

        return torch.from_numpy(uniform_array(n, key))
    return random_bits(n, 24, key, device, rng).to(torch.float32).mul_(2.0**-24)


# ---------------------------------------------------------------------------------------
# Natural rounding (Horvath et al., "Natural Compression", Sec. 3): C_nat(t) is sign(t) 2^k
# or sign(t) 2^(k+1), k = floor(log2 |t|), with P(up) = (|t| - 2^k) / 2^k, the mantissa.
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FloatBits:
    """IEEE-754 layout of a float dtype: the integer view, mantissa and exponent widths."""

    int_dtype: torch.dtype
    mantissa: int
    exponent: int

    @property
    def max_biased(self) -> int:
        """The largest biased exponent of a finite number (all ones is Inf/NaN)."""
        return (1 << self.exponent) - 2

    @property
    def bias(self) -> int:
        return (1 << (self.exponent - 1)) - 1


FLOAT_BITS = {torch.float32: FloatBits(torch.int32, 23, 8),
              torch.float64: FloatBits(torch.int64, 52, 11)}


def natural_round_bits(bits: torch.Tensor, r: torch.Tensor | int,
                       layout: FloatBits) -> torch.Tensor:
    """Bit patterns of C_nat for the finite float bit patterns `bits`, given uniform integers
    `r` in [0, 2**mantissa): (bits + r) with the mantissa cleared. The carry out of the
    mantissa happens with probability M / 2**mantissa and increments the exponent; the sign
    bit is never touched. A constant r = 2**(mantissa - 1) rounds deterministically to the
    nearer power of two (ties up). Exponents may reach the Inf pattern (the caller saturates)."""
    return (bits + r) & -(1 << layout.mantissa)


def natural_round(x: torch.Tensor, key: int, rng: str) -> torch.Tensor:
    """C_nat(x) for a finite float32/float64 tensor, saturating at the largest finite power
    of two (used for small tensors such as per-bucket norms)."""
    layout = FLOAT_BITS[x.dtype]
    r = random_bits(x.numel(), layout.mantissa, key, x.device, rng).view(x.shape)
    out = natural_round_bits(x.view(layout.int_dtype), r.to(layout.int_dtype), layout)
    sign = -1 << (layout.mantissa + layout.exponent)
    top = layout.max_biased << layout.mantissa
    return torch.where((out & ~sign) > top, (out & sign) | top, out).view(x.dtype)
