"""No memory: compress the gradient as it is (right for unbiased compressors)."""

from __future__ import annotations

from typing import Any

import torch

from gracecomm.compressor import Compressor, Payload
from gracecomm.memory import Memory
from gracecomm.registry import MEMORIES


@MEMORIES.register("none")
class NoneMemory(Memory):
    identity = True

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def update(self, tensor: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        pass
