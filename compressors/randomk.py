"""Random-k sparsification (Stich et al. 2018; Wangni et al. 2018) with a seed shared by all
ranks: every rank keeps the same k random indices, so only values are sent and payloads can
be summed by allreduce."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from gracecomm.compressor import Compressor, Payload, TensorInfo
from gracecomm.compressors.shared.stochastic import counter_hash, kernels_enabled, second_key
from gracecomm.registry import COMPRESSORS
from gracecomm.rng import SharedStreams
from gracecomm.sparse import DEFAULT_RATIO, SparseSelection, desparsify, index_mask
from gracecomm.validation import check_choice, check_ratio, num_kept

SUBSET_LIMIT = 2**31  # tensors up to this size: the draws' arithmetic is exact in int64


@dataclass(frozen=True)
class RandomKCtx:
    info: TensorInfo
    indices: torch.Tensor  # identical on every rank: drawn from the shared seed


def draws(n: int, d: int, key: int, key2: int, device: torch.device) -> torch.Tensor:
    """The draws j(0), ..., j(n - 1) in [0, d): j(i) = floor(u d / 2^64) for the 64-bit
    u = (mix(i, key) << 32) | mix(i, key2) of the counter generator
    (`gracecomm.compressors.shared.stochastic`), a uniform index to within d / 2^64."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    return (counter_hash(i, key) * d + ((counter_hash(i, key2) * d) >> 32)) >> 32


def first_distinct(d: int, m: int, key: int, key2: int, device: torch.device) -> torch.Tensor:
    """The first m distinct values of the draws, in draw order (rejection of repeats). The
    host reads one number per round of draws (whether m distinct values came up; almost
    always in the first round): the rest has sizes known in advance."""
    if m == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    n = m + m // 2 + 64
    while True:
        j = draws(n, d, key, key2, device)
        ordered, order = torch.sort(j, stable=True)
        new = torch.ones(n, dtype=torch.bool, device=device)
        new[1:] = ordered[1:] != ordered[:-1]
        first = torch.empty_like(new).scatter_(0, order, new)  # the earliest draw of a value
        count = torch.cumsum(first, 0)
        if int(count[-1]) >= m:
            return j.index_select(0, torch.nonzero_static(first & (count <= m), size=m)
                                  .view(-1))
        n *= 2


def random_subset(d: int, k: int, key: int, device: torch.device) -> torch.Tensor:
    """Ascending int64 positions of a uniformly random k-subset of range(d) for the shared
    `key`: the first k distinct draws, or for k > d/2 all but the first d - k (so at most
    d/2 values are ever drawn). One numba call on CPU
    (`gracecomm.compressors.shared.quantizer_kernels.random_subset`, a bitmap), the same positions
    from torch on other devices."""
    if d >= SUBSET_LIMIT:
        raise ValueError(f"randomk draws indices of tensors below 2**31 elements, got {d}")
    key2 = second_key(key)
    if kernels_enabled(device):
        from gracecomm.compressors.shared.quantizer_kernels import random_subset as subset_kernel

        return torch.from_numpy(subset_kernel(d, k, key, key2))
    if 2 * k <= d:
        return torch.sort(first_distinct(d, k, key, key2, device)).values
    keep = torch.ones(d, dtype=torch.bool, device=device)
    keep[first_distinct(d, d - k, key, key2, device)] = False
    return torch.nonzero_static(keep, size=k).view(-1)


@COMPRESSORS.register("randomk")
class RandomK(SparseSelection, Compressor):
    """Keep k = max(1, floor(ratio * d)) indices drawn uniformly without replacement from the
    counter generator keyed with H(seed, name, call count) (`random_subset`); indices
    ascend, and every rank draws the same ones.

    `scale`: ``none`` sends the values as they are; ``unbiased`` multiplies them by d / k so
    that the compressor is unbiased (E[C(x)] = x)."""

    summable = True
    fixed_size = True
    default_communicator = "allreduce"
    default_memory = "residual"
    child_attrs = ("streams",)
    run_keys = {"seed": "seed"}  # every rank draws with the run's seed (`gracecomm.configstore`)
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

    def indices(self, numel: int, name: str, device: torch.device | str = "cpu"
                ) -> torch.Tensor:
        """The next shared index set for tensor `name` (advances its counter)."""
        key = self.streams.next_seed(name)
        return random_subset(numel, num_kept(numel, self.ratio), key, torch.device(device))

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        idx = self.indices(flat.numel(), name, flat.device)
        values = flat.index_select(0, idx)
        if self.scale == "unbiased" and idx.numel():
            values = values * (flat.numel() / idx.numel())
        return (values,), RandomKCtx(TensorInfo.of(tensor), idx)

    def kept_indices(self, payload: Payload, ctx: RandomKCtx) -> torch.Tensor:
        return ctx.indices  # shared by every rank, so not sent

    def transmitted(self, payload: Payload, ctx: RandomKCtx) -> torch.Tensor:
        return index_mask(ctx.indices, ctx.info.numel)

    def decompress(self, payload: Payload, ctx: RandomKCtx) -> torch.Tensor:
        return desparsify(payload[0], ctx.indices, ctx.info)

