"""No compression: the dense tensor is the payload (the baseline every method is compared to)."""

from __future__ import annotations

from typing import Any

import torch

from gracecomm.compressor import Compressor, Payload, TensorInfo
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import expect_payload


@COMPRESSORS.register("none")
class NoneCompressor(Compressor):
    """Identity; summable, so it runs on allreduce like plain DDP."""

    summable = True
    fixed_size = True
    elementwise = True
    default_communicator = "allreduce"

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        return (tensor.reshape(-1),), TensorInfo.of(tensor)

    def transmitted(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        return torch.ones(ctx.numel, dtype=torch.bool, device=payload[0].device)

    def decompress(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        expect_payload(payload[0], ctx.numel, ctx.dtype, "dense payload")
        return payload[0].view(ctx.shape)
