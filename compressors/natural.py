"""Natural compression C_nat (Horvath, Ho, Horvath, Sahu, Canini, Richtarik: *Natural
Compression for Distributed Deep Learning*, 2019, Sec. 3).

Every element t != 0 becomes sign(t) 2^k or sign(t) 2^(k+1), k = floor(log2 |t|), rounding up
with probability (|t| - 2^k) / 2^k, which for IEEE floats is the mantissa M / 2^23. Unbiased,
with E[C(t)^2] <= 9/8 t^2 (Theorem 1: C_nat is in B(9/8)). One pass on the int32 view b:
(b + R) & 0xFF800000 with R uniform in [0, 2^23): the carry out of the mantissa is the
rounding up (`gracecomm.compressors.shared.stochastic.natural_round_bits`).

Wire formats (option ``wire``; payload bytes for n elements):

- ``nat9`` (default): exponent plane (n bytes, biased exponent, 0 = zero, 255 reserved) +
  sign plane (ceil(n/8) bytes, LSB-first): n + ceil(n/8) bytes, 9/32 of float32. float64
  tensors use 12-bit codes sign << 11 | E instead (ceil(12 n / 8) bytes, 12/64).
- ``nat8``: one byte per element: bit 7 sign, bit 6 zero flag, bits 5-0 offset e - e_min for
  exponents in ``exp_range`` = [e_min, e_max] (default [-50, 10]); n bytes, 8/32.
  Below 2^e_min, ``low_clip`` decides: ``stochastic`` (unbiased: 2^e_min with probability
  |C(t)| / 2^e_min, else 0), ``flush`` (0) or ``clamp`` (2^e_min); above 2^e_max values
  saturate. Both biased cases are counted (``low_clipped``, ``saturated``).
- ``float32``: C_nat(t) as float32 (debugging; no saving).
- ``int_fixed``: the paper's in-network aggregation emulated: sign 2^(e - e_min) as int64,
  summable by allreduce (8 bytes per element, no saving on NCCL/Gloo). Needs
  world_size * 2^(e_max - e_min) < 2^63, checked when the pipeline is built.

Edge rules: zeros keep their sign; denormals round to 0 or +-2^-126 (still unbiased); a value
that would round past the largest finite power of two saturates to it (``overflow:
saturate``, counted as ``saturated``) or raises (``overflow: raise``): a finite value never
becomes Inf. Inf/NaN raise naming the tensor (``nonfinite: raise``) or become 0 (``nonfinite:
zero``, counted as ``nonfinite``). float16 and bfloat16 are rounded in float32 and cast back
(float16 saturates at 2^15); float64 uses the same recipe on 52-bit mantissas (nat9 wire only).

``rounding: deterministic`` rounds to the nearer power of two ((b + 2^22) & 0xFF800000, ties
up): biased (relative error at most 1/3), no random numbers; pair it with residual memory.

Random numbers (``rng``): ``counter`` draws mix(element index, key)
(`gracecomm.compressors.shared.stochastic`); on CPU with numba installed a fused kernel draws,
rounds and writes the nat9 planes in one pass.
``torch`` uses ``torch.randint``. Same distribution, different bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from gracecomm.buffers import dense_empty
from gracecomm.compressor import Capabilities, Compressor, Payload, PayloadSpec, TensorInfo
from gracecomm.compressors.shared.stochastic import (
    FLOAT_BITS,
    RandomStreams,
    check_rng,
    kernels_enabled,
    natural_round_bits,
    random_bits,
    second_key,
    use_kernels,
)
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import (
    ConfigError,
    PayloadError,
    all_finite,
    check_choice,
    check_range,
    expect_payload,
    nonfinite_error,
)
from gracecomm.wire import pack_bits, pack_uint, packed_nbytes, unpack_bits, unpack_uint

F32, F64 = FLOAT_BITS[torch.float32], FLOAT_BITS[torch.float64]
WIRES = ("nat9", "nat8", "float32", "int_fixed")
NAT12_BITS = 12
# Largest biased float32 exponent whose power of two the input dtype can hold.
_CAP = {torch.float32: 254, torch.bfloat16: 254, torch.float16: 127 + 15, torch.float64: 2046}


def nat9_nbytes(n: int) -> int:
    """Payload bytes of the nat9 format for n float32 elements."""
    return n + packed_nbytes(n, 1)


@COMPRESSORS.register("natural")
class Natural(Compressor):
    """C_nat with the wire formats above; not summable (a sum of powers of two is not one),
    so it runs on allgather or broadcast, except ``wire: int_fixed`` (summable)."""

    fixed_size = True
    default_communicator = "allgather"
    child_attrs = ("streams",)
    run_keys = {"seed": "seed"}  # the run's seed (`gracecomm.configstore`)

    def __init__(self, rounding: str = "stochastic", wire: str = "nat9",
                 exp_range: Sequence[int] = (-50, 10), low_clip: str = "stochastic",
                 overflow: str = "saturate", nonfinite: str = "raise", rng: str = "counter",
                 seed: int = 0) -> None:
        super().__init__()
        self.rounding = check_choice(rounding, ("stochastic", "deterministic"), self.label,
                                     "rounding")
        self.wire = check_choice(wire, WIRES, self.label, "wire")
        self.low_clip = check_choice(low_clip, ("stochastic", "flush", "clamp"), self.label,
                                     "low_clip")
        self.overflow = check_choice(overflow, ("saturate", "raise"), self.label, "overflow")
        self.nonfinite = check_choice(nonfinite, ("raise", "zero"), self.label, "nonfinite")
        self.rng = check_rng(rng, self.label)
        self.e_min, self.e_max = self._check_exp_range(exp_range)
        self.streams = RandomStreams(check_range(seed, self.label, "seed", 0, integer=True))
        self.stochastic = self.rounding == "stochastic"

    def capabilities(self) -> Capabilities:
        """``int_fixed`` integers add exactly (summable, allreduce); deterministic rounding
        is biased, so it brings error feedback."""
        caps = super().capabilities()
        if self.wire == "int_fixed":
            caps = replace(caps, summable=True, default_communicator="allreduce")
        return caps if self.stochastic else replace(caps, default_memory="residual")

    def _check_exp_range(self, exp_range: Any) -> tuple[int, int]:
        if (isinstance(exp_range, (str, bytes)) or not isinstance(exp_range, Sequence)
                or len(exp_range) != 2):
            raise ConfigError(f"{self.label}: option 'exp_range' must be a pair [e_min, e_max], "
                              f"got {exp_range!r}")
        e_min = check_range(exp_range[0], self.label, "exp_range[0]", -126, 127, integer=True)
        e_max = check_range(exp_range[1], self.label, "exp_range[1]", -126, 127, integer=True)
        if not 0 <= e_max - e_min <= 63:
            raise ConfigError(f"{self.label}: option 'exp_range' must satisfy 0 <= e_max - e_min "
                              f"<= 63 (6-bit offsets), got [{e_min}, {e_max}]")
        return e_min, e_max

    def bind(self, comm: Any, metrics: Any) -> None:
        super().bind(comm, metrics)
        world = comm.world_size if comm is not None else 1
        if self.wire == "int_fixed" and world * 2 ** (self.e_max - self.e_min) >= 2**63:
            raise ConfigError(
                f"{self.label}: wire 'int_fixed' sums {world} ranks' integers of up to "
                f"2^{self.e_max - self.e_min}, which can overflow int64; narrow 'exp_range' "
                f"(world_size * 2^(e_max - e_min) must stay below 2^63)")

    @property
    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0

    # -- compression ----------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        info = TensorInfo.of(tensor)
        if info.dtype not in _CAP:
            raise TypeError(f"tensor '{name}' has dtype {info.dtype}; natural compression takes "
                            "float16, bfloat16, float32 or float64")
        if info.dtype == torch.float64 and self.wire != "nat9":
            raise TypeError(f"tensor '{name}' is float64: {self.label} encodes float64 only with "
                            f"wire 'nat9' (12-bit codes), not {self.wire!r}")
        flat = tensor.detach().reshape(-1)
        x = flat if flat.dtype in FLOAT_BITS else flat.float()
        key = self.streams.next_key(name, self.rank) if self.stochastic else 0
        if x.dtype == torch.float64:
            return (self._nat12(x, key, name),), info
        exps, signs = self._exponents(x, key, _CAP[info.dtype], name)
        if self.wire == "nat9":
            return (exps, signs), info
        if self.wire == "float32":
            return (sum_nat9([(exps, signs)]),), info
        zero, offset, negative = self._clip(exps, signs, key, name)
        if self.wire == "nat8":
            code = (negative.to(torch.uint8) << 7) | (zero.to(torch.uint8) << 6) | offset
            return (code,), info
        magnitude = torch.where(zero, 0, torch.ones_like(offset, dtype=torch.int64) << offset)
        return (torch.where(negative, -magnitude, magnitude),), info

    def payload_spec(self, info: TensorInfo) -> PayloadSpec:
        n = info.numel
        if info.dtype == torch.float64:
            return ((torch.uint8, packed_nbytes(n, NAT12_BITS)),)
        return {"nat9": ((torch.uint8, n), (torch.uint8, packed_nbytes(n, 1))),
                "float32": ((torch.float32, n),), "nat8": ((torch.uint8, n),),
                "int_fixed": ((torch.int64, n),)}[self.wire]

    def _finite(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Apply the ``nonfinite`` rule to a tensor that holds Inf or NaN."""
        if self.nonfinite == "raise":
            raise nonfinite_error(x, name, f"{self.label} cannot round them",
                                  "option nonfinite=zero sends them as 0")
        bad = ~torch.isfinite(x)
        self.metrics.add("nonfinite", int(bad.sum()))
        return torch.where(bad, torch.zeros_like(x), x)

    def _saturate(self, exps: torch.Tensor, cap: int, name: str) -> torch.Tensor:
        """Cap biased exponents at `cap` (the largest finite power of two of the dtype)."""
        over = exps > cap
        count = int(over.sum())
        if count == 0:
            return exps
        if self.overflow == "raise":
            raise OverflowError(f"tensor '{name}': {count} values round past the largest finite "
                                "power of two (set overflow=saturate to clip them, counted)")
        self.metrics.add("saturated", count)
        return exps.clamp(max=cap)

    def _exponents(self, x: torch.Tensor, key: int, cap: int,
                   name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """nat9 planes of float32 `x`: (biased exponents of C_nat(x) as uint8, packed signs)."""
        if self.rng == "counter" and use_kernels(x):
            from gracecomm.compressors.shared.quantizer_kernels import nat9_encode

            exps, signs, top = nat9_encode(x.numpy().view(np.uint32), key, self.stochastic)
            if top >= 0x7F800000:  # Inf or NaN: apply the rule, then round again
                x = self._finite(x, name)
                exps, signs, top = nat9_encode(x.numpy().view(np.uint32), key, self.stochastic)
            exps, signs = torch.from_numpy(exps), torch.from_numpy(signs)
            return (self._saturate(exps, cap, name) if top >= cap << 23 else exps), signs
        if not all_finite(x):
            x = self._finite(x, name)
        bits = x.view(torch.int32)
        r = (random_bits(x.numel(), 23, key, x.device, self.rng) if self.stochastic
             else 1 << 22)
        rounded = natural_round_bits(bits, r, F32)
        exps = ((rounded >> 23) & 0xFF).to(torch.uint8)
        return self._saturate(exps, cap, name), pack_bits(bits < 0)

    def _nat12(self, x: torch.Tensor, key: int, name: str) -> torch.Tensor:
        """12-bit codes sign << 11 | E of C_nat for float64 `x`, packed."""
        if not all_finite(x):
            x = self._finite(x, name)
        bits = x.view(torch.int64)
        r = (random_bits(x.numel(), 52, key, x.device, self.rng) if self.stochastic
             else 1 << 51)
        exps = self._saturate((natural_round_bits(bits, r, F64) >> 52) & 0x7FF, F64.max_biased,
                              name)
        return pack_uint(((bits < 0).to(torch.int64) << 11) | exps, NAT12_BITS, check=False)

    def _clip(self, exps: torch.Tensor, signs: torch.Tensor, key: int,
              name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fit exponents into [e_min, e_max]: (zero flags, offsets e - e_min as uint8, signs)."""
        n = exps.numel()
        e = exps.to(torch.int16) - F32.bias
        zero = exps == 0
        high = e > self.e_max
        if bool(high.any()):
            e = self._saturate(e, self.e_max, name)  # counted like float overflow
        low = ~zero & (e < self.e_min)
        n_low = int(low.sum())
        if n_low:
            self.metrics.add("low_clipped", n_low)
            gap = (self.e_min - e).clamp(min=1, max=33).to(torch.int64)  # 2^-gap = P(up)
            if self.low_clip == "clamp":
                up = low
            elif self.low_clip == "flush":
                up = torch.zeros_like(low)
            elif self.stochastic:  # tower rule: 2^e -> 2^e_min with probability 2^(e - e_min)
                draw = random_bits(n, 32, second_key(key), exps.device, self.rng).to(torch.int64)
                up = low & (gap <= 32) & ((draw >> (32 - gap.clamp(max=32))) == 0)
            else:  # nearer of 0 and 2^e_min, ties up
                up = low & (gap == 1)
            zero = zero | (low & ~up)
            e = torch.where(low, self.e_min, e)
        offset = torch.where(zero, 0, e - self.e_min).to(torch.uint8)
        return zero, offset, unpack_bits(signs, n)

    # -- decompression --------------------------------------------------------------------
    def decompress(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        n = ctx.numel
        if ctx.dtype == torch.float64:
            expect_payload(payload[0], packed_nbytes(n, NAT12_BITS), torch.uint8, "nat12 codes")
            codes = unpack_uint(payload[0], NAT12_BITS, n)
            exps = codes & 0x7FF
            if n and int(exps.max()) > F64.max_biased:
                raise PayloadError("nat12 payload holds the reserved exponent code 2047")
            sign = torch.where(codes >> 11 == 1, -(2**63), 0)
            return ((exps << 52) | sign).view(torch.float64).view(ctx.shape)
        if self.wire == "nat9":
            out = sum_nat9([nat9_planes(payload, n)])
        elif self.wire == "float32":
            expect_payload(payload[0], n, torch.float32, "natural float32 payload")
            out = payload[0]
        elif self.wire == "nat8":
            out = self._decode_nat8(payload[0], n)
        else:
            expect_payload(payload[0], n, torch.int64, "int_fixed payload")
            out = torch.ldexp(payload[0].double(), torch.tensor(float(self.e_min)))
        return out.to(ctx.dtype).view(ctx.shape)

    def aggregate(self, payloads: Sequence[Payload], ctx: TensorInfo) -> torch.Tensor:
        if self.wire == "nat9" and ctx.dtype == torch.float32:
            total = sum_nat9([nat9_planes(p, ctx.numel) for p in payloads])
            return total.div_(len(payloads)).view(ctx.shape)
        return super().aggregate(payloads, ctx)

    def _decode_nat8(self, code: torch.Tensor, n: int) -> torch.Tensor:
        expect_payload(code, n, torch.uint8, "nat8 payload")
        offset = (code & 63).to(torch.int32)
        zero = (code & 64) != 0
        if n and (bool((zero & (offset != 0)).any())
                  or int(offset.max()) > self.e_max - self.e_min):
            raise PayloadError(f"nat8 payload holds reserved codes (zero flag with an offset, or "
                               f"an offset above {self.e_max - self.e_min})")
        exps = torch.where(zero, 0, offset + (self.e_min + F32.bias))
        return ((exps << 23) | sign_bits(code >> 7)).view(torch.float32)



def nat9_planes(payload: Payload, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponent and sign planes of a nat9 payload of n values, checked."""
    expect_payload(payload[0], n, torch.uint8, "nat9 exponent plane")
    expect_payload(payload[1], packed_nbytes(n, 1), torch.uint8, "nat9 sign plane")
    return payload[0], payload[1]


def sum_nat9(planes: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The sum, in rank order, of the float32 values (sign << 31) | (exponent << 23) of
    nat9 planes (exponents, signs): one pair decodes one payload; the kernels decode every
    pair into one sum a block at a time. The reserved exponent code 255 raises
    `PayloadError`."""
    n = planes[0][0].numel()
    if kernels_enabled(planes[0][0].device):
        from gracecomm.compressors.shared.quantizer_kernels import nat9_sum

        total = dense_empty(n, torch.float32, "cpu")
        top = nat9_sum(tuple(e.contiguous().numpy() for e, _ in planes),
                       tuple(s.contiguous().numpy() for _, s in planes), total.numpy())
    else:
        total, top = None, 0
        for exps, signs in planes:
            values = ((exps.to(torch.int32) << 23) | sign_bits(unpack_bits(signs, n))).view(
                torch.float32)
            total = values if total is None else total.add_(values)
            top = max(top, int(exps.max()) if n else 0)
    if top == 255:
        raise PayloadError("nat9 payload holds the reserved exponent code 255")
    return total


def sign_bits(negative: torch.Tensor) -> torch.Tensor:
    """int32 with only the sign bit set where `negative` (0/1 or bool) is set."""
    return negative.to(torch.int32).mul_(-(2**31))
