"""Random-k sparsification (Stich et al. 2018; Wangni et al. 2018) with a seed shared by all
ranks: every rank keeps the same k random indices, so only values are sent and payloads can
be summed by allreduce."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from grace.compressor import Compressor, Payload, TensorInfo
from grace.registry import COMPRESSORS
from grace.rng import SharedStreams
from grace.sparse import DEFAULT_RATIO, desparsify, index_mask
from grace.validation import check_choice, check_ratio, num_kept

_RANDPERM_LIMIT = 2**24


@dataclass(frozen=True)
class RandomKCtx:
    info: TensorInfo
    indices: torch.Tensor  # identical on every rank: drawn from the shared seed


@COMPRESSORS.register("randomk")
class RandomK(Compressor):
    """Keep k = max(1, floor(ratio * d)) indices drawn without replacement from a generator
    seeded with H(seed, name, call count). For d > 2**24 indices are drawn with `randint` and
    deduplicated, so slightly fewer than k may be kept (the same number on every rank).

    `scale`: ``none`` sends the values as they are; ``unbiased`` multiplies them by d / k so
    that the compressor is unbiased (E[C(x)] = x)."""

    summable = True
    fixed_size = True
    default_communicator = "allreduce"
    default_memory = "residual"
    training_defaults = MappingProxyType({"momentum": 0.0})
    sensitivities = (("trainer.momentum: with error feedback each coordinate is sent with "
                      "about 1/ratio steps of residual at once, and heavy-ball momentum on "
                      "those bursts diverges"),
                     ("compressor.ratio: each coordinate is updated about once per 1/ratio "
                      "steps, so short runs give every weight few updates (docs/sparsifiers.md)"))

    def __init__(self, ratio: float = DEFAULT_RATIO, seed: int = 0, scale: str = "none") -> None:
        super().__init__()
        self.ratio = check_ratio(ratio, self.label)
        self.scale = check_choice(scale, ("none", "unbiased"), self.label, "scale")
        self.streams = SharedStreams(seed)

    def indices(self, numel: int, name: str) -> torch.Tensor:
        """The next shared index set for tensor `name` (advances its counter)."""
        k = num_kept(numel, self.ratio)
        gen = self.streams.generator(name)
        if numel <= _RANDPERM_LIMIT:
            return torch.randperm(numel, generator=gen)[:k]
        return torch.randint(0, numel, (k,), generator=gen).unique()

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        idx = self.indices(flat.numel(), name).to(flat.device)
        values = flat[idx]
        if self.scale == "unbiased" and idx.numel():
            values = values * (flat.numel() / idx.numel())
        return (values,), RandomKCtx(TensorInfo.of(tensor), idx)

    def transmitted(self, payload: Payload, ctx: RandomKCtx) -> torch.Tensor:
        return index_mask(ctx.indices, ctx.info.numel)

    def decompress(self, payload: Payload, ctx: RandomKCtx) -> torch.Tensor:
        return desparsify(payload[0], ctx.indices, ctx.info)

    def state_dict(self) -> dict[str, Any]:
        return {"streams": self.streams.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streams.load_state_dict(state["streams"])
