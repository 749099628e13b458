"""Threshold sparsifiers (DGC, SIDCo, RedSync, GaussianKSGD), DGC memory and the density
warm-up: the estimators' checks. Seeded; statistical margins of several
sigma (the reference values in comments come from a float64 simulation)."""

import io
import math

import numpy as np
import pytest
import torch
from scipy import stats

from gracecomm.compressors.dgc import DGC
from gracecomm.compressors.gaussiank import GaussianK
from gracecomm.compressors.redsync import RedSync
from gracecomm.compressors.shared import exceedance
from gracecomm.compressors.shared.schedule import RatioSchedule
from gracecomm.compressors.sidco import (
    SIDCo,
    StageAdapter,
    exponential_quantile,
    fit_gamma,
    fit_gp,
    gamma_quantile,
    gp_quantile,
)
from gracecomm.compressors.topk import TopK
from gracecomm.memories.dgc import DGCMemory
from gracecomm.memories.residual import ResidualMemory
from gracecomm.metrics import Metrics
from gracecomm.needs import Need
from gracecomm.validation import ConfigError, NonFiniteError, numba_available
from tests.helpers import slow_dtypes

D_BIG = 2_621_440
D_SMALL = 262_144


def draw(kind, d, seed):
    """float32 samples: laplace, gaussian, t3 (Student-t, 3 dof), gp (GP(0.25, 1) magnitudes
    with random signs), gamma:<shape> (gamma magnitudes with random signs)."""
    rng = np.random.default_rng(seed)
    if kind == "laplace":
        x = rng.laplace(size=d)
    elif kind == "gaussian":
        x = rng.standard_normal(d)
    elif kind == "t3":
        x = rng.standard_t(3, size=d)
    elif kind == "gp":
        x = stats.genpareto.ppf(rng.random(d), 0.25) * rng.choice([-1.0, 1.0], d)
    else:
        x = rng.gamma(float(kind.split(":")[1]), size=d) * rng.choice([-1.0, 1.0], d)
    return torch.from_numpy(x.astype(np.float32))


def run(comp, x, name="g"):
    """Compress once; return (payload, the sink record)."""
    records = []
    comp.sink = records.append
    comp.bind(None, Metrics())
    payload, _ = comp.compress(x, name)
    return payload, records[-1]


def quality(comp, x, name="g"):
    rec = run(comp, x, name)[1]
    return rec["k_hat"] / rec["k"]


def sidco(ratio=0.001, stages=1, **kw):
    return SIDCo(ratio, stages=stages, adapt={"rule": "off"}, **kw)


# -- Sec. 7.1-7.2: formulas and estimators -------------------------------------------------
@pytest.mark.parametrize("rho", [0.25, 0.1, 0.01, 0.001])
def test_quantiles_match_scipy(rho):
    assert exponential_quantile(1.7, rho) == pytest.approx(
        stats.expon.ppf(1 - rho, scale=1.7), rel=1e-5)
    assert gp_quantile(0.2, 1.3, rho) == pytest.approx(
        stats.genpareto.ppf(1 - rho, 0.2, scale=1.3), rel=1e-5)
    for alpha in (0.3, 2.0):
        assert gamma_quantile(alpha, 1.5, rho, "exact") == pytest.approx(
            stats.gamma.ppf(1 - rho, alpha, scale=1.5), rel=1e-5)
    # closed form inside its validity region (alpha <= 1, x >= 1): -beta (ln rho + ln Gamma(alpha))
    if rho <= 0.1:
        assert gamma_quantile(0.5, 1.5, rho) == pytest.approx(
            -1.5 * (math.log(rho) + math.lgamma(0.5)), rel=1e-12)
    # outside it (alpha > 1) the closed-form option uses the exact quantile
    assert gamma_quantile(2.0, 1.5, rho) == gamma_quantile(2.0, 1.5, rho, "exact")


def test_estimators_recover_parameters():
    rng = np.random.default_rng(0)
    for alpha in (0.2, 0.5, 1.0, 2.0, 5.0):
        y = rng.gamma(alpha, 2.0, D_BIG)
        t = torch.from_numpy(y.astype(np.float32))
        m = exceedance.moments(t, 0.0, logs=True)
        est, _ = fit_gamma(m.count, m.s1, m.log_sum)
        mle = stats.gamma.fit(y, floc=0)[0]
        assert est == pytest.approx(mle, rel=0.02), alpha
    y = torch.from_numpy(stats.genpareto.rvs(0.2, scale=1.0, size=D_BIG, random_state=rng)
                         .astype(np.float32))
    m = exceedance.moments(y, 0.0)
    alpha, beta = fit_gp(m.count, m.s1, m.s2)
    assert abs(alpha - 0.2) < 0.01 and beta == pytest.approx(1.0, rel=0.01)
    e = torch.from_numpy(rng.exponential(size=D_BIG).astype(np.float32))
    m = exceedance.moments(e, 0.0)
    assert abs(fit_gp(m.count, m.s1, m.s2)[0]) < 0.01


# -- Sec. 7.3-7.4: single and multi stage -------------------------------------------------
def test_laplace_single_stage_quality():
    qs = {r: [] for r in (0.1, 0.01, 0.001)}
    for seed in range(5):
        x = draw("laplace", D_BIG, seed)
        for r in qs:
            qs[r].append(quality(sidco(r), x))
    for r, values in qs.items():
        assert all(0.95 <= q <= 1.05 for q in values), (r, values)
        assert abs(np.mean(values) - 1) <= 0.02, (r, values)


def test_heavy_and_light_tails_single_vs_multi_stage():
    t3 = draw("t3", D_BIG, 1)
    assert quality(sidco(stages=1), t3) > 3  # ref 4.7
    assert 0.8 <= quality(sidco(stages=3), t3) <= 1.2  # ref 1.17
    assert abs(quality(sidco(stages=1, variant="sidco_gp"), t3) - 1) > 0.2  # ref 1.36
    for m in range(2, 11):
        assert abs(quality(sidco(stages=m, variant="sidco_gp"), t3) - 1) <= 0.2, m
    gp = draw("gp", D_BIG, 2)
    for m in range(1, 11):
        assert abs(quality(sidco(stages=m, variant="sidco_gp"), gp) - 1) <= 0.1, m
    assert quality(sidco(stages=1), gp) > 5  # ref 8.4
    gauss = draw("gaussian", D_BIG, 3)
    assert quality(sidco(stages=1), gauss) < 0.2
    assert abs(quality(sidco(stages=4), gauss) - 1) <= 0.2


def test_stages_reported_and_thresholds_accumulate():
    x = draw("t3", D_SMALL, 4)
    _, one = run(sidco(0.001, stages=1), x)
    _, three = run(sidco(0.001, stages=3), x)
    assert one["stages"] == 1 and three["stages"] == 3
    assert three["threshold"] > one["threshold"] > 0  # eta_m = eta_{m-1} + t_m
    k_hat = int((x.abs() >= three["threshold"]).sum())
    assert three["k_hat"] == k_hat


# -- Sec. 7.5-7.6: adaptation, count-corrected --------------------------------------------
def t3_torch(d, gen):
    chi2 = torch.randn(3, d, generator=gen).square().sum(0)
    return torch.randn(d, generator=gen) / (chi2 / 3).sqrt()


def adapt_run(kind, rule, d, steps=100):
    """Stages and k_hat/k over `steps` steps of a SIDCo compressor at ratio 0.001 fed a cycle
    of 10 independent samples (fresh enough for the windowed means, and cheap)."""
    pool = [draw(kind, d, 100 + i) for i in range(10)]
    comp = SIDCo(0.001, stages=1, adapt={"rule": rule})  # the rules' dynamics from M = 1
    ms, qs = [], []
    for step in range(steps):
        qs.append(quality(comp, pool[step % len(pool)]))
        ms.append(comp.adapters["g"].stages)
    return ms, qs


def test_adaptation_rules():
    ms, qs = adapt_run("t3", "paper", D_SMALL, steps=40)
    assert set(ms) == {1} and min(qs) > 3  # the paper's rule is stuck at M = 1
    ms, qs = adapt_run("t3", "bidirectional", D_BIG)
    assert 3 in ms[:4 * 5], ms[:20]  # M reaches 3 within 4 windows
    assert abs(np.mean(qs[-50:]) - 1) <= 0.2, np.mean(qs[-50:])  # ref 1.16
    for rule in ("paper", "bidirectional"):
        ms, _ = adapt_run("gaussian", rule, D_SMALL, steps=40)
        assert ms[-1] == 4, (rule, ms)
    ms, _ = adapt_run("laplace", "bidirectional", D_SMALL, steps=40)
    assert set(ms) == {1}


@pytest.mark.parametrize("variant", ["sidco_e", "sidco_gp", "sidco_gamma_gp"])
def test_stages_auto_estimates_m_on_the_first_call(variant):
    """stages: auto (the default) picks M from a sample of the first call's tensor: k_hat/k
    within 1 +- 0.2 over the first ten calls, where starting from M = 1 keeps 3-5x k on
    t(3) and under 0.1 k on Gaussian data until the adaptation catches up."""
    for kind in ("laplace", "t3", "gaussian"):
        comp = SIDCo(0.001, variant=variant)
        qs = [quality(comp, draw(kind, D_BIG, 200 + i)) for i in range(10)]
        assert abs(np.mean(qs) - 1) <= 0.2, (kind, qs)
    laplace = SIDCo(0.001, variant=variant)
    quality(laplace, draw("laplace", D_SMALL, 0))
    assert laplace.adapters["g"].stages == 1  # one stage suffices: the fewest passes
    assert not laplace.adapters["g"].unset
    state = laplace.state_dict()
    laplace.set_epoch(0)
    fresh = SIDCo(0.001, variant=variant)
    fresh.load_state_dict(state)
    assert not fresh.adapters["g"].unset and fresh.adapters["g"].stages == 1


def test_bidirectional_rule_step_by_step():
    a = StageAdapter("bidirectional", interval=1, tolerance=0.2, m_max=10)
    a.observe(4.7)  # over-selection: the paper's guess is M - 1, reflected at the bound
    assert (a.stages, a.last_move) == (2, 1)
    a.observe(3.5)  # the error shrank: keep going
    assert a.stages == 3
    a.observe(1.1)  # within tolerance: stay
    assert (a.stages, a.last_move) == (3, 0)
    a.observe(0.5)  # under-selection: paper's guess M + 1
    assert a.stages == 4
    a.observe(0.3)  # worse: reverse
    assert a.stages == 3
    a.observe(0.6)  # both neighbours were worse recently: hold for 4 windows
    assert a.stages == 3 and a.hold == 3
    for _ in range(3):
        a.observe(0.6)
        assert a.stages == 3
    a.reset(m_max=2)
    assert a.stages == 2 and a.window == [] and a.last_move == 0


def test_bidirectional_escape_leaves_a_local_optimum_once():
    """With adapt.escape, the local optimum of the step-by-step test above tries M + 2 before
    holding, comes back when that is worse, and then holds (M + 2 was tried recently)."""
    a = StageAdapter("bidirectional", interval=1, tolerance=0.2, m_max=10, escape=True)
    for q in (4.7, 3.5, 1.1, 0.5, 0.3):
        a.observe(q)
    assert a.stages == 3
    a.observe(0.6)  # both neighbours worse, still under-selecting: try M = 5
    assert (a.stages, a.last_move, a.hold) == (5, 2, 0)
    a.observe(0.3)  # worse: back to 3
    assert a.stages == 3
    a.observe(0.6)  # 5 was tried recently: hold as without escape
    assert a.stages == 3 and a.hold == 3


def test_escape_option_is_checked():
    with pytest.raises(ConfigError, match="adapt.escape"):
        SIDCo(0.01, adapt={"escape": "yes"})
    assert SIDCo(0.01, adapt={"escape": True}).adapter("g").escape


@pytest.mark.parametrize("ratio", [0.01, 0.001])
def test_count_corrected_stages(ratio):
    for kind in ("laplace", "gaussian", "t3", "gp"):
        xs = [draw(kind, D_SMALL, 10 + s) for s in range(6)]
        for variant, tol in (("sidco_gp", 0.1), ("sidco_gamma_gp", 0.1), ("sidco_e", 0.25)):
            for m in (3, 5):
                qs = [quality(sidco(ratio, m, variant=variant, stage_ratio="count_corrected"), x)
                      for x in xs]
                assert abs(np.mean(qs) - 1) <= tol, (kind, variant, m, np.mean(qs))


# -- Sec. 7.7: gamma ----------------------------------------------------------------------
def test_gamma_quantile_and_degenerate_shape_guard():
    x = draw("gamma:0.5", D_BIG, 5)
    for ratio in (0.1, 0.01, 0.001):
        newton = quality(sidco(ratio, variant="sidco_gamma_gp", gamma_quantile="exact",
                               gamma_newton=2), x)
        plain = quality(sidco(ratio, variant="sidco_gamma_gp", gamma_quantile="exact"), x)
        assert abs(newton - 1) <= 0.05 and abs(plain - 1) <= 0.12, (ratio, newton, plain)
    x = draw("gamma:0.2", D_SMALL, 6)  # closed form would be <= 0 at rho = 0.25
    _, rec = run(sidco(0.25, variant="sidco_gamma_gp"), x)
    assert rec["threshold"] > 0 and abs(rec["k_hat"] / rec["k"] - 1) <= 0.1


@pytest.mark.parametrize("stages", [1, 3])
def test_constant_magnitudes_fall_back_to_exact_topk_under_the_gamma_fit(stages):
    """Equal magnitudes give the gamma fit no shape (s = 0): the exact top k, at any stage
    count."""
    x = torch.ones(20_000)
    x[::3] = -1.0
    comp = SIDCo(0.01, variant="sidco_gamma_gp", stages=stages, adapt={"rule": "off"})
    payload, _ = comp.compress(x, "w")
    assert torch.equal(payload[1].long(), torch.arange(200))


# -- Sec. 7.8: guards and bad input ------------------------------------------------------------
def test_guards():
    comp = SIDCo(0.01)
    payload, rec = run(comp, torch.zeros(50_000))
    assert payload[0].numel() == 0 and rec["excluded"] and rec["k_hat"] == 0
    assert "g" not in comp.adapters or comp.adapters["g"].window == []
    stats_ = comp.metrics.pop()
    assert stats_["excluded"] == 1 and "quality_mean" not in stats_

    x = draw("laplace", 500, 0)  # d < 1/ratio: exact top-1
    payload, rec = run(SIDCo(0.001), x)
    assert rec["fallback"] == "topk" and payload[1].tolist() == [int(x.abs().argmax())]

    x = draw("laplace", D_SMALL, 1)
    x[torch.rand(D_SMALL, generator=torch.Generator().manual_seed(1)) < 0.9] = 0
    payload, rec = run(sidco(0.01), x)
    assert not torch.isnan(payload[0]).any() and abs(rec["k_hat"] / rec["k"] - 1) <= 0.1

    payload, rec = run(sidco(0.01), torch.full((10_000,), 0.3))  # constant tensor
    assert rec["k_hat"] >= 1

    sparse = torch.zeros(10_000)
    sparse[[3, 70]] = torch.tensor([1.0, -2.0])
    payload, rec = run(sidco(0.01), sparse)  # at most k nonzeros: send them all
    assert sorted(payload[1].tolist()) == [3, 70] and rec["fallback"] == "nonzeros"

    bad = draw("laplace", 10_000, 2)
    bad[17] = float("nan")
    for comp in (sidco(0.01), RedSync(0.01), GaussianK(0.01)):
        with pytest.raises(NonFiniteError, match="tensor 'g'"):
            run(comp, bad)
    inf = draw("laplace", 10_000, 2)
    inf[17] = float("inf")
    with pytest.raises(NonFiniteError, match="tensor 'g'"):  # DGC: Inf passes any threshold
        run(DGC(0.01), inf)
    bad[::10] = float("nan")
    with pytest.raises(NonFiniteError, match="tensor 'g'"):  # DGC: NaN in its sample
        run(DGC(0.01), bad)
    payload, rec = run(SIDCo(0.01, nonfinite="dense"), bad)
    assert payload[0].numel() == bad.numel() and rec["fallback"] == "dense"

    x = draw("t3", 40_000, 3)
    half = x.half()
    for low in (half, x.bfloat16()):
        _, rec_low = run(sidco(0.01, stages=3), low)
        _, rec_up = run(sidco(0.01, stages=3), low.float())
        assert rec_low["threshold"] == rec_up["threshold"] and rec_low["k_hat"] == rec_up["k_hat"]
        payload, _ = run(sidco(0.01), low)
        assert payload[0].dtype == low.dtype


@pytest.mark.parametrize("cls", [SIDCo, DGC, RedSync, GaussianK])
def test_bad_options_and_all_zero_tensors(cls):
    for ratio in (0.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="ratio"):
            cls(ratio)
    with pytest.raises(ConfigError, match="backend"):
        cls(0.01, backend="cuda")
    payload, rec = run(cls(0.01), torch.zeros(3000))
    assert payload[0].numel() == 0 and rec["excluded"]
    payload, rec = run(cls(1.0), torch.arange(1.0, 9.0))  # ratio 1 keeps everything
    assert payload[1].tolist() == list(range(8))
    with pytest.raises(ConfigError, match="adapt.rule"):
        SIDCo(0.01, adapt={"rule": "sometimes"})
    with pytest.raises(ConfigError, match="adapt.period"):
        SIDCo(0.01, adapt={"period": 3})


# -- backends -------------------------------------------------------------------------------
@pytest.mark.skipif(not numba_available(), reason="numba not installed")
def test_numba_and_torch_backends_agree():
    x = draw("t3", 300_000, 7)
    x[::7] = 0
    for thr in (0.0, 0.5, 3.0, 50.0, 1e9):
        a, b = exceedance.moments(x, thr, "numba"), exceedance.moments(x, thr, "torch")
        assert a.count == b.count and a.s1 == pytest.approx(b.s1, rel=1e-12)
        assert a.s2 == pytest.approx(b.s2, rel=1e-12)
        for expected in (None, 0, 10**6):  # buffers too small are rescanned
            assert torch.equal(exceedance.select(x, thr, "numba", expected),
                               exceedance.select(x, thr, "torch"))
    for make in (lambda b: SIDCo(0.001, stages=3, adapt={"rule": "off"}, backend=b),
                 lambda b: DGC(0.001, backend=b), lambda b: RedSync(0.001, backend=b),
                 lambda b: GaussianK(0.001, backend=b)):
        (va, ia), ra = run(make("numba"), x)
        (vb, ib), rb = run(make("torch"), x)
        assert torch.equal(ia.sort().values, ib.sort().values)
        assert ra["threshold"] == pytest.approx(rb["threshold"], rel=1e-12)
    nan = x.clone()
    nan[5] = float("nan")
    assert not exceedance.moments(nan, 0.0, "numba").finite


@pytest.mark.skipif(not numba_available(), reason="numba not installed")
@pytest.mark.parametrize("dtype", [torch.float16, *slow_dtypes(torch.float64, torch.bfloat16)])
def test_selections_counted_past_full_buffers_in_every_key_width(dtype):
    """A selection whose per-chunk buffers fill up (an expected count far too small) counts
    the rest of each chunk block by block and rescans it: the same positions as torch's,
    for 64- and 16-bit keys, with NaN and Inf in the tensor and a chunk of odd length."""
    x = draw("t3", 300_001, 13).to(dtype)
    x[3], x[9] = float("nan"), float("inf")
    for thr in (0.0, 1.0, 4.0):
        for expected in (0, 1000):
            assert torch.equal(exceedance.select(x, thr, "numba", expected),
                               exceedance.select(x, thr, "torch"))



@pytest.mark.parametrize("dtype", [torch.float32, *slow_dtypes(torch.float64)])
def test_log_sums_are_float64_logarithms(dtype):
    """`moments(..., logs=True)` (the gamma fit of SIDCo's first stage) sums ln|x| over the
    exceedances as float64 logarithms would: each backend, the numba kernel's logarithm
    within 1e-15 of math.log on single elements (subnormals, powers of two, both sides of
    sqrt 2, the largest finite), and non-finite sums for non-finite input."""
    tiny = 1e-40 if dtype == torch.float32 else 1e-310
    finfo = torch.finfo(dtype)
    special = torch.tensor([finfo.tiny, finfo.tiny / 8, tiny, finfo.max, 1.0, 2.0, 0.5,
                            1.4142135, 1.4142137, 0.70710677, 3.0, 1e-30], dtype=dtype)
    x = torch.cat([draw("t3", 300_000, 11).to(dtype) * 1e3, special, -special])
    x[::9] = 0
    runs = [("torch", 1)] + ([("numba", 1), ("numba", 2)] if numba_available() else [])
    before = torch.get_num_threads()
    try:
        for backend, threads in runs:
            torch.set_num_threads(threads)
            for lo in (0.0, 0.5, 1e4):
                a = x.abs().double().numpy()
                logs = np.log(a[a > exceedance.rounded(lo, dtype)])
                got = exceedance.moments(x, lo, backend, logs=True)
                assert got.count == logs.size
                assert abs(got.log_sum - math.fsum(logs)) <= 1e-13 * np.abs(logs).sum(), backend
                assert exceedance.moments(x, lo, backend).log_sum is None
            for bad in (float("nan"), float("inf")):
                y = x.clone()
                y[3] = bad
                assert not math.isfinite(exceedance.moments(y, 0.0, backend, logs=True).log_sum)
    finally:
        torch.set_num_threads(before)
    if numba_available():
        for v in special.tolist():
            one = torch.tensor([v], dtype=dtype)
            got = exceedance.moments(one, 0.0, "numba", logs=True).log_sum
            assert abs(got - math.log(v)) <= 1e-15 * max(1.0, abs(math.log(v))), v

# -- Sec. 7.10: DGC -------------------------------------------------------------------------
def test_dgc_compressor():
    x = draw("laplace", D_SMALL, 8)
    payload, rec = run(DGC(0.01, sample_ratio=1.0), x)
    assert set(payload[1].tolist()) == set(torch.topk(x.abs(), rec["k"]).indices.tolist())
    qs = []
    for kind in ("laplace", "t3", "gaussian"):
        for seed in range(3):
            x = draw(kind, D_SMALL, seed)
            for ratio in (0.1, 0.01, 0.001):
                _, rec = run(DGC(ratio, seed=seed), x)
                assert 1 <= rec["k_hat"] <= rec["k"], (kind, ratio, rec)  # reselect_above 1
                qs.append(rec["k_hat"] / rec["k"])
    assert np.mean(qs) > 0.75
    _, rec = run(DGC(0.001, sampling="strided", reselect_above=1.3, relax_iters=10), x)
    assert rec["k_hat"] <= 1.3 * rec["k"]
    mostly_zero = torch.zeros(D_SMALL)
    mostly_zero[:5] = 1.0
    payload, rec = run(DGC(0.001), mostly_zero)  # sampled threshold 0: only the nonzeros
    assert sorted(payload[1].tolist()) == [0, 1, 2, 3, 4]


def test_dgc_memory_masking_and_conservation():
    mem, comp = DGCMemory(momentum=0.9), DGC(0.05, sample_ratio=1.0)
    gen = torch.Generator().manual_seed(0)
    sent_total = torch.zeros(1000, dtype=torch.float64)
    u_total = torch.zeros(1000, dtype=torch.float64)
    for _ in range(20):
        g = torch.randn(1000, generator=gen)
        v = mem.compensate(g, "w")
        u_total += mem.u["w"].double()  # the momentum added to v this step
        u_before, v_before = mem.u["w"].clone(), v.clone()
        payload, ctx = comp.compress(v, "w")
        mem.update(v, "w", comp, payload, ctx)
        sent = payload[1].long()
        sent_total[sent] += payload[0].double()
        rest = torch.ones(1000, dtype=torch.bool)
        rest[sent] = False
        assert mem.u["w"][sent].eq(0).all() and mem.v["w"][sent].eq(0).all()
        assert torch.equal(mem.u["w"][rest], u_before[rest])
        assert torch.equal(mem.v["w"][rest], v_before[rest])
    assert torch.allclose(sent_total + mem.v["w"].double(), u_total, atol=1e-4)


def test_dgc_memory_without_momentum_equals_residual():
    for comp_a, comp_b in ((TopK(0.05), TopK(0.05)), (DGC(0.05), DGC(0.05))):
        dgc, res = DGCMemory(momentum=0.0), ResidualMemory()
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            g = torch.randn(3, 400, generator=gen)
            ta, tb = dgc.compensate(g, "w"), res.compensate(g, "w")
            assert torch.equal(ta, tb)
            pa, ca = comp_a.compress(ta, "w")
            pb, cb = comp_b.compress(tb, "w")
            dgc.update(ta, "w", comp_a, pa, ca)
            res.update(tb, "w", comp_b, pb, cb)
        assert torch.equal(dgc.v["w"], res.residuals["w"])


def test_dgc_memory_clipping_and_state():
    g = torch.full((100,), 3.0)  # norm 30
    mem = DGCMemory(momentum=0.0, clip_norm=5.0, clip_scope="tensor")
    assert float(mem.compensate(g, "a").norm()) <= 5.0 + 1e-5
    mem = DGCMemory(momentum=0.0, clip_norm=5.0)
    assert mem.needs() == {Need.OWNS_MOMENTUM, Need.GLOBAL_NORM}
    assert DGCMemory(clip_norm=5.0, clip_scope="tensor").needs() == {Need.OWNS_MOMENTUM}
    with pytest.raises(ConfigError, match="set_local_norm"):
        mem.compensate(g, "a")
    mem.set_local_norm(60.0)  # the model's norm: every tensor gets the same factor 5/60
    assert torch.allclose(mem.compensate(g, "a"), g * 5.0 / (60.0 + 1e-6))
    nesterov = DGCMemory(momentum=0.5, nesterov=True)
    nesterov.compensate(torch.ones(4), "a")
    assert torch.allclose(nesterov.compensate(torch.ones(4), "a"), torch.full((4,), 1.5 + 1 + 0.75))
    state = torch.load(_roundtrip(mem.state_dict()), weights_only=True)
    fresh = DGCMemory(momentum=0.0, clip_norm=5.0)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.v["a"], mem.v["a"]) and fresh.local_norm == 60.0


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_ratio_schedule_and_sidco_reset():
    sched = RatioSchedule(0.001, warmup_epochs=4)
    assert [round(sched(e), 4) for e in range(6)] == [0.2512, 0.0631, 0.0158, 0.004, 0.001, 0.001]
    assert [RatioSchedule(0.01, ratios=[0.5, 0.1])(e) for e in range(3)] == [0.5, 0.1, 0.01]
    with pytest.raises(ConfigError, match="not both"):
        RatioSchedule(0.01, 2, [0.5])
    with pytest.raises(ConfigError, match="warmup_ratios"):
        RatioSchedule(0.01, ratios=[2.0])
    comp = SIDCo(0.001, stages=1, warmup_epochs=4)
    assert comp.ratio == pytest.approx(0.2512, abs=1e-4) and comp.m_max == 1
    comp.set_epoch(1)
    assert comp.ratio == pytest.approx(0.0631, abs=1e-4) and comp.m_max == 4
    x = draw("gaussian", D_SMALL, 0)
    for _ in range(7):  # Gaussian data: one stage under-selects, so M rises
        quality(comp, x)
    adapter = comp.adapters["g"]
    assert adapter.stages == 2 and len(adapter.window) == 2
    comp.set_epoch(4)
    assert comp.ratio == 0.001 and adapter.window == [] and adapter.m_max == 10
    assert adapter.stages == 2 and adapter.last_move == 0


def test_state_dicts_resume_bit_identically():
    comp = SIDCo(0.001, adapt={"interval": 2})
    gen = torch.Generator().manual_seed(3)
    xs = [t3_torch(50_000, gen) for _ in range(12)]
    for x in xs[:6]:
        comp.compress(x, "w")
    state = torch.load(_roundtrip(comp.state_dict()), weights_only=True)
    twin = SIDCo(0.001, adapt={"interval": 2})
    twin.load_state_dict(state)
    for x in xs[6:]:
        assert torch.equal(comp.compress(x, "w")[0][1], twin.compress(x, "w")[0][1])
    dgc, twin = DGC(0.01), DGC(0.01)
    dgc.compress(xs[0], "w")
    twin.load_state_dict(torch.load(_roundtrip(dgc.state_dict()), weights_only=True))
    assert torch.equal(dgc.compress(xs[1], "w")[0][1], twin.compress(xs[1], "w")[0][1])


# -- Sec. 7.11: baselines, step by step ------------------------------------------------------
def test_redsync_follows_its_pseudocode():
    # mean 1, max 11, k = 2: probes at t = 0.5, 0.75, 0.875 (thr 6, 8.5, 9.75) all count 1,
    # which lies in the dead band [k/2, k], so the published rule keeps raising the threshold
    x = torch.tensor([11.0, -3.0] + [1 / 3] * 18)
    _, rec = run(RedSync(0.1), x)
    assert rec["threshold"] == pytest.approx(9.75) and rec["k_hat"] == 1
    # strict band lowers it instead: thr 6 (n=1), 3.5 (n=1), 2.25 (n=2 <= k): stop
    payload, rec = run(RedSync(0.1, strict_band=True), x)
    assert rec["threshold"] == pytest.approx(2.25) and sorted(payload[1].tolist()) == [0, 1]
    # k < n < 2k at the first probe stops the search there
    y = torch.tensor([11.0, 10.0, 9.0, 8.0] + [0.0] * 36)  # mean 0.95; k = 6 < n = 8 < 2k
    _, rec = run(RedSync(0.075), torch.cat([y, y]))
    assert rec["threshold"] == pytest.approx(0.95 + 0.5 * (11 - 0.95)) and rec["k_hat"] == 8


def test_gaussiank_follows_its_pseudocode():
    # 974 x +-0.1, 20 x +-0.95, 6 x +-4: mean 0, sigma 0.35184, k = 10 (band [6.67, 13.3])
    values = [0.1] * 974 + [0.95] * 20 + [4.0] * 6
    x = torch.tensor([v * (-1) ** i for i, v in enumerate(values)])
    sigma = math.sqrt((974 * 0.01 + 20 * 0.95**2 + 6 * 16) / 1000)
    thr0 = sigma * stats.norm.ppf(1 - 0.005)
    # counts: thr0 -> 26 (x1.5), 1.5 thr0 -> 6 (x0.5), 0.75 thr0 -> 26 (x1.5, unused)
    _, rec = run(GaussianK(0.01), x)
    assert rec["threshold"] == pytest.approx(0.75 * thr0, rel=1e-5) and rec["k_hat"] == 26
    # five iterations: then 1.125 thr0 -> 6 (x0.5), 0.5625 thr0 -> 26: that set is sent
    _, rec = run(GaussianK(0.01, iterations=5), x)
    assert rec["threshold"] == pytest.approx(0.5625 * thr0, rel=1e-5) and rec["k_hat"] == 26
    # a count inside the band stops at once
    _, rec = run(GaussianK(0.026), x)
    assert rec["k_hat"] == 26 and rec["threshold"] == pytest.approx(
        sigma * stats.norm.ppf(1 - 0.013), rel=1e-5)


def test_trainer_moves_momentum_and_weight_decay_into_dgc_memory():
    from torch import nn

    import gracecomm
    from gracecomm.experiments.training.config import make_optimizer
    from tests.helpers import compose_train

    cfg = compose_train("compressor=dgc", "+memory.clip_norm=1e6", "trainer.weight_decay=0.1")
    model = nn.Linear(4, 3)
    model(torch.randn(5, 4)).sum().backward()
    pipe = gracecomm.build({"name": "dgc", "ratio": 0.5, "sample_ratio": 1.0},
                       {"name": "dgc", "momentum": 0.0, "clip_norm": 1e6})
    opt, decay = make_optimizer(cfg, model, pipe)
    assert opt.param_groups[0]["momentum"] == 0 and opt.param_groups[0]["weight_decay"] == 0
    assert decay == 0.1
    decayed = [p.grad + 0.1 * p.detach() for p in model.parameters()]
    gracecomm.GradientExchange(pipe, model, opt, weight_decay=decay).step()
    norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in decayed])))
    assert pipe.memory.local_norm == pytest.approx(norm, rel=1e-6)
    for p, g in zip(model.parameters(), decayed):  # one rank: the sent half of g + wd w
        kept = p.grad != 0
        assert torch.allclose(p.grad[kept], g[kept]) and int(kept.sum()) == g.numel() // 2


def test_dgc_memory_with_dense_transmission_is_heavy_ball_momentum():
    """Sent whole, a tensor keeps its momentum (v <- 0, u kept): the memory's output is
    PyTorch's SGD momentum buffer, so dense DGC (and LGC's dense layers) is momentum SGD."""
    from gracecomm.registry import create

    memory = create("memory", "dgc", momentum=0.9)
    dense = create("compressor", "none")
    param = torch.zeros(6, requires_grad=True)
    sgd = torch.optim.SGD([param], lr=1.0, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        grad = torch.randn(6, generator=gen)
        before = param.detach().clone()
        param.grad = grad.clone()
        sgd.step()
        v = memory.compensate(grad, "w")
        assert torch.allclose(before - v, param.detach(), atol=1e-6)
        payload, ctx = dense.compress(v, "w")
        memory.update(v, "w", dense, payload, ctx)


def test_signum_runs_the_optimizer_without_momentum():
    import gracecomm

    pipe = gracecomm.build("signum")
    assert Need.OWNS_MOMENTUM in pipe.needs and pipe.needed_by(Need.OWNS_MOMENTUM) == \
        pipe.compressor.label
    assert Need.OWNS_MOMENTUM not in gracecomm.build("signsgd").needs


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_exact_guard_inside_a_pool_selects_as_over_the_tensor(backend, monkeypatch):
    """Guard G6 (few exceedances: exact top k among them) takes them from the pool when the
    later stages run on one: the same selection as a pass over the whole tensor."""
    if backend == "numba":
        pytest.importorskip("numba")
    import gracecomm.compressors.sidco as sidco
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((1 << 21,)) * 1e-3
    monkeypatch.setattr(sidco, "EXACT_BELOW", 20_000)  # fires a few stages in
    pooled_calls = []
    select_from = SIDCo.select_from

    def spy(self, x, thr, pool, expected):
        pooled_calls.append(pool is not None)
        return select_from(self, x, thr, pool, expected)

    monkeypatch.setattr(SIDCo, "select_from", spy)
    results = []
    for compact_from in (1 << 20, 1 << 62):
        monkeypatch.setattr(sidco, "COMPACT_FROM", compact_from)
        comp = SIDCo(ratio=0.001, backend=backend, stages=8, adapt={"rule": "off"})
        eta, used, exact, _ = comp.threshold(x, sidco.moments(x, 0.0, backend), 2097, 8)
        assert exact is not None and exact.fallback == "exact" and used > 2
        results.append((eta, exact.indices))
    assert pooled_calls == [True, False]
    (eta_pooled, pooled), (eta_whole, whole) = results
    assert eta_pooled == eta_whole and torch.equal(pooled, whole) and pooled.numel() == 2097


@pytest.mark.parametrize("dtype", [torch.float32, *slow_dtypes(torch.float64)])
def test_pools_filter_in_place_as_selections_do(dtype):
    """A pool of |x| >= t, filtered in place at rising thresholds, holds what a selection
    from the whole tensor holds, and the moments it takes as it collects and filters are
    those of a pass over the whole tensor (numba's slots and torch alike), also where
    per-chunk slots sized from the expected count overflow (in a few chunks, or in all)
    and those chunks are collected again."""
    x = draw("t3", 1 << 20, 2).to(dtype)
    x[:1 << 17] *= 50  # the first two chunks' slots overflow: they are collected again
    x[::5] = 0
    x[7] = x[8] = 2.5  # ties at a threshold
    before = torch.get_num_threads()
    runs = [("torch", 1)] + ([("numba", 1), ("numba", 2)] if numba_available() else [])

    def same(a, b):
        return a.count == b.count and a.s1 == pytest.approx(b.s1, rel=1e-12) and \
            a.s2 == pytest.approx(b.s2, rel=1e-12)

    try:
        for backend, threads in runs:  # numba: chunks in this thread, or over numba's threads
            torch.set_num_threads(threads)
            for sums_over, expected in ((1.0, 0.35 * x.numel()), (1.3, 1000)):
                pool = exceedance.Pool.collect(x, 1.0, backend, int(expected), sums_over)
                assert (pool.slots is not None) == (backend == "numba")
                assert same(pool.sums, exceedance.moments(x, sums_over, "torch")), backend
                for thr in (1.0, 1.7, 2.5, 6.0, 40.0):
                    if thr > 1.0:
                        for lo in (thr, thr * 1.5):
                            sums = pool.keep(thr, lo)
                            assert same(sums, exceedance.moments(x, lo, "torch")), (backend, lo)
                    assert pool.keep(thr) is None
                    whole = exceedance.select(x, thr, "torch")
                    assert pool.count == whole.numel() and torch.equal(pool.indices(), whole)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_later_stages_on_the_pooled_exceedances_select_the_same(backend, monkeypatch):
    """Once few elements exceed a stage's threshold, the later stages and the selection
    run on those alone: the same selection as passes over the whole tensor."""
    if backend == "numba":
        pytest.importorskip("numba")
    import gracecomm.compressors.sidco as sidco
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((1 << 21,)) * 1e-3
    selections = []
    for compact_from in (1 << 20, 1 << 62):
        monkeypatch.setattr(sidco, "COMPACT_FROM", compact_from)
        comp = SIDCo(ratio=0.001, backend=backend, stages=8, adapt={"rule": "off"})
        eta, used, exact, pool = comp.threshold(x, sidco.moments(x, 0.0, backend), 2097, 8)
        assert exact is None and used >= 4
        assert (pool is not None) == (compact_from == 1 << 20)
        payload, _ = comp.compress(x, "w")
        selections.append((eta, payload[1]))
    (eta_pooled, pooled), (eta_whole, whole) = selections
    assert eta_pooled == eta_whole and torch.equal(pooled, whole)
    assert 0.5 < pooled.numel() / 2097 < 2.0
