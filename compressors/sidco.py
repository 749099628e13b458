"""SIDCo: sparsification by fitting a sparsity-inducing distribution to |g| (Abdelmoniem et
al., "An Efficient Statistical-based Gradient Compression Technique for Distributed Training
Systems", MLSys 2021, Secs. 2-3), with this library's choices where the paper leaves gaps
(stage adaptation on heavy tails, guards for degenerate input).

The threshold for density rho is the (1 - rho) quantile of the fitted model of |g|:

- exponential (Laplace g), Eq. (7): beta = mean(y) (the MLE), t = beta ln(1/rho);
- gamma, Eqs. (13)-(15): Minka's shape estimate, closed form -ln rho - ln Gamma(alpha) where
  it is valid (alpha <= 1 and x >= 1), else the exact quantile;
- generalized Pareto (GP), Eqs. (32)-(35): moment estimates, t = (beta/alpha) expm1(-alpha ln rho).

Multi-stage peaks-over-threshold (Sec. 2.4, Eqs. (7) and (10)): stage 1 fits all nonzero
magnitudes at density delta_1 = 0.25; each later stage refits only the exceedances of the
previous threshold, shifted by it: eta_m = eta_{m-1} + t(E - eta_{m-1}, rho_m). The number of
stages M adapts every Q steps (Algorithm 1; by default with this library's bidirectional rule,
`StageAdapter`, because the paper's direction is wrong for heavy tails); with ``stages: auto``
the first call chooses M from the data: the M whose threshold, fitted and counted on a sample
of the tensor, keeps closest to k (Algorithm 1 alone starts from one stage and needs several
windows of Q steps on heavy tails). This library's guards G1-G7 (marked in the code) handle
zeros, tiny tensors and degenerate fits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from scipy import special

from gracecomm.compressors.shared.estimation import (
    Selection,
    ThresholdSparsifier,
    empty_selection,
    exact_topk,
)
from gracecomm.compressors.shared.exceedance import (
    Moments,
    Pool,
    above,
    below,
    count_above,
    moments,
    rounded,
    select,
    top_k_of,
)
from gracecomm.registry import COMPRESSORS
from gracecomm.rng import stable_hash
from gracecomm.sparse import DEFAULT_RATIO
from gracecomm.validation import ConfigError, check_choice, check_range

VARIANTS = {  # variant: (stage-1 model, model of the later stages)
    "sidco_e": ("exponential", "exponential"),
    "sidco_gamma_gp": ("gamma", "gp"),
    "sidco_gp": ("gp", "gp"),
}
ADAPT_DEFAULTS = {"rule": "bidirectional", "interval": 5, "tolerance": 0.2, "scope": "tensor",
                  "escape": False}
EXACT_BELOW = 64  # G6: exceedance sets smaller than this are resolved exactly
SAMPLE_KEPT = 256  # stages: auto fits on a sample in which about this many are kept
SAMPLE_MIN = 1 << 16  # ... and of at least this many elements (all of smaller tensors)
COMPACT_FROM = 1 << 20  # the later stages of a tensor this large run on its exceedances ...
POOL_SHARE = 16  # ... pooled once at most 1/16 of its elements per pass the pool saves ...
POOL_PASSES = 4  # ... exceed the current threshold (passes counted up to 4: at most 1/4)


# -- the models: quantile formulas and estimators -------------------------------------------
def exponential_quantile(beta: float, rho: float) -> float:
    """(1 - rho) quantile of Exp(beta): beta ln(1/rho) (Eq. 7)."""
    return beta * math.log(1.0 / rho)


def gp_quantile(alpha: float, beta: float, rho: float) -> float:
    """(1 - rho) quantile of GP(alpha, beta), CDF 1 - (1 + alpha y / beta)^(-1/alpha):
    (beta/alpha) expm1(-alpha ln rho); the exponential limit for |alpha| < 1e-4."""
    if abs(alpha) < 1e-4:
        return exponential_quantile(beta, rho)
    return beta / alpha * math.expm1(-alpha * math.log(rho))


def gamma_quantile(alpha: float, beta: float, rho: float, method: str = "closed_form") -> float:
    """(1 - rho) quantile of Gamma(alpha, scale beta). ``closed_form`` uses the paper's bound
    x = -ln rho - ln Gamma(alpha) (Eq. 15) where it holds (alpha <= 1 and x >= 1), the exact
    inverse of the regularized incomplete gamma function elsewhere; ``exact`` always does."""
    if method == "closed_form" and alpha <= 1.0:
        x = -math.log(rho) - math.lgamma(alpha)
        if x >= 1.0:
            return beta * x
    return beta * float(special.gammainccinv(alpha, rho))


def fit_gp(count: int, s1: float, s2: float) -> tuple[float, float] | None:
    """Moment estimates (alpha, beta) of a GP from the sums of y and y^2 (Eqs. 32, 35: mean
    beta/(1-alpha), variance beta^2/((1-alpha)^2 (1-2 alpha))); None if the variance is 0."""
    mean = s1 / count
    var = s2 / count - mean * mean
    if not var > 0.0:
        return None
    r = mean * mean / var
    return (1.0 - r) / 2.0, mean * (1.0 + r) / 2.0


def fit_gamma(count: int, s1: float, log_sum: float, newton: int = 0) -> tuple[float, float] | None:
    """Gamma (alpha, beta) from mean(y) and mean(ln y): Minka's approximation
    alpha = (3 - s + sqrt((s-3)^2 + 24 s)) / (12 s), s = ln mean(y) - mean(ln y), refined by
    `newton` generalized Newton steps on ln alpha - psi(alpha) = s; None if s <= 1e-12."""
    mean = s1 / count
    s = math.log(mean) - log_sum / count
    if not s > 1e-12:
        return None
    alpha = (3.0 - s + math.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
    for _ in range(newton):  # Minka (2002), Eq. 5
        residual = math.log(alpha) - float(special.digamma(alpha)) - s
        slope = alpha * alpha * (1.0 / alpha - float(special.polygamma(1, alpha)))
        alpha = 1.0 / (1.0 / alpha + residual / slope)
    return alpha, mean / alpha


def stage_bound(ratio: float, first_stage_ratio: float) -> int:
    """M_max = ceil(log2(1/delta)), 1 when delta >= delta_1 (this library's bound on the
    stages of Sec. 2.4)."""
    return 1 if ratio >= first_stage_ratio else max(1, math.ceil(math.log2(1.0 / ratio)))


# -- stage adaptation ------------------------------------------------------------------------
class StageAdapter:
    """Adapts the number of stages M from the windowed mean of k_hat / k (Sec. 3,
    Algorithm 1).

    ``paper``: every Q samples, M - 1 if r > 1 + eps, M + 1 if r < 1 - eps (Algorithm 1).
    ``bidirectional``: the first move follows the paper's guess, later moves keep their
    direction while the error shrinks and reverse when it grows; moves reflect at the bounds;
    a local optimum (both neighbours recently worse) holds M for 4 windows. With `escape`, a
    local optimum still outside the tolerance first tries M + 2 (under-selection) or M - 2
    (over-selection) when that count was not tried recently: a worse neighbour can hide a
    better count behind it (the LSTM embedding of docs/sparsifiers.md sits at k_hat/k 0.06
    between M = 1 and 2 while M = 3 gives about 0.8).
    ``off``: M stays where it was set."""

    def __init__(self, rule: str, interval: int, tolerance: float, m_max: int,
                 stages: int = 1, escape: bool = False) -> None:
        self.rule, self.interval, self.tolerance = rule, interval, tolerance
        self.escape = escape
        self.m_max = m_max
        self.stages = min(max(1, stages), m_max)
        self.unset = False  # stages: auto before the first call chose M
        self.last_move = 0
        self.prev_err: float | None = None
        self.hold = 0
        self.window: list[float] = []
        self.seen: dict[int, tuple[float, int]] = {}  # M -> (error, window id)
        self.windows = 0

    def observe(self, quality: float) -> None:
        if self.rule == "off" or self.m_max == 1:
            return
        self.window.append(quality)
        if len(self.window) < self.interval:
            return
        r = sum(self.window) / len(self.window)
        self.window = []
        if self.rule == "paper":
            if r > 1.0 + self.tolerance:
                self.stages = max(1, self.stages - 1)
            elif r < 1.0 - self.tolerance:
                self.stages = min(self.m_max, self.stages + 1)
            return
        self._bidirectional(r)

    def _bidirectional(self, r: float) -> None:
        m, err, wid = self.stages, abs(r - 1.0), self.windows
        self.windows += 1
        self.seen[m] = (err, wid)
        if err <= self.tolerance or self.hold > 0:
            self.hold = max(0, self.hold - 1)
            self.last_move, self.prev_err = 0, err
            return
        if self.last_move == 0:
            direction = 1 if r < 1.0 else -1
        elif self.prev_err is not None and err < self.prev_err:
            direction = self.last_move
        else:
            direction = -self.last_move
        def recent(n: int) -> bool:
            return n in self.seen and wid - self.seen[n][1] < 2 * self.m_max

        neighbours = [n for n in (m - 1, m + 1) if 1 <= n <= self.m_max]
        if all(recent(n) and self.seen[n][0] > err for n in neighbours):
            jump = m + (2 if r < 1.0 else -2)
            if self.escape and 1 <= jump <= self.m_max and not recent(jump):
                self.last_move, self.prev_err, self.stages = jump - m, err, jump
                return
            self.hold, self.last_move, self.prev_err = 3, 0, err
            return
        target = m + direction
        if not 1 <= target <= self.m_max:
            target = m - direction
        target = min(max(1, target), self.m_max)
        self.last_move, self.prev_err, self.stages = target - m, err, target

    def reset(self, m_max: int) -> None:
        """The density changed: clear the window, forget the last move, clamp M."""
        self.m_max = m_max
        self.window, self.last_move = [], 0
        self.stages = min(self.stages, m_max)

    def state_dict(self) -> dict[str, Any]:
        return {"m_max": self.m_max, "stages": self.stages, "unset": self.unset,
                "last_move": self.last_move,
                "prev_err": self.prev_err, "hold": self.hold, "window": list(self.window),
                "seen": [[m, e, w] for m, (e, w) in self.seen.items()], "windows": self.windows}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.m_max, self.stages = int(state["m_max"]), int(state["stages"])
        self.unset = bool(state.get("unset", False))
        self.last_move, self.hold = int(state["last_move"]), int(state["hold"])
        self.prev_err = None if state["prev_err"] is None else float(state["prev_err"])
        self.window = [float(q) for q in state["window"]]
        self.seen = {int(m): (float(e), int(w)) for m, e, w in state["seen"]}
        self.windows = int(state["windows"])


# -- the compressor --------------------------------------------------------------------------
@COMPRESSORS.register("sidco")
class SIDCo(ThresholdSparsifier):
    """SIDCo-E (``variant: sidco_e``), gamma -> GP (``sidco_gamma_gp``) and multi-stage GP
    (``sidco_gp``) threshold sparsification; see the module docstring and docs/sparsifiers.md.

    Options beyond the paper's parameters: ``stages`` is the initial (with ``adapt.rule: off`` the
    fixed) number of stages, or ``auto`` (`data_stages` on each tensor's first call and after
    a change of density); ``gamma_newton`` the Newton steps refining the gamma shape;
    ``exclude_zeros`` (G4) fits the nonzeros only (always for gamma); ``min_numel`` sends
    tensors smaller than this by exact Top-k (G3, besides d < 1/ratio); ``max_overshoot`` c
    trims a selection above c k to its exact top k (G7)."""

    state_attrs = ("pool", "anchor")  # and the adapters, below

    def __init__(self, ratio: float = DEFAULT_RATIO, variant: str = "sidco_e",
                 first_stage_ratio: float = 0.25, stages: int | str = "auto",
                 stage_ratio: str = "fixed",
                 adapt: Mapping[str, Any] | None = None, gamma_quantile: str = "closed_form",
                 gamma_newton: int = 0, gp_negative_shape: str = "exp",
                 exclude_zeros: bool = True, min_numel: int = 0,
                 max_overshoot: float | None = None, nonfinite: str = "raise",
                 backend: str = "auto", warmup_epochs: int = 0,
                 warmup_ratios: list[float] | None = None) -> None:
        super().__init__(ratio, backend=backend, nonfinite=nonfinite,
                         warmup_epochs=warmup_epochs, warmup_ratios=warmup_ratios)
        label = self.label
        self.variant = check_choice(variant, VARIANTS, label, "variant")
        self.first_model, self.later_model = VARIANTS[variant]
        self.first_stage_ratio = float(check_range(first_stage_ratio, label, "first_stage_ratio",
                                                   0.0, 1.0, low_open=True, high_open=True))
        self.initial_stages = "auto" if stages == "auto" else check_range(
            stages, label, "stages", 1, integer=True)
        self.stage_ratio = check_choice(stage_ratio, ("fixed", "count_corrected"), label,
                                        "stage_ratio")
        self.adapt = self._adapt_options(adapt)
        self.gamma_quantile = check_choice(gamma_quantile, ("closed_form", "exact"), label,
                                           "gamma_quantile")
        self.gamma_newton = check_range(gamma_newton, label, "gamma_newton", 0, integer=True)
        self.gp_negative_shape = check_choice(gp_negative_shape, ("exp", "keep"), label,
                                              "gp_negative_shape")
        self.exclude_zeros = bool(exclude_zeros) or self.first_model == "gamma"
        self.min_numel = check_range(min_numel, label, "min_numel", 0, integer=True)
        self.max_overshoot = None if max_overshoot is None else float(
            check_range(max_overshoot, label, "max_overshoot", 1.0))
        self.adapters: dict[str, StageAdapter] = {}
        self.pool = [0.0, 0.0]  # scope global: this step's sums of k_hat and k
        self.anchor: str | None = None  # scope global: the first tensor of every step

    def _adapt_options(self, adapt: Mapping[str, Any] | None) -> dict[str, Any]:
        options = dict(ADAPT_DEFAULTS)
        for key, value in dict(adapt or {}).items():
            if key not in ADAPT_DEFAULTS:
                raise ConfigError(f"{self.label}: unknown option 'adapt.{key}'; allowed: "
                                  f"{', '.join(ADAPT_DEFAULTS)}")
            options[key] = value
        check_choice(options["rule"], ("bidirectional", "paper", "off"), self.label, "adapt.rule")
        options["interval"] = check_range(options["interval"], self.label, "adapt.interval", 1,
                                          integer=True)
        options["tolerance"] = float(check_range(options["tolerance"], self.label,
                                                 "adapt.tolerance", 0.0))
        check_choice(options["scope"], ("tensor", "global"), self.label, "adapt.scope")
        options["escape"] = bool(check_choice(options["escape"], (True, False), self.label,
                                              "adapt.escape"))
        return options

    # -- adaptation state ---------------------------------------------------------------------
    @property
    def m_max(self) -> int:
        return stage_bound(self.ratio, self.first_stage_ratio)

    def adapter(self, name: str) -> StageAdapter:
        """The stage state of tensor `name` (one shared state with ``adapt.scope: global``)."""
        key = name if self.adapt["scope"] == "tensor" else "*"
        if key not in self.adapters:
            auto = self.initial_stages == "auto"
            adapter = StageAdapter(self.adapt["rule"], self.adapt["interval"],
                                   self.adapt["tolerance"], self.m_max,
                                   1 if auto else self.initial_stages, self.adapt["escape"])
            adapter.unset = auto
            self.adapters[key] = adapter
        return self.adapters[key]

    def observe(self, name: str, k_hat: int, k: int) -> None:
        """Feed one estimated tensor's k_hat / k to its adapter; with global scope, pool the
        step's sums and feed them when the step's first tensor comes round again."""
        if self.adapt["scope"] == "tensor":
            self.adapter(name).observe(k_hat / k)
            return
        self.pool[0] += k_hat
        self.pool[1] += k

    def step_boundary(self, name: str) -> None:
        if self.adapt["scope"] != "global":
            return
        if self.anchor is None:
            self.anchor = name
        elif name == self.anchor:
            if self.pool[1] > 0:
                self.adapter(name).observe(self.pool[0] / self.pool[1])
            self.pool = [0.0, 0.0]

    def ratio_changed(self) -> None:
        for adapter in self.adapters.values():
            adapter.reset(self.m_max)
            adapter.unset = self.initial_stages == "auto"

    # -- one tensor ------------------------------------------------------------------------
    def estimate(self, x: torch.Tensor, k: int, name: str) -> Selection:
        self.step_boundary(name)
        d = x.numel()
        first = moments(x, 0.0, self.backend, logs=self.first_model == "gamma")
        if not first.finite:  # G1 (a NaN/Inf makes the sums non-finite)
            return self.nonfinite_input(x, name)
        if first.count == 0:  # G2
            return empty_selection(x)
        if first.count <= k:  # G4: at most k nonzeros, send them all
            return Selection(select(x, above(0.0, x.dtype), self.backend, first.count),
                             threshold=0.0, fallback="nonzeros")
        if d < math.ceil(1.0 / self.ratio) or d < self.min_numel:  # G3
            return exact_topk(x, k, backend=self.backend)
        adapter = self.adapter(name)
        if adapter.unset:
            adapter.stages, adapter.unset = self.data_stages(x, name), False
        eta, used, exact, pool = self.threshold(x, first, k, adapter.stages)
        if exact is not None:
            self.observe(name, exact.indices.numel(), k)
            return exact
        if not (math.isfinite(eta) and eta > 0.0):  # G7: degenerate fit
            return exact_topk(x, k, "degenerate", self.backend)
        indices = self.select_from(x, eta, pool, k)
        k_hat = indices.numel()
        self.observe(name, k_hat, k)
        fallback = None
        if k_hat == 0:  # G7: nothing reached the threshold
            indices, fallback = x.abs().argmax().view(1), "argmax"
        elif self.max_overshoot is not None and k_hat > self.max_overshoot * k:
            indices, fallback = top_k_of(x, indices, k, self.backend), "overshoot"
        return Selection(indices, threshold=eta, stages=used, fallback=fallback)

    def data_stages(self, x: torch.Tensor, name: str) -> int:
        """M for a first call: on a sample of s = max(2^16, 256 / ratio) magnitudes of x
        (drawn with a seed from the tensor's name; all of x when smaller), the smallest M in
        1..M_max whose threshold keeps within half the adaptation tolerance of ratio * s,
        else the smallest M within the count's noise of the nearest (fewer stages: fewer
        passes; k_hat/k is not monotone in M). With about 256 kept that noise is about 6%,
        and guard G6 (fewer than 64 exceedances) never fires inside the sample."""
        d = x.numel()
        if self.m_max == 1:
            return 1
        s = min(d, max(SAMPLE_MIN, math.ceil(SAMPLE_KEPT / self.ratio)))
        if s < d:
            gen = torch.Generator().manual_seed(stable_hash("sidco", name))
            x = x.index_select(0, torch.randint(0, d, (s,), generator=gen).to(x.device))
        first = moments(x, 0.0, self.backend, logs=self.first_model == "gamma")
        want = self.ratio * s
        if first.count <= want:
            return 1
        errors = []
        for m in range(1, self.m_max + 1):
            eta, _, exact, _ = self.threshold(x, first, max(1, round(want)), m)
            kept = (exact.indices.numel() if exact is not None
                    else count_above(x, below(eta, x.dtype), self.backend))
            errors.append(abs(kept / want - 1.0))
            if errors[-1] <= self.adapt["tolerance"] / 2:
                return m
        noise = 1.0 / math.sqrt(want)
        return next(m for m, err in enumerate(errors, 1) if err <= min(errors) + noise)

    def threshold(self, x: torch.Tensor, first: Moments, k: int, stages: int
                  ) -> tuple[float, int, Selection | None, Pool | None]:
        """(eta, stages used, exact selection if a guard resolved the tensor exactly, the
        pool of exceedances the later stages ran on). Each later stage sums the exceedances
        of the previous threshold. Once few enough of a large tensor's elements exceed it
        (`pools`), they are collected into a `Pool` in one pass (the chunks where they
        cluster collected again), and the remaining stages and the final selection read
        only the pool instead of the whole tensor (heavy tails take 8-10 stages at density
        0.001): each stage filters the pool in place to its exceedances and sums them as it
        goes. When the density the threshold was fitted to keep is that small already, the
        collection replaces the stage's pass over the tensor and sums what it collects. A
        threshold that is not a number (sums that overflowed) collects nothing, and no
        collection is tried again in the call."""
        d = x.numel()
        n = first.count if self.exclude_zeros else d
        density = min(1.0, self.ratio * d / n)  # G4: delta' over the nonzeros
        delta1 = self.first_stage_ratio
        single = stages == 1 or density >= delta1
        t = self.first_threshold(Moments(n, first.s1, first.s2, first.log_sum),
                                 density if single else delta1)
        if t is None:  # G4: degenerate gamma fit (constant magnitudes)
            return math.nan, 1, exact_topk(x, k, "gamma", self.backend), None
        eta = rounded(t, x.dtype)
        if single:
            return eta, 1, None, None
        rho = (density / delta1) ** (1.0 / (stages - 1))
        used, pool, tried = 1, None, False
        aim = delta1  # the density the current threshold was fitted to keep
        for m in range(2, stages + 1):
            if pool is None and not tried and self.pools(d, aim * n, stages - m + 2):
                # collect first, summing what is collected
                pool, tried = Pool.collect(x, eta, self.backend, round(aim * n), eta), True
                exceed = pool.sums if pool is not None else moments(x, eta, self.backend)
            elif pool is None:
                exceed = moments(x, eta, self.backend)
            else:  # the pool, filtered to this stage's exceedances as they are summed
                exceed = pool.keep(above(eta, x.dtype), eta)
            if exceed.count <= k:  # G5/G6: keep eta
                break
            if exceed.count < EXACT_BELOW:  # G6: exact inside the small exceedance set
                idx = self.select_from(x, above(eta, x.dtype), pool, exceed.count)
                idx = top_k_of(x, idx, k, self.backend)
                kth = float(x.index_select(0, idx).abs().min())
                return kth, m, Selection(idx, kth, m, fallback="exact"), None
            if m < stages and pool is None and not tried and self.pools(d, exceed.count,
                                                                        stages - m + 1):
                pool, tried = Pool.collect(x, eta, self.backend, exceed.count), True
            if self.stage_ratio == "count_corrected":
                rho = min(1.0, (k / exceed.count) ** (1.0 / (stages - m + 1)))
            eta = rounded(eta + self.tail_threshold(self.later_model, exceed, rho), x.dtype)
            used, aim = m, aim * rho
        return eta, used, None, pool

    def select_from(self, x: torch.Tensor, thr: float, pool: Pool | None,
                    expected: int) -> torch.Tensor:
        """Flat indices of |x| >= thr, ascending: from the pool where there is one (thr is
        at least the threshold it was collected at, so it holds them all), else by a pass
        over x."""
        if pool is None:
            return select(x, thr, self.backend, expected)
        pool.keep(thr)
        return pool.indices()

    @staticmethod
    def pools(d: int, count: float, passes: int) -> bool:
        """Whether to collect the `count` exceedances of a tensor of d elements into a pool
        that `passes` passes (stages' sums and the final selection) then read instead of
        the tensor: a large tensor (`COMPACT_FROM`) of which at most `passes`/16 (at most
        1/4) exceed. A collection costs about one read plus six per pooled fraction of the
        tensor, and saves about one read per pass (measured on the project's CPU)."""
        return (d >= COMPACT_FROM and passes > 0
                and count * POOL_SHARE <= d * min(passes, POOL_PASSES))

    def first_threshold(self, m: Moments, rho: float) -> float | None:
        """Stage 1: the first model fitted to all (nonzero) magnitudes (for gamma, `m` holds
        the sum of their logarithms); None when the gamma fit degenerates (s <= 1e-12)."""
        if self.first_model != "gamma":
            return self.tail_threshold(self.first_model, m, rho)
        params = fit_gamma(m.count, m.s1, m.log_sum, self.gamma_newton)
        return None if params is None else gamma_quantile(*params, rho, self.gamma_quantile)

    def tail_threshold(self, model: str, m: Moments, rho: float) -> float:
        """Exponential or GP threshold fitted to the (shifted) exceedances summarised by `m`."""
        mean = m.s1 / m.count
        params = fit_gp(m.count, m.s1, m.s2) if model == "gp" else None
        if params is None:  # exponential, or a GP with zero variance
            return exponential_quantile(mean, rho)
        alpha, beta = params
        if abs(alpha) < 1e-4 or (alpha < 0.0 and not (self.gp_negative_shape == "keep"
                                                      and alpha > -0.5)):
            return exponential_quantile(mean, rho)
        return gp_quantile(alpha, beta, rho)

    # -- checkpoints: the adapters are created on first use, so they restore by name ---------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "adapters": {n: a.state_dict() for n, a in self.adapters.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.adapters = {}
        for name, adapter_state in state["adapters"].items():
            self.adapter(name if self.adapt["scope"] == "tensor" else "*").load_state_dict(
                adapter_state)
