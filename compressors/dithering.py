"""Random dithering: standard dithering, natural dithering (Horvath et al., *Natural
Compression for Distributed Deep Learning*, 2019, Sec. 4), QSGD (Alistarh et al. 2017) and
TernGrad (Wen et al. 2017), which are standard dithering with particular options.

General dithering D^{p,s}: per bucket of values x, y_i = |x_i| / ||x||_p lies in [0, 1] and is
rounded at random to one of the two neighbouring levels l_{u+1} <= y_i <= l_u, to l_u with
probability (y_i - l_{u+1}) / (l_u - l_{u+1}); the output is ||x||_p sign(x_i) xi_i. Unbiased.

- standard levels {0, 1/s, ..., 1};
- natural levels {0, 2^(1-s), ..., 1/2, 1}: above 2^(1-s) this is natural compression of y
  (`gracecomm.compressors.shared.stochastic.natural_round_bits`), below it rounds between 0
  and 2^(1-s). Theorem 5: s natural levels match the variance of 2^(s-1) standard ones.

``norm_compression: natural`` sends C_nat(||x||_p) instead of the norm (an independent draw,
still unbiased; Theorem 3 multiplies the variance bound by 9/8).

Wire format for n values and s levels: the norms as float32 (one per bucket of ``bucket``
values, default one for the whole tensor), the sign plane (ceil(n/8) bytes, sign cleared
where the level is 0) and the level codes in b = ceil(log2(s + 1)) bits (ceil(n b / 8)
bytes): 1 + b = ceil(log2(2s + 1)) bits per element plus 32 bits per bucket. Codes above s
are rejected as reserved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from gracecomm.buffers import dense_empty
from gracecomm.compressor import Compressor, Payload, PayloadSpec, TensorInfo
from gracecomm.compressors.shared.stochastic import (
    FLOAT_BITS,
    RandomStreams,
    check_rng,
    natural_round,
    natural_round_bits,
    random_bits,
    second_key,
    uniform,
    use_kernels,
)
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import (
    ConfigError,
    PayloadError,
    check_choice,
    check_range,
    expect_payload,
    wire_float32,
)
from gracecomm.wire import bits_for, pack_bits, pack_uint, packed_nbytes, unpack_bits, unpack_uint

F32 = FLOAT_BITS[torch.float32]
NORMS = {1: 1.0, 2: 2.0, "inf": math.inf}


def check_p(p: Any, owner: str) -> float:
    """The option ``p`` (1, 2 or inf; YAML ``.inf`` or the string ``inf``)."""
    key = "inf" if (isinstance(p, str) and p.lower() == "inf") or p == math.inf else p
    if isinstance(key, bool) or key not in NORMS:
        raise ConfigError(f"{owner}: option 'p' must be 1, 2 or inf, got {p!r}")
    return NORMS[key]


def bucket_norms(x: torch.Tensor, bucket: int, p: float) -> torch.Tensor:
    """p-norm of every bucket of `bucket` consecutive elements of the 1-D `x` (the last
    bucket may be short)."""
    def norm(values: torch.Tensor) -> torch.Tensor:  # of each row
        if p != math.inf:
            return torch.linalg.vector_norm(values, p, dim=1)
        # max |v| from the extremes: on the project's CPU, for a 26M-element tensor, the
        # inf-norm and aminmax along a dimension cost about 20 reads of it (an abs
        # temporary, a slow kernel), amin and amax along it 2.5, a whole-tensor aminmax 1.3
        if len(values) == 1:
            low, high = (t.view(1) for t in torch.aminmax(values))
        else:
            low, high = values.amin(dim=1), values.amax(dim=1)
        return torch.maximum(low.abs(), high.abs())

    def compute(values: torch.Tensor) -> torch.Tensor:
        full = values.numel() // bucket * bucket
        parts = [norm(values[:full].view(-1, bucket))] if full else []
        if full < values.numel():
            parts.append(norm(values[full:].view(1, -1)))
        return torch.cat(parts)

    norms = compute(x)
    if x.dtype != torch.float64 and not bool(torch.isfinite(norms).all()):
        norms = compute(x.double())  # the squares overflowed, not necessarily the norm
    return norms


def scale_buckets_(x: torch.Tensor, scale: torch.Tensor, bucket: int) -> torch.Tensor:
    """Multiply every bucket of the 1-D `x` in place by its entry of `scale`."""
    full = x.numel() // bucket * bucket
    if full:
        x[:full].view(-1, bucket).mul_(scale[: full // bucket].unsqueeze(1))
    if full < x.numel():
        x[full:].mul_(scale[-1])
    return x


class Dithering(Compressor):
    """Base of the dithering family; subclasses fix the levels (standard or natural)."""

    fixed_size = True
    default_communicator = "allgather"
    child_attrs = ("streams",)
    run_keys = {"seed": "seed"}  # the run's seed (`gracecomm.configstore`)
    natural_levels: ClassVar[bool] = False
    max_levels: ClassVar[int] = 2**16 - 1

    def __init__(self, levels: int, p: Any = 2, bucket: int | None = None,
                 norm_compression: str = "none", rng: str = "counter", seed: int = 0) -> None:
        super().__init__()
        self.levels = check_range(levels, self.label, "levels", 1, self.max_levels, integer=True)
        self.p = check_p(p, self.label)
        self.bucket = (None if bucket is None else
                       check_range(bucket, self.label, "bucket", 1, integer=True))
        self.norm_compression = check_choice(norm_compression, ("none", "natural"), self.label,
                                             "norm_compression")
        self.rng = check_rng(rng, self.label)
        self.streams = RandomStreams(check_range(seed, self.label, "seed", 0, integer=True))
        self.code_bits = bits_for(self.levels + 1)

    def buckets(self, n: int) -> tuple[int, int]:
        """(bucket size, number of buckets) for a tensor of n > 0 elements."""
        size = min(self.bucket or n, n)
        return size, -(-n // size)

    def norms(self, x: torch.Tensor, size: int) -> torch.Tensor:
        """The per-bucket norms the levels are relative to (values above a norm land on the
        top level: TernGrad lowers the norm to clip)."""
        return bucket_norms(x, size, self.p)

    def quantize(self, scaled: torch.Tensor, key: int) -> torch.Tensor:
        """Level codes in [0, s] of `scaled` = y * (units per level), y in [0, 1]."""
        lower = scaled.floor()
        up = uniform(scaled.numel(), key, scaled.device, self.rng) < scaled.sub_(lower)
        return lower.to(self.code_dtype).add_(up)

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.uint8 if self.code_bits <= 8 else torch.int32

    @property
    def units(self) -> float:
        """y-units per code step at the top of the range (s for standard levels)."""
        return float(self.levels)

    def code_values(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 value of every code c in units of `code_scales`: c (the level is c / s)."""
        return codes.to(torch.float32)

    def code_scales(self, norms: torch.Tensor) -> torch.Tensor:
        """What a code value is multiplied by, per bucket: ||x||_p / s, so that code c
        decodes to sign * ||x||_p * c / s."""
        return norms / self.levels

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        info = TensorInfo.of(tensor)
        x = tensor.detach().reshape(-1)
        x = x if x.dtype in FLOAT_BITS else x.float()
        n = x.numel()
        rank = self.comm.rank if self.comm is not None else 0
        key = self.streams.next_key(name, rank)
        if n == 0:
            empty = torch.empty(0, dtype=torch.uint8, device=x.device)
            return (torch.empty(0, device=x.device), empty, empty), info
        size, _ = self.buckets(n)
        norms = self.norms(x, size)
        sent = wire_float32(norms, name, f"l{self.p:g}-norm")
        if self.norm_compression == "natural":
            sent = natural_round(sent, second_key(key), self.rng)  # an independent draw
        else:
            norms = sent.to(x.dtype)  # y relative to the norm the receiver multiplies with
        inverse = torch.where(norms > 0, self.units / norms, torch.zeros_like(norms))
        if self.rng == "counter" and self.code_bits <= 8 and use_kernels(x):
            from gracecomm.compressors.shared.quantizer_kernels import dither_encode

            signs, codes = dither_encode(x.numpy(), inverse.numpy(), size, self.units,
                                         self.natural_levels, key, self.code_bits)
            return (sent, torch.from_numpy(signs), torch.from_numpy(codes)), info
        scaled = scale_buckets_(x.abs(), inverse, size).clamp_(max=self.units)
        codes = self.quantize(scaled if scaled.dtype == torch.float32 else scaled.float(), key)
        signs = pack_bits((x < 0) & (codes > 0))
        return (sent, signs, pack_uint(codes, self.code_bits, check=False)), info

    def payload_spec(self, info: TensorInfo) -> PayloadSpec:
        """float32 norms, one per bucket; the packed sign plane; the packed level codes."""
        n = info.numel
        return ((torch.float32, self.buckets(n)[1] if n else 0),
                (torch.uint8, packed_nbytes(n, 1)),
                (torch.uint8, packed_nbytes(n, self.code_bits)))

    def decompress(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        return self._decode([payload], ctx)

    def aggregate(self, payloads: Sequence[Payload], ctx: TensorInfo) -> torch.Tensor:
        if ctx.dtype == torch.float32 and self._fused(payloads[0]):
            return self._decode(payloads, ctx).div_(len(payloads))
        return super().aggregate(payloads, ctx)

    def _fused(self, payload: Payload) -> bool:
        """Whether the kernels decode this payload (codes of up to 8 bits, on CPU)."""
        return self.code_bits <= 8 and use_kernels(payload[0])

    def _decode(self, payloads: Sequence[Payload], ctx: TensorInfo) -> torch.Tensor:
        """The sum of the payloads' decompressions in rank order, decoded into one sum a
        block at a time by the kernels; outside them, one payload's decompression."""
        n = ctx.numel
        for payload in payloads:
            if len(payload) != 3:
                raise PayloadError(f"{self.label} payload has {len(payload)} tensors, "
                                   "expected 3")
            norms, signs, packed = payload
            expect_payload(norms, self.buckets(n)[1] if n else 0, torch.float32,
                           "dithering norms")
            expect_payload(signs, packed_nbytes(n, 1), torch.uint8, "dithering sign plane")
            expect_payload(packed, packed_nbytes(n, self.code_bits), torch.uint8,
                           "dithering level plane")
        if n == 0:
            return torch.empty(ctx.shape, dtype=ctx.dtype, device=payloads[0][0].device)
        size, _ = self.buckets(n)
        if self._fused(payloads[0]):
            from gracecomm.compressors.shared.quantizer_kernels import dither_sum

            values = dense_empty(n, torch.float32, "cpu")
            self._check_codes(dither_sum(
                tuple(p[1].numpy() for p in payloads), tuple(p[2].numpy() for p in payloads),
                tuple(self.code_scales(p[0]).numpy() for p in payloads), self.levels,
                self.natural_levels, size, values.numpy(), self.code_bits))
            return values.to(ctx.dtype).view(ctx.shape)
        (norms, signs, packed), = payloads
        codes = unpack_uint(packed, self.code_bits, n, dtype=self.code_dtype)
        self._check_codes(int(codes.max()))
        out = self.code_values(codes)
        out = scale_buckets_(torch.where(unpack_bits(signs, n), -out, out),
                             self.code_scales(norms), size)
        return out.to(ctx.dtype).view(ctx.shape)

    def _check_codes(self, top: int) -> None:
        if top > self.levels:
            raise PayloadError(f"dithering level plane holds codes above {self.levels} "
                               "(reserved)")



@COMPRESSORS.register("standard_dithering")
class StandardDithering(Dithering):
    """D^{p,s}_sta: uniform levels {0, 1/s, ..., 1}. The default s = 128 = 2^(8-1) matches
    the variance of natural dithering with 8 levels (Theorem 5)."""

    def __init__(self, levels: int = 128, p: Any = 2, bucket: int | None = None,
                 norm_compression: str = "none", rng: str = "counter", seed: int = 0) -> None:
        super().__init__(levels, p, bucket, norm_compression, rng, seed)


@COMPRESSORS.register("natural_dithering")
class NaturalDithering(Dithering):
    """D^{p,s}_nat: levels {0, 2^(1-s), ..., 1/2, 1}; code c >= 1 means 2^(c-s)."""

    natural_levels = True
    max_levels = 126  # 2^(1-s) must stay a normal float32

    def __init__(self, levels: int = 8, p: Any = 2, bucket: int | None = None,
                 norm_compression: str = "none", rng: str = "counter", seed: int = 0) -> None:
        super().__init__(levels, p, bucket, norm_compression, rng, seed)

    @property
    def units(self) -> float:
        return float(2 ** (self.levels - 1))  # z = y 2^(s-1): levels 0, 1, 2, 4, ..., 2^(s-1)

    def quantize(self, scaled: torch.Tensor, key: int) -> torch.Tensor:
        # z >= 1: natural rounding of z, code = exponent + 1; z < 1: 1 with probability z.
        r = random_bits(scaled.numel(), F32.mantissa, key, scaled.device, self.rng)
        rounded = natural_round_bits(scaled.view(torch.int32), r, F32) >> F32.mantissa
        bottom = r.to(torch.float32).mul_(2.0**-F32.mantissa) < scaled
        return torch.where(scaled >= 1, rounded - (F32.bias - 1), bottom.to(torch.int32)).to(
            self.code_dtype)

    def code_values(self, codes: torch.Tensor) -> torch.Tensor:
        """The level itself: 2^(c - s), 0 for c = 0."""
        exponent = codes.to(torch.int32) + (F32.bias - self.levels)  # biased exponent of 2^(c-s)
        return torch.where(codes > 0, exponent << F32.mantissa, 0).view(torch.float32)

    def code_scales(self, norms: torch.Tensor) -> torch.Tensor:
        return norms


@COMPRESSORS.register("qsgd")
class QSGD(StandardDithering):
    """QSGD (Alistarh et al. 2017, Sec. 3.1): standard dithering with the l2 norm in buckets
    of `bucket` values. Defaults s = 127 levels (1 + 7 = 8 bits per element) and buckets of
    512, plus 32 bits per bucket."""

    def __init__(self, levels: int = 127, bucket: int | None = 512, rng: str = "counter",
                 seed: int = 0) -> None:
        super().__init__(levels, 2, bucket, "none", rng, seed)


@COMPRESSORS.register("terngrad")
class TernGrad(StandardDithering):
    """TernGrad (Wen et al. 2017): levels {-1, 0, 1} times s_t = max |g| (standard dithering
    with p = inf and s = 1): 2 bits per element plus one float32 scale. `clip` (Sec. 3.3)
    first clamps g to +-clip * std(g) (biased; null disables it)."""

    def __init__(self, clip: float | None = 2.5, bucket: int | None = None, rng: str = "counter",
                 seed: int = 0) -> None:
        super().__init__(1, "inf", bucket, "none", rng, seed)
        self.clip = (None if clip is None else
                     float(check_range(clip, self.label, "clip", 0.0, low_open=True)))

    def norms(self, x: torch.Tensor, size: int) -> torch.Tensor:
        # clamp(g, -c, c) has max-norm min(max |g|, c), and |g_i| >= c lands on the top
        # level: lowering the norm to c clips without materialising the clamped tensor
        norms = super().norms(x, size)
        if self.clip is None or x.numel() < 2:
            return norms
        bound = self.clip * float(x.std(correction=0))
        return norms.clamp(max=bound) if bound > 0 else norms
