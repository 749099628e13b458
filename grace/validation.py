"""Checks shared by every component: options are validated when a component is built,
tensors when they enter the pipeline. Every error names the option or tensor, the bad value
and what is allowed."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ConfigError(ValueError):
    """A component was configured with a value it cannot work with. Raised when the
    component is built, before any worker starts; the message names the part, the option,
    the bad value and what is allowed.

    Example:
        >>> import gracecomm
        >>> gracecomm.build({"name": "topk", "ratio": 2})
        Traceback (most recent call last):
        ...
        gracecomm.validation.ConfigError: compressor 'topk': option 'ratio' must be in (0, 1] ...
    """


class IncompatibleError(ConfigError):
    """A compressor was paired with a memory or communicator that cannot carry it; the
    message says what to pick instead.

    Example:
        >>> import gracecomm
        >>> gracecomm.build("topk", communicator="allreduce")
        Traceback (most recent call last):
        ...
        gracecomm.validation.IncompatibleError: communicator 'allreduce' sums payloads ...
    """


class PayloadError(ValueError):
    """A payload (usually from a peer) is malformed: wrong length, dtype or indices. It is
    raised before anything is scattered or allocated from it.

    Example:
        >>> import torch, gracecomm
        >>> top = gracecomm.create("compressor", "topk", ratio=0.5)
        >>> (values, indices), ctx = top.compress(torch.tensor([1.0, -3.0]), "w")
        >>> top.decompress((values, indices + 6), ctx)
        Traceback (most recent call last):
        ...
        gracecomm.validation.PayloadError: sparse indices span [7, 7] but the tensor has 2 ...
    """


class NonFiniteError(FloatingPointError):
    """A tensor holds NaN or Inf where the component cannot handle it; the message names
    the tensor and how to let a loss scaler's overflow steps through.

    Example:
        >>> import torch, gracecomm
        >>> gracecomm.build("topk").step(torch.tensor([1.0, float("nan")]), "w")
        Traceback (most recent call last):
        ...
        gracecomm.validation.NonFiniteError: tensor 'w' holds 1 NaN and 0 Inf values out of 2; ...
    """


class MissingDependencyError(ImportError):
    """An optional package (torchvision, cupy, numba, ...) needed by the chosen option is not
    installed; the message says what to install."""


def error_line(err: BaseException) -> str:
    """The one line a command ends with on a refusal: the error's qualified type and its
    message (``gracecomm.validation.ConfigError: ...``)."""
    return f"{type(err).__module__}.{type(err).__name__}: {err}"


@functools.cache
def numba_available() -> bool:
    """Whether numba imports: the one probe behind every CPU kernel. numba is a regular
    dependency; on a platform without it the torch code paths run instead."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def require_numba(owner: str, instead: str) -> None:
    """Raise `MissingDependencyError` when numba is missing: `owner` names the option that asked
    for it, `instead` the choice that works without it."""
    if not numba_available():
        raise MissingDependencyError(f"{owner} needs numba; install it with "
                                f"`pip install 'numba>=0.59'` or use {instead}")


def check_ratio(ratio: Any, owner: str, option: str = "ratio") -> float:
    """`ratio` is the fraction of elements kept; it must lie in (0, 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ConfigError(f"{owner}: option '{option}' must be a number in (0, 1] "
                          f"(the fraction of elements kept), got {ratio!r}")
    if not (0.0 < float(ratio) <= 1.0) or math.isnan(ratio):
        raise ConfigError(f"{owner}: option '{option}' must be in (0, 1] "
                          f"(the fraction of elements kept), got {ratio}")
    return float(ratio)


def check_choice(value: Any, allowed: Iterable[Any], owner: str, option: str) -> Any:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{owner}: option '{option}' must be one of "
                          f"{', '.join(map(repr, allowed))}; got {value!r}")
    return value


def check_range(value: Any, owner: str, option: str, low: float | None = None,
                high: float | None = None, *, integer: bool = False,
                low_open: bool = False, high_open: bool = False) -> Any:
    """Check low <= value <= high (or strict where `*_open`), optionally an integer."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not float(value).is_integer()) or (
            isinstance(value, float) and math.isnan(value)):
        raise ConfigError(f"{owner}: option '{option}' must be {kind}, got {value!r}")
    bad_low = low is not None and (value <= low if low_open else value < low)
    bad_high = high is not None and (value >= high if high_open else value > high)
    if bad_low or bad_high:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        opening = "(" if low_open or low is None else "["
        closing = ")" if high_open or high is None else "]"
        interval = f"{opening}{lo}, {hi}{closing}"
        raise ConfigError(f"{owner}: option '{option}' must be {kind} in {interval}, got {value}")
    return int(value) if integer else value


def check_tensor(tensor: Any, name: str) -> None:
    """A gradient entering the pipeline must be a floating-point tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor '{name}': expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"tensor '{name}' has dtype {tensor.dtype}; gradients must be one of "
                        f"{', '.join(str(d) for d in FLOAT_DTYPES)}")


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds no NaN or Inf (`nonfinite_among`)."""
    return not nonfinite_among([tensor])


SUMMED_TOGETHER = 1 << 16  # tensors below this many elements are summed in one call


def nonfinite_among(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The positions of the `tensors` that hold NaN or Inf. Their sums decide in the usual
    case, since a NaN or Inf makes a sum non-finite (one read each, where
    ``isfinite().all()`` costs about 40 on the CPU, and one host synchronisation for all);
    small tensors of one dtype are summed together in one call (a payload's fields: one
    call instead of one per field), large ones alone. Only a sum that is not finite, which
    finite values can reach by overflowing, has its tensors' elements checked."""
    if not tensors:
        return []
    batches: list[list[int]] = []
    small: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() >= SUMMED_TOGETHER:
            batches.append([i])
            continue
        group = small.setdefault(t.dtype, [])
        group.append(i)
        if len(group) == 64:  # at most 4M elements copied for one call
            batches.append(small.pop(t.dtype))
    batches += small.values()
    sums = torch.stack([
        tensors[b[0]].sum(dtype=torch.float32) if len(b) == 1 else
        torch.cat([tensors[i] if tensors[i].dim() == 1 else tensors[i].reshape(-1)
                   for i in b]).sum(dtype=torch.float32)
        for b in batches])
    finite = torch.isfinite(sums)
    if bool(finite.all()):
        return []
    suspects = sorted(i for b, ok in zip(batches, finite.tolist()) if not ok for i in b)
    return [i for i in suspects if not bool(torch.isfinite(tensors[i]).all())]


def is_finite(tensor: torch.Tensor, name: str, *, raise_error: bool = False) -> bool:
    """Whether `tensor` holds no NaN or Inf (`all_finite`); with `raise_error`, raise
    `NonFiniteError` naming it instead of returning False (the pipeline's ``check_finite``)."""
    if all_finite(tensor):
        return True
    if not raise_error:
        return False
    raise nonfinite_error(tensor, name, "compressing it would corrupt the aggregate",
                          "if a torch.amp.GradScaler scales the loss, its overflows are "
                          "deliberate: pass it to the exchange, scaler=scaler, which is enough "
                          "(such a step then reaches every rank as NaN, the scaler skips it "
                          "and the compression state is restored); without a GradScaler, "
                          "check_finite=False passes such steps through the same way and the "
                          "optimizer receives NaN")


def nonfinite_error(tensor: torch.Tensor, name: str, why: str, remedy: str) -> NonFiniteError:
    """The one message for a tensor whose values a component cannot handle: which tensor,
    how many NaN and Inf it holds, `why` it cannot go on and the `remedy` (an option that
    handles it). A tensor with neither (finite values whose sums or squares overflow, such
    as 1e38 in float32) is said to be finite, with its largest magnitude: it is never blamed
    on NaN or Inf."""
    n_nan, n_inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    if n_nan or n_inf:
        return NonFiniteError(f"tensor '{name}' holds {n_nan} NaN and {n_inf} Inf values out "
                              f"of {tensor.numel()}; {why} ({remedy})")
    largest = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
    limit = (f" (largest finite {torch.finfo(tensor.dtype).max:.3e})"
             if tensor.is_floating_point() else "")
    return NonFiniteError(f"tensor '{name}' holds no NaN or Inf, but values up to "
                          f"{largest:.3e} in magnitude, whose sums or squares overflow "
                          f"{tensor.dtype}{limit}; {why} ({remedy}, or scale the gradients "
                          "down)")


def expect_payload(tensor: torch.Tensor, numel: int, dtype: torch.dtype, what: str) -> None:
    """Raise `PayloadError` unless a received payload tensor has `numel` elements of `dtype`."""
    if tensor.dtype != dtype:
        raise PayloadError(f"{what} has dtype {tensor.dtype}, expected {dtype}")
    if tensor.numel() != numel:
        raise PayloadError(f"{what} holds {tensor.numel()} elements, expected {numel}")


def wire_float32(values: torch.Tensor, name: str, what: str) -> torch.Tensor:
    """`values` (norms, scales) as the float32 scalars a payload carries; raise, naming the
    tensor, if a finite value lies beyond float32's range (it would arrive as Inf)."""
    limit = torch.finfo(torch.float32).max
    if values.numel() and bool((values.abs() > limit).any()):
        worst = float(values.abs().max())
        kind = "non-finite" if not math.isfinite(worst) else f"{worst:.3e}"
        raise NonFiniteError(f"tensor '{name}': its {what} ({kind}) does not fit the float32 "
                             f"the payload carries (largest finite {limit:.3e}); the tensor "
                             "cannot be encoded by this compressor")
    return values.to(torch.float32)


def num_kept(numel: int, ratio: float) -> int:
    """k = max(1, floor(ratio * d)) for a non-empty tensor, 0 for an empty one."""
    if numel == 0:
        return 0
    return min(numel, max(1, int(math.floor(ratio * numel))))
