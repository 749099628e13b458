"""Half-precision casts: fp16 and bf16 (2 bytes per element).

Values beyond the target format's largest finite number are saturated, so a finite gradient
never becomes Inf; the number of saturated elements is reported as ``saturated`` (on the
CPU; on CUDA the saturation runs without a host sync and the count is not reported).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from gracecomm.buffers import dense_empty
from gracecomm.compressor import Compressor, Payload, PayloadSpec, TensorInfo
from gracecomm.compressors.shared.exceedance import may_hold_infinite
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import expect_payload


def saturating_cast(flat: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """`flat` (1-D) cast to the float `dtype`, finite values beyond its range clamped to its
    largest finite number (so a finite value never becomes Inf); returns the number clamped.

    The cast runs first; only an Inf in the result can mean a clamp, so on the CPU one read
    of the (narrower) result decides whether anything is rewritten, and nothing is in the
    usual case. On CUDA the clamp is applied without looking (no host sync) and the count
    reported is 0."""
    if flat.dtype == dtype:
        return flat, 0
    out = dense_empty(flat.numel(), dtype, flat.device).copy_(flat)
    if not flat.numel() or torch.finfo(flat.dtype).max <= torch.finfo(dtype).max:
        return out, 0
    on_cpu = flat.device.type == "cpu"
    if on_cpu and not may_hold_infinite(out):
        return out, 0
    # clamp in float32 or wider: the limit itself may not be representable in the input
    # dtype (65504 rounds to 65536 in bfloat16)
    wide = flat.float() if flat.dtype.itemsize < 4 else flat
    over = torch.isinf(out) & torch.isfinite(wide)
    limit = torch.finfo(dtype).max
    out = torch.where(over, wide.sign() * limit, wide).to(dtype)
    return out, int(over.sum()) if on_cpu else 0


class Cast(Compressor):
    """Cast to a narrower float dtype and back; summable."""

    summable = True
    fixed_size = True
    elementwise = True
    default_communicator = "allreduce"
    wire_dtype: ClassVar[torch.dtype]

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        flat, saturated = saturating_cast(tensor.reshape(-1), self.wire_dtype)
        if saturated:
            self.metrics.add("saturated", saturated)
        return (flat,), TensorInfo.of(tensor)

    def payload_spec(self, info: TensorInfo) -> PayloadSpec:
        return ((self.wire_dtype, info.numel),)

    def transmitted(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        return torch.ones(ctx.numel, dtype=torch.bool, device=payload[0].device)

    def decompress(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        expect_payload(payload[0], ctx.numel, self.wire_dtype, f"{self.registry_name} payload")
        out = dense_empty(ctx.numel, ctx.dtype, payload[0].device)
        return out.copy_(payload[0].reshape(-1)).view(ctx.shape)


@COMPRESSORS.register("fp16")
class FP16(Cast):
    """IEEE half precision (5-bit exponent; saturates at +-65504)."""

    wire_dtype = torch.float16


@COMPRESSORS.register("bf16")
class BF16(Cast):
    """bfloat16 (float32's exponent range, 8-bit mantissa)."""

    wire_dtype = torch.bfloat16
