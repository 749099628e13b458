"""Sparse (values, indices) payloads, shared by every sparsifier.

A sparse payload is ``(values, indices)``: values in the tensor's dtype, flat indices as
int32 when the tensor has fewer than 2**31 elements (int64 otherwise). Indices that arrive
from a peer are range-checked before any scatter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from gracecomm.buffers import dense_empty_like, dense_zeros
from gracecomm.compressor import Compressor, Payload, TensorInfo
from gracecomm.validation import PayloadError, check_ratio, num_kept

DEFAULT_RATIO = 0.01
"""The density every sparsifier keeps by default, and every method built on one (Top-k,
Random-k, DGC, SIDCo, RedSync, GaussianKSGD, LGC; DeepReduce and Compose through theirs), so
that methods named without a ratio compare at one density. Their config group entries are
generated from the classes (`gracecomm.configstore`), so this is the one place it is
written."""


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index dtype that addresses `numel` elements."""
    return torch.int32 if numel < 2**31 else torch.int64


def sparsify(flat: torch.Tensor, indices: torch.Tensor) -> Payload:
    """Payload (values, indices) of the 1-D tensor `flat` at `indices`. (`index_select`:
    advanced indexing ``flat[indices]`` costs time proportional to the tensor on CPU, ~6 ms
    for 26M elements, 80x more than this gather of k values.)"""
    return flat.index_select(0, indices), indices.to(index_dtype(flat.numel()))


def index_mask(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Flat bool mask with True at `indices`."""
    mask = torch.zeros(numel, dtype=torch.bool, device=indices.device)
    mask[indices.long()] = True
    return mask


def check_sparse(values: torch.Tensor, indices: torch.Tensor, info: TensorInfo) -> None:
    """Raise `PayloadError` unless (values, indices) can be scattered into `info`'s tensor."""
    if indices.dtype not in (torch.int32, torch.int64):
        raise PayloadError(f"sparse indices must be int32 or int64, got {indices.dtype}")
    if values.dim() != 1 or indices.dim() != 1 or values.numel() != indices.numel():
        raise PayloadError(f"sparse payload has {values.numel()} values and "
                           f"{indices.numel()} indices; they must be 1-D and equal in number")
    if values.dtype != info.dtype:
        raise PayloadError(f"sparse values have dtype {values.dtype}, expected {info.dtype}")
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= info.numel:
            raise PayloadError(f"sparse indices span [{lo}, {hi}] but the tensor has "
                               f"{info.numel} elements")


def desparsify(values: torch.Tensor, indices: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """Dense tensor with `values` at `indices` and zeros elsewhere."""
    check_sparse(values, indices, info)
    out = dense_zeros(info.numel, info.dtype, values.device)
    out.scatter_(0, indices.long(), values)  # 3-4x faster than index_put_ on CPU
    return out.view(info.shape)


def subtract_sparse(t: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                    in_place: bool) -> torch.Tensor:
    """``t - desparsify(values, indices)``, bit for bit (the indices are distinct, and a - b
    is a + (-b)), as one index_add of the k values: into `t` itself (`in_place`) or into a
    copy of it on a recycled buffer, instead of an n-element scatter and subtraction."""
    check_sparse(values, indices, TensorInfo.of(t))
    out = t if in_place else dense_empty_like(t).copy_(t)
    out.view(-1).index_add_(0, indices, values, alpha=-1)
    return out


def sparse_mean(payloads: Sequence[Payload], info: TensorInfo) -> torch.Tensor:
    """Mean over ranks of sparse payloads, with one scatter-add of all ranks' pairs."""
    for values, indices in payloads:
        check_sparse(values, indices, info)
    values = torch.cat([p[0] for p in payloads])
    indices = torch.cat([p[1].long() for p in payloads])
    out = dense_zeros(info.numel, info.dtype, values.device)
    out.scatter_add_(0, indices, values)  # in index order: the same sums on every rank
    return out.div_(len(payloads)).view(info.shape)


class SparseSelection(ABC):
    """The sparse-selection protocol that every sparsifier implements (Random-k included):
    the payload's first tensor holds the kept values (a new tensor, never a view of the
    input), `kept_indices` their distinct flat positions, and `decompress` scatters the one
    at the other into zeros (so error feedback subtracts them where they were taken). It
    comes before `Compressor` among a class's bases, so that its `subtract_decompressed`
    is the one used. A wrapper that re-encodes a selection (DeepReduce's index and value codecs)
    relies on this alone, and Compose's later stages on the first part of it (floating-point
    values first), so a new sparsifier needs no change to either.

    A sparsifier's ``ratio`` follows the experiment's ``experiment.ratio`` where an
    experiment sets one (``run_keys``, `gracecomm.configstore`), so that every method of an
    experiment keeps one density."""

    run_keys: ClassVar[dict[str, str]] = {"ratio": "experiment.ratio"}

    @abstractmethod
    def kept_indices(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Flat positions (int32/int64) of the values in ``payload[0]``."""

    def subtract_decompressed(self, t: torch.Tensor, payload: Payload, ctx: Any,
                              in_place: bool = False) -> torch.Tensor:
        """`Compressor.subtract_decompressed` as one index_add of the k kept values."""
        return subtract_sparse(t, payload[0], self.kept_indices(payload, ctx), in_place)


class Sparsifier(SparseSelection, Compressor):
    """Base of the compressors that send ``(values, indices)``: Top-k, threshold, DGC,
    SIDCo and the threshold baselines. Subclasses implement `select`; this class builds the
    payload, decompresses with one scatter, aggregates all ranks with one scatter-add and
    records the achieved ``k_hat`` (and target ``k`` where the method has one) per tensor,
    from which the metrics derive the estimation quality k_hat / k."""

    default_memory = "residual"
    has_target: ClassVar[bool] = True  # False for methods without a target count (threshold)

    def __init__(self, ratio: float | None) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio, self.label) if self.has_target else None

    def target_k(self, numel: int) -> int | None:
        """k = max(1, floor(ratio * d)), or None for methods without a target count."""
        return None if self.ratio is None else num_kept(numel, self.ratio)

    @abstractmethod
    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Flat indices (int32/int64) of the elements of the 1-D, non-empty `flat` to send."""

    def sparse_payload(self, flat: torch.Tensor, name: str) -> Payload:
        """(values, indices) of the 1-D, non-empty `flat`: `select`, then a gather (methods
        whose selection already read the values return them instead)."""
        return sparsify(flat, self.select(flat, name))

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        if flat.numel():
            payload = self.sparse_payload(flat, name)
        else:
            payload = sparsify(flat, torch.empty(0, dtype=torch.int64, device=flat.device))
        k = self.target_k(flat.numel())
        if k is not None:
            self.metrics.add("k", k)
        self.metrics.add("k_hat", payload[1].numel())
        return payload, TensorInfo.of(tensor)

    def decompress(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        return desparsify(payload[0], payload[1], ctx)

    def aggregate(self, payloads: Sequence[Payload], ctx: TensorInfo) -> torch.Tensor:
        return sparse_mean(payloads, ctx)

    def kept_indices(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        return payload[1]

    def transmitted(self, payload: Payload, ctx: TensorInfo) -> torch.Tensor:
        return index_mask(payload[1], ctx.numel)
