"""Curve-fitting value codecs of DeepReduce (paper Sec. 5, Lemmas 1, 9, 10).

Values are sorted into a canonical order (positives by decreasing value, zeros, negatives by
decreasing magnitude), which makes each sign part a smooth decreasing curve of magnitudes;
the codec sends a few coefficients per part instead of the values, and the caller sends the
permutation (or writes indices in this order). Zeros are sent as a count only.

- ``polyfit`` (Fit-Poly): piecewise least-squares polynomials of degree `degree` (default 5,
  6 coefficients), pieces found by the paper's chord-distance segmentation.
- ``dexp`` (Fit-DExp): y = a e^{bx} + c e^{dx} per part, 4 coefficients, no segmentation.

Section: counts of positives, zeros and negatives (u32 each), then per sign part its
encoding (see each codec). A part with at most degree + 1 values is sent raw.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import ClassVar

import torch

from gracecomm.compressors.deepreduce.codec import (
    VALUE_CODECS,
    CodecCtx,
    ValueCodec,
    f32_bytes,
    f32_values,
    pack_fields,
    u32_bytes,
    u32_values,
    unpack_fields,
)
from gracecomm.validation import PayloadError, check_range


def canonical_order(values: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(order, #positives, #zeros, #negatives): values[order] lists positives by decreasing
    value, then zeros (and NaN), then negatives by decreasing magnitude; ties keep their
    original order."""
    pos = (values > 0).nonzero().view(-1)
    neg = (values < 0).nonzero().view(-1)
    zero = (~((values > 0) | (values < 0))).nonzero().view(-1)
    pos = pos[torch.sort(-values[pos], stable=True).indices]
    neg = neg[torch.sort(values[neg], stable=True).indices]
    return torch.cat([pos, zero, neg]), pos.numel(), zero.numel(), neg.numel()


def vandermonde(length: int, degree: int, device: torch.device) -> torch.Tensor:
    """Powers 0..degree of x mapped to [-1, 1] over `length` points (float64)."""
    x = torch.linspace(-1.0, 1.0, length, dtype=torch.float64, device=device)
    return x.unsqueeze(1) ** torch.arange(degree + 1, dtype=torch.float64, device=device)


def auto_segments(y: torch.Tensor, limit: int) -> int:
    """p = ceil(2 sqrt(M)) with M = (n - 1) |(y1 - y2) - (y_{n-1} - y_n)| on y / max|y|
    (the end-slope difference with x rescaled to [0, 1]; Lemma 1 then bounds the
    piecewise-linear error by 2M/p^2 <= 1/2), clamped to [1, limit]."""
    y = y / y.abs().max()
    m = (y.numel() - 1) * abs(float((y[0] - y[1]) - (y[-2] - y[-1])))
    return max(1, min(limit, math.ceil(2 * math.sqrt(m))))


def segment(y: torch.Tensor, pieces: int, min_points: int) -> list[int]:
    """Start offsets of up to `pieces` pieces of the curve y (paper Sec. 5): repeatedly find,
    in every piece, the point farthest (squared vertical distance) from the chord joining
    the piece's end points, and split the piece where that distance is largest; the point
    starts the right piece. A split must leave both halves `min_points` points."""
    bounds = [0, y.numel()]
    while len(bounds) - 1 < pieces:
        best: tuple[float, int] | None = None
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b - a < 2 * min_points:
                continue
            t = torch.linspace(0.0, 1.0, b - a, dtype=y.dtype, device=y.device)
            dist = (y[a:b] - (y[a] + (y[b - 1] - y[a]) * t)) ** 2
            s = a + int(torch.argmax(dist))
            if s - a >= min_points and b - s >= min_points:
                gap = float(dist[s - a])
                if best is None or gap > best[0]:
                    best = (gap, s)
        if best is None:
            break
        bounds = sorted(bounds + [best[1]])
    return bounds[:-1]


def least_squares(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x minimising ||a x - b|| for a full-rank `a`, by Householder QR (LAPACK's gels; never
    normal equations). Not torch's CPU default, gelsy: torch hands gelsy an uninitialised
    pivot array, which gelsy reads as preset pivots, so repeated calls on the same input
    differ in the last bits (and a fit that branches on them, in more)."""
    return torch.linalg.lstsq(a, b.unsqueeze(1), driver="gels").solution.view(-1)


def poly_fit(y: torch.Tensor, degree: int) -> torch.Tensor:
    """Least-squares coefficients of one piece."""
    return least_squares(vandermonde(y.numel(), degree, y.device), y.to(torch.float64))


def poly_eval(coef: torch.Tensor, length: int) -> torch.Tensor:
    return vandermonde(length, coef.numel() - 1, coef.device) @ coef.to(torch.float64)


class SortedValueCodec(ValueCodec):
    """Sorts, splits into sign parts and codes each part's magnitudes (descending)."""

    sorts = True
    COUNTS: ClassVar[str] = "III"

    def __init__(self, degree: int) -> None:
        self.degree = check_range(degree, self.label, "degree", 0, 16, integer=True)

    def encode(self, values: torch.Tensor, ctx: CodecCtx) -> tuple[torch.Tensor, torch.Tensor]:
        order, n_pos, n_zero, n_neg = canonical_order(values)
        ordered = values[order].to(torch.float64)
        parts = [pack_fields(self.COUNTS, n_pos, n_zero, n_neg, device=values.device)]
        for y in (ordered[:n_pos], -ordered[n_pos + n_zero:]):
            parts.append(self.encode_part(y) if y.numel() > self.degree + 1 else
                         self.raw_part(y))
        return torch.cat(parts), order

    def decode(self, section: torch.Tensor, n: int, ctx: CodecCtx) -> torch.Tensor:
        (n_pos, n_zero, n_neg), rest = unpack_fields(self.COUNTS, section, self.label)
        if n_pos + n_zero + n_neg != n:
            raise PayloadError(f"{self.label}: {n_pos} positives, {n_zero} zeros and {n_neg} "
                               f"negatives do not add up to {n} values")
        pos, rest = self.decode_part(rest, n_pos)
        neg, rest = self.decode_part(rest, n_neg)
        if rest.numel():
            raise PayloadError(f"{self.label}: {rest.numel()} bytes left after both parts")
        zeros = torch.zeros(n_zero, dtype=torch.float32, device=section.device)
        return torch.cat([pos, zeros, -neg])

    def raw_part(self, y: torch.Tensor) -> torch.Tensor:
        """Tag 0 and the magnitudes as float32."""
        return torch.cat([pack_fields("B", 0, device=y.device), f32_bytes(y)])

    def decode_part(self, data: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(magnitudes >= 0 as float32, rest of data) of one part."""
        if length <= self.degree + 1:
            (tag,), data = unpack_fields("B", data, self.label)
            if tag != 0:
                raise PayloadError(f"{self.label}: a part of {length} values must be raw")
            return f32_values(data[:4 * length], length, self.label), data[4 * length:]
        y, data = self.decode_fitted(data, length)
        return y.clamp_min(0).to(torch.float32), data

    @abstractmethod
    def encode_part(self, y: torch.Tensor) -> torch.Tensor:
        """Bytes of one part of more than degree + 1 magnitudes (float64, descending)."""

    @abstractmethod
    def decode_fitted(self, data: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(fitted magnitudes, rest of data) of a part written by `encode_part`."""


@VALUE_CODECS.register("polyfit")
class PolyFitValues(SortedValueCodec):
    """Fit-Poly (paper Sec. 5): per sign part, `segment` into p pieces (``segments: auto``
    uses `auto_segments`, at most `max_segments` per part; an integer fixes p) and fit a
    polynomial of degree `degree` on each piece with x mapped to [-1, 1]. Part layout:
    p (u8), p - 1 piece starts (u32), (degree + 1) p float32 coefficients."""

    codec_id = 5

    def __init__(self, degree: int = 5, segments: int | str = "auto",
                 max_segments: int = 4) -> None:
        super().__init__(degree)
        if segments != "auto":
            check_range(segments, self.label, "segments", 1, 255, integer=True)
        self.segments = segments
        self.max_segments = check_range(max_segments, self.label, "max_segments", 1, 255,
                                        integer=True)

    def encode_part(self, y: torch.Tensor) -> torch.Tensor:
        pieces = (auto_segments(y, self.max_segments) if self.segments == "auto"
                  else int(self.segments))
        starts = segment(y / y.abs().max(), pieces, self.degree + 1)
        ends = starts[1:] + [y.numel()]
        coefs = torch.cat([poly_fit(y[a:b], self.degree) for a, b in zip(starts, ends)])
        return torch.cat([pack_fields("B", len(starts), device=y.device),
                          u32_bytes(torch.tensor(starts[1:], dtype=torch.int64, device=y.device)),
                          f32_bytes(coefs)])

    def decode_fitted(self, data: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        (pieces,), data = unpack_fields("B", data, self.label)
        if not 1 <= pieces <= length:
            raise PayloadError(f"{self.label}: {pieces} pieces for a fitted part of {length} "
                               "values")
        nb, nc = 4 * (pieces - 1), 4 * (pieces * (self.degree + 1))
        if data.numel() < nb + nc:
            raise PayloadError(f"{self.label}: a part of {pieces} pieces needs {nb + nc} "
                               f"bytes, {data.numel()} left")
        inner = u32_values(data[:nb]).tolist()
        starts = [0] + inner
        if any(b <= a for a, b in zip(starts, inner + [length])):
            raise PayloadError(f"{self.label}: piece starts {inner} are not increasing "
                               f"inside a part of {length} values")
        coefs = f32_values(data[nb:nb + nc], nc // 4, self.label).view(pieces, -1)
        y = torch.cat([poly_eval(c, b - a) for c, a, b in zip(coefs, starts, inner + [length])])
        return y, data[nb + nc:]


def dexp_eval(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a, b, c, d = theta.to(torch.float64).unbind()
    return a * torch.exp(b * x) + c * torch.exp(d * x)


def log_linear(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(A, B) of the least-squares line log y = log A + B x (y > 0)."""
    v = torch.stack([torch.ones_like(x), x], dim=1)
    sol = least_squares(v, torch.log(y))
    return math.exp(float(sol[0])), float(sol[1])


def dexp_fit(y: torch.Tensor, steps: int) -> torch.Tensor:
    """(a, b, c, d) of y ~ a e^{bx} + c e^{dx} on x in [0, 1], y normalised to max 1:
    (c, d) from a log-linear fit of the second half, (a, b) from one on the positive
    residual of the first eighth, then `steps` Levenberg-Marquardt steps (damped
    Gauss-Newton solved as an augmented least-squares problem)."""
    n = y.numel()
    x = torch.linspace(0.0, 1.0, n, dtype=torch.float64, device=y.device)
    c, d = log_linear(x[n // 2:], y[n // 2:])
    head = slice(0, max(2, n // 8))
    resid = y[head] - c * torch.exp(d * x[head])
    ok = resid > 0
    a, b = log_linear(x[head][ok], resid[ok]) if int(ok.sum()) >= 2 else (0.0, 0.0)
    theta = torch.tensor([a, b, c, d], dtype=torch.float64, device=y.device)
    cost = float(((y - dexp_eval(theta, x)) ** 2).sum())
    damping = 1e-3
    for _ in range(steps):
        ta, tb, tc, td = theta.unbind()
        eb, ed = torch.exp(tb * x), torch.exp(td * x)
        jac = torch.stack([eb, ta * x * eb, ed, tc * x * ed], dim=1)
        resid = y - (ta * eb + tc * ed)
        scale = torch.sqrt((jac**2).sum(0)).clamp_min(1e-12)
        system = torch.cat([jac, math.sqrt(damping) * torch.diag(scale)])
        rhs = torch.cat([resid, torch.zeros(4, dtype=torch.float64, device=y.device)])
        step = least_squares(system, rhs)
        trial = theta + step
        trial_cost = float(((y - dexp_eval(trial, x)) ** 2).sum())
        if math.isfinite(trial_cost) and trial_cost < cost:
            theta, cost, damping = trial, trial_cost, max(damping / 3, 1e-12)
        else:
            damping = min(damping * 2, 1e12)
    return theta


@VALUE_CODECS.register("dexp")
class DExpValues(SortedValueCodec):
    """Fit-DExp (paper Sec. 5): per sign part y = a e^{bx} + c e^{dx} on x in [0, 1] (see
    `dexp_fit`), 4 float32 coefficients. A fit that is not finite or whose relative error
    exceeds `max_error` falls back to one polynomial of degree `degree`. Part layout:
    tag (u8: 1 = double exponential, 2 = polynomial) and the coefficients."""

    codec_id = 6

    def __init__(self, steps: int = 30, max_error: float = 0.25, degree: int = 5) -> None:
        super().__init__(degree)
        self.steps = check_range(steps, self.label, "steps", 0, integer=True)
        self.max_error = float(check_range(max_error, self.label, "max_error", 0.0,
                                           low_open=True))

    def encode_part(self, y: torch.Tensor) -> torch.Tensor:
        top = float(y.max())
        theta = dexp_fit(y / top, self.steps)
        theta = theta * torch.tensor([top, 1.0, top, 1.0], dtype=theta.dtype, device=y.device)
        fitted = dexp_eval(theta.float(), torch.linspace(0.0, 1.0, y.numel(), dtype=torch.float64,
                                                         device=y.device))
        err = float(torch.linalg.vector_norm(fitted - y) / torch.linalg.vector_norm(y))
        if math.isfinite(err) and err <= self.max_error:
            return torch.cat([pack_fields("B", 1, device=y.device), f32_bytes(theta)])
        return torch.cat([pack_fields("B", 2, device=y.device),
                          f32_bytes(poly_fit(y, self.degree))])

    def decode_fitted(self, data: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        (tag,), data = unpack_fields("B", data, self.label)
        if tag == 1:
            theta = f32_values(data[:16], 4, self.label)
            x = torch.linspace(0.0, 1.0, length, dtype=torch.float64, device=data.device)
            return dexp_eval(theta, x), data[16:]
        if tag == 2:
            size = 4 * (self.degree + 1)
            coef = f32_values(data[:size], self.degree + 1, self.label)
            return poly_eval(coef, length), data[size:]
        raise PayloadError(f"{self.label}: unknown part tag {tag} (1 = double exponential, "
                           "2 = polynomial)")
