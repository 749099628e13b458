"""Sign methods: one bit per element (the sign plane, packed LSB-first, bit set for x < 0)
plus the method's scale(s).

- ``signsgd`` (Bernstein et al. 2018, Alg. 1 / majority vote Alg. 3): sign(g), no scale;
  the aggregate is the majority vote sign(sum_r sign(g_r)) (0 on a tie).
- ``signum`` (Bernstein et al. 2018, Alg. 3): sign of the momentum m = beta m + (1 - beta) g,
  kept per tensor; majority vote.
- ``efsignsgd`` (Karimireddy et al. 2019, Alg. 1, EF-SIGNSGD): (||p||_1 / d) sign(p) of the
  error-compensated p = lr g + e (memory ``efsignsgd``); the mean over ranks is divided by
  the memory's `lr`, so the optimiser's step lr * (that) is the paper's update. One float32
  scale.
- ``onebit`` (Seide et al. 2014, 1-bit SGD): the mean of the negative and of the non-negative
  elements as the two reconstruction values, with error feedback (residual memory). Two
  float32 scales.

Payload bytes for n elements: ceil(n/8) + 4 * (number of scales).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from gracecomm.buffers import dense_empty, dense_empty_like
from gracecomm.compressor import Compressor, Payload, TensorInfo
from gracecomm.compressors.shared.stochastic import kernels_enabled, use_kernels
from gracecomm.needs import Need
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import PayloadError, check_range, expect_payload, wire_float32
from gracecomm.wire import pack_bits, packed_nbytes, unpack_bits


class SignCompressor(Compressor):
    """Sign plane + `num_scales` float32 scales; subclasses choose the scales and the values
    the two signs decode to."""

    fixed_size = True
    default_communicator = "allgather"
    num_scales = 0

    def signal(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor whose signs are sent (Signum's momentum)."""
        return x

    def scales(self, x: torch.Tensor, stats: SignStats) -> torch.Tensor:
        """The `num_scales` scales of the 1-D `x` (sent as float32)."""
        return x.new_empty(0)

    def values(self, scales: torch.Tensor) -> torch.Tensor:
        """The values a negative and a non-negative element decode to, as a 2-element tensor
        on the payload's device."""
        return torch.tensor([-1.0, 1.0], device=scales.device)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        x = self.signal(tensor.detach().reshape(-1), name)
        signs, stats = sign_plane(x, stats=self.num_scales > 0)
        if stats is None:
            return (signs,), TensorInfo.of(tensor)
        scales = wire_float32(self.scales(x, stats), name, "scale")
        return (signs, scales), TensorInfo.of(tensor)

    def check(self, payload: Payload, ctx: TensorInfo) -> None:
        """Raise `PayloadError` unless `payload` has this method's layout for `ctx`."""
        if len(payload) != (2 if self.num_scales else 1):
            raise PayloadError(f"{self.label} payload has {len(payload)} tensors")
        expect_payload(payload[0], packed_nbytes(ctx.numel, 1), torch.uint8, "sign plane")
        if self.num_scales:
            expect_payload(payload[1], self.num_scales, torch.float32, "sign scales")

    def decompress(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        return self._sum([payload], ctx)

    def aggregate(self, payloads: Sequence[Payload], ctx: TensorInfo) -> torch.Tensor:
        if ctx.dtype == torch.float32:
            return self._sum(payloads, ctx).div_(len(payloads))
        return super().aggregate(payloads, ctx)

    def subtract_decompressed(self, t: torch.Tensor, payload: Payload, ctx: TensorInfo,
                              in_place: bool = False) -> torch.Tensor:
        """With the kernels (float32): t plus the negated decoded values, in one pass over
        t (into t itself with `in_place`: the payload holds no view of it): a - b is
        a + (-b), so the same bits as t - decompress."""
        if ctx.dtype != torch.float32 or not kernels_enabled(t.device):
            return super().subtract_decompressed(t, payload, ctx, in_place)
        from gracecomm.compressors.shared.quantizer_kernels import signs_sum

        lows, highs = self._levels([payload], ctx)
        out = t if in_place else dense_empty_like(t).copy_(t)
        signs_sum((payload[0].numpy(),), (-lows).numpy(), (-highs).numpy(),
                  out.view(-1).numpy(), accumulate=True)
        return out

    def _levels(self, payloads: Sequence[Payload], ctx: TensorInfo
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each payload checked, and the values its set and clear sign bits decode to."""
        for payload in payloads:
            self.check(payload, ctx)
        empty = payloads[0][0].new_empty(0, dtype=torch.float32)
        lows, highs = torch.stack([self.values(p[1] if self.num_scales else empty)
                                   for p in payloads]).T
        return lows.contiguous(), highs.contiguous()

    def _sum(self, payloads: Sequence[Payload], ctx: TensorInfo) -> torch.Tensor:
        """The sum of the payloads' decompressions in rank order (with the kernels, decoded
        into one sum a block at a time)."""
        lows, highs = self._levels(payloads, ctx)
        if ctx.dtype == torch.float32 and kernels_enabled(payloads[0][0].device):
            from gracecomm.compressors.shared.quantizer_kernels import signs_sum

            out = dense_empty(ctx.numel, torch.float32, "cpu")
            signs_sum(tuple(p[0].numpy() for p in payloads), lows.numpy(), highs.numpy(),
                      out.numpy())
            return out.view(ctx.shape)
        total = None
        for payload, low, high in zip(payloads, lows, highs):  # 0-dim: no read by the host
            out = torch.where(unpack_bits(payload[0], ctx.numel), low, high).to(ctx.dtype)
            total = out if total is None else total.add_(out)
        return total.view(ctx.shape)


@dataclass(frozen=True)
class SignStats:
    """What the scales need: the number of negative-signed elements, the (float64) sum of
    the negative elements and the sum of |x|."""

    negatives: int
    negative_sum: float
    abs_sum: float


def sign_plane(x: torch.Tensor, stats: bool = False) -> tuple[torch.Tensor, SignStats | None]:
    """(packed sign bits of the 1-D `x`, set where the sign bit is, -0.0 included; and with
    `stats` its `SignStats`)."""
    if use_kernels(x):
        from gracecomm.compressors.shared.quantizer_kernels import pack_signs

        signs, count, negative_sum, abs_sum = pack_signs(x.numpy(), stats)
        return torch.from_numpy(signs), SignStats(count, negative_sum, abs_sum) if stats else None
    negative = torch.signbit(x)
    if not stats:
        return pack_bits(negative), None
    wide = x.double()
    count, negative_sum, abs_sum = torch.stack(  # one read by the host
        [negative.sum().double(), wide.clamp(max=0).sum(), wide.abs().sum()]).tolist()
    return pack_bits(negative), SignStats(int(count), negative_sum, abs_sum)


class MajorityVote(SignCompressor):
    """Unscaled signs aggregated by majority vote (the update is sign(sum of signs)), so
    the optimizer moves every coordinate by +-lr: a far smaller step than SGD's."""

    sensitivities = (("trainer.lr: every coordinate moves by +-lr whatever the gradient's "
                      "size, so SGD's step sizes end at chance (docs/quantizers.md)"),)

    def aggregate(self, payloads: Sequence[Payload], ctx: TensorInfo) -> torch.Tensor:
        if ctx.dtype == torch.float32 and len(payloads) <= 2**24:
            return self._sum(payloads, ctx).sign_()  # the +-1 votes' sum is exact in float32
        votes = torch.zeros(ctx.numel, device=payloads[0][0].device,
                            dtype=torch.int16 if len(payloads) < 2**15 else torch.int32)
        for payload in payloads:
            self.check(payload, ctx)
            votes += unpack_bits(payload[0], ctx.numel)
        # len(payloads) - 2 * negatives = sum of the +-1 votes
        return torch.sign(len(payloads) - 2 * votes).to(ctx.dtype).view(ctx.shape)


# One bit per element with error feedback (EF-signSGD, 1-bit SGD) takes a smaller effective
# step lr / (1 - momentum) than SGD on some models (docs/quantizers.md).
EF_SIGN_DEFAULTS = MappingProxyType({"lr": 0.02})
EF_SIGN_SENSITIVITIES = (("trainer.lr and trainer.momentum: error feedback on one bit per "
                          "element oscillates at SGD's effective step lr / (1 - momentum) on "
                          "some models (docs/quantizers.md)"),)


@COMPRESSORS.register("signsgd")
class SignSGD(MajorityVote):
    """signSGD with majority vote; trains with a small learning rate (the update is +-lr)."""

    training_defaults = MappingProxyType({"lr": 0.0005})


@COMPRESSORS.register("signum")
class Signum(MajorityVote):
    """Signum: majority vote on the signs of the local momentum (kept per tensor). The
    momentum lives here, so the optimizer runs without it (`Need.OWNS_MOMENTUM`)."""

    training_defaults = MappingProxyType({"lr": 0.001})
    state_attrs = ("momentums",)

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = float(check_range(momentum, self.label, "momentum", 0.0, 1.0,
                                          high_open=True))
        self.momentums: dict[str, torch.Tensor] = {}

    def needs(self) -> frozenset[Need]:
        return super().needs() | {Need.OWNS_MOMENTUM}

    def signal(self, x: torch.Tensor, name: str) -> torch.Tensor:
        m = self.momentums.get(name)
        # beta m + (1 - beta) g as a new tensor, so that a state snapshot stays valid (on a
        # recycled buffer when large: `gracecomm.buffers.dense_empty`)
        out = dense_empty_like(x)
        m = (out.copy_(x) if m is None or m.shape != x.shape
             else torch.lerp(m, x, 1.0 - self.momentum, out=out))
        self.momentums[name] = m
        return m



@COMPRESSORS.register("efsignsgd")
class EFSignSGD(SignCompressor):
    """Scaled sign (||p||_1 / d) sign(p). The aggregate is divided by `lr`, which the
    ``efsignsgd`` memory sets to its own learning rate when the pipeline is built (1 with any
    other memory: plain error feedback in gradient units)."""

    default_memory = "efsignsgd"
    num_scales = 1
    training_defaults = EF_SIGN_DEFAULTS
    sensitivities = EF_SIGN_SENSITIVITIES

    def __init__(self) -> None:
        super().__init__()
        self.lr = 1.0

    def scales(self, x: torch.Tensor, stats: SignStats) -> torch.Tensor:
        return torch.tensor([stats.abs_sum / max(1, x.numel())], device=x.device)

    def values(self, scales: torch.Tensor) -> torch.Tensor:
        return torch.cat([-scales, scales])

    def aggregate(self, payloads: Sequence[Payload], ctx: TensorInfo) -> torch.Tensor:
        return super().aggregate(payloads, ctx).div_(self.lr)


@COMPRESSORS.register("onebit")
class OneBit(SignCompressor):
    """1-bit SGD: each sign decodes to the mean of the elements that share it."""

    default_memory = "residual"
    num_scales = 2
    training_defaults = EF_SIGN_DEFAULTS
    sensitivities = EF_SIGN_SENSITIVITIES

    def scales(self, x: torch.Tensor, stats: SignStats) -> torch.Tensor:
        positive_sum = stats.abs_sum + stats.negative_sum
        return torch.tensor([stats.negative_sum / max(1, stats.negatives),
                             positive_sum / max(1, x.numel() - stats.negatives)], device=x.device)

    def values(self, scales: torch.Tensor) -> torch.Tensor:
        return scales
