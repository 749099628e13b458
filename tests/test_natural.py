"""Natural compression C_nat (Horvath et al., "Natural Compression for Distributed Deep
Learning"): its properties, the wire formats, edge cases and the fused kernel against the
torch recipe."""

import math

import numpy as np
import pytest
import torch

import gracecomm.compressors.shared.stochastic as stochastic
from gracecomm.compressors.natural import Natural, nat9_nbytes
from gracecomm.compressors.shared.quantizer_kernels import PARALLEL_MIN
from gracecomm.compressors.shared.stochastic import FLOAT_BITS, counter_hash, natural_round_bits
from gracecomm.metrics import Metrics
from gracecomm.validation import ConfigError, NonFiniteError, PayloadError
from tests.quantizer_checks import assert_kernels_match_torch, bound, gaussian

F32 = FLOAT_BITS[torch.float32]


def make(**options):
    return bound(Natural(**options))


def cnat(c, x, name="t"):
    payload, ctx = c.compress(x, name)
    return c.decompress(payload, ctx)


def exact_moments(x):
    """(k, p) with |x| = 2^k (1 + p), in float64."""
    a = x.double().abs()
    k = torch.floor(torch.log2(a))
    return k, a / torch.exp2(k) - 1


# 1. exact unbiasedness: all 2^23 values of R average to t exactly
@pytest.mark.parametrize("t", [1.0, 1.5, float(np.float32(4 / 3)), 1 + 2**-23, -1.75 * 2**100,
                               2**-126, 3 * 2**-149, -0.0])
def test_rounding_is_exactly_unbiased_over_every_r(t):
    bits = torch.tensor([t], dtype=torch.float32).view(torch.int32)
    out = natural_round_bits(bits, torch.arange(2**23, dtype=torch.int32), F32)
    assert out.view(torch.float32).double().sum().item() / 2**23 == float(np.float32(t))


# 2. statistical unbiasedness with the real generators
@pytest.mark.parametrize("rng,n", [("counter", 10**5), ("torch", 2 * 10**4)])
def test_mean_of_many_compressions_converges_to_the_input(rng, n):
    x = gaussian(n, seed=1)
    c = make(rng=rng)
    draws = 200
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for _ in range(draws):
        total += cnat(c, x).double()
    k, p = exact_moments(x)
    var = torch.exp2(2 * k) * p * (1 - p)  # per-draw variance 4^k p (1 - p)
    err = total / draws - x.double()
    z_global = err.sum() / torch.sqrt(var.sum() / draws)
    assert abs(float(z_global)) < 4
    live = var > 0
    z = err[live] / torch.sqrt(var[live] / draws)
    assert float(z.pow(2).mean().sqrt()) == pytest.approx(1.0, abs=0.05)


# 3. support
def test_outputs_are_neighbouring_powers_of_two_with_the_sign_kept():
    x = gaussian(10**4, seed=2) * 1e3
    x[:4] = torch.tensor([1.0, -0.25, 2.0**-100, 0.0])
    out = cnat(make(), x)
    k, _ = exact_moments(x[4:])
    exp = torch.log2(out[4:].double().abs())
    assert torch.equal(exp, torch.round(exp))  # powers of two
    assert bool(((exp == k) | (exp == k + 1)).all())
    assert torch.equal(torch.sign(out), torch.sign(x))
    assert out[:4].tolist() == [1.0, -0.25, 2.0**-100, 0.0]  # fixed points


# 4. second moment
def test_second_moment_ratio_is_at_most_nine_eighths():
    p = torch.arange(2**23, dtype=torch.float64) / 2**23
    ratio = (1 + 3 * p) / (1 + p) ** 2
    assert float(ratio.max()) <= 9 / 8
    assert int(ratio.argmax()) == 2796203
    assert float(9 / 8 - ratio.max()) < 1e-15


def test_adversarial_and_gaussian_second_moments():
    gen = torch.Generator().manual_seed(3)
    n = 10**6
    k = torch.randint(-1, 2, (n,), generator=gen).float()
    sign = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    adversarial = sign * float(np.float32(4 / 3)) * torch.exp2(k)
    c = make()
    ratio = float(cnat(c, adversarial).double().pow(2).sum() / adversarial.double().pow(2).sum())
    assert ratio == pytest.approx(9 / 8, abs=0.005)
    x = gaussian(n, seed=4)
    kk, p = exact_moments(x)
    expected = float((torch.exp2(2 * kk) * (1 + 3 * p)).sum() / x.double().pow(2).sum())
    assert expected == pytest.approx(1.0818, abs=0.0005)
    empirical = float(cnat(c, x).double().pow(2).sum() / x.double().pow(2).sum())
    assert empirical == pytest.approx(expected, abs=0.007)


# 5. edges
def test_overflow_saturates_or_raises_and_never_makes_inf():
    big = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 1.0])
    c = make()
    out = cnat(c, big)
    assert torch.isfinite(out).all()
    assert out[:2].tolist() == [2.0**127, -(2.0**127)]
    assert c.metrics.pop()["saturated"] == 2
    with pytest.raises(OverflowError, match="'big'"):
        cnat(make(overflow="raise"), big, "big")


@pytest.mark.parametrize("rng", ["counter", "torch"])
def test_nonfinite_values_raise_with_the_tensor_name_or_become_zero(rng):
    x = torch.tensor([1.0, float("inf"), float("nan"), -2.0])
    with pytest.raises(NonFiniteError, match="'grad.w'"):
        make(rng=rng).compress(x, "grad.w")
    c = make(nonfinite="zero", rng=rng)
    out = cnat(c, x)
    assert out[1:3].tolist() == [0.0, 0.0] and out[0] == 1.0 and out[3] == -2.0
    assert c.metrics.pop()["nonfinite"] == 2


def test_signed_zeros_round_trip_and_denormals_stay_unbiased():
    zeros = torch.tensor([0.0, -0.0])
    out = cnat(make(), zeros)
    assert torch.equal(torch.signbit(out), torch.tensor([False, True]))
    tiny = 3 * 2.0**-149
    draws = cnat(make(), torch.full((10**6,), tiny)).double()
    assert set(draws.unique().tolist()) <= {0.0, 2.0**-126}
    p = tiny / 2.0**-126
    sigma = 2.0**-126 * math.sqrt(p * (1 - p) / 10**6)
    assert abs(float(draws.mean()) - tiny) < 5 * sigma


# 6. wire formats
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 2600])
def test_payload_bytes_follow_the_documented_formats(n):
    x = gaussian(n)
    nbytes = {wire: sum(t.numel() * t.element_size() for t in make(wire=wire).compress(x, "t")[0])
              for wire in ("nat9", "nat8", "float32", "int_fixed")}
    assert nbytes == {"nat9": n + math.ceil(n / 8), "nat8": n, "float32": 4 * n,
                      "int_fixed": 8 * n}
    assert nat9_nbytes(n) == nbytes["nat9"]
    if n % 8 == 0:
        assert nbytes["nat9"] * 32 == 9 * 4 * n  # 9/32 of dense
    assert sum(t.numel() for t in make().compress(x.double(), "t")[0]) == math.ceil(12 * n / 8)


def test_fused_kernel_matches_the_torch_recipe_bit_for_bit():
    x = gaussian(PARALLEL_MIN + 5, seed=5)  # split over threads, with an odd tail
    x[:3] = torch.tensor([0.0, -0.0, 2.0**-140])
    c = make()
    key = stochastic.RandomStreams(0).next_key("t", 0)
    fast = cnat(c, x)
    r = (counter_hash(torch.arange(x.numel()), key) >> 9).to(torch.int32)
    want = natural_round_bits(x.view(torch.int32), r, F32).view(torch.float32)
    assert torch.equal(fast.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("options", [{}, {"rounding": "deterministic"}, {"wire": "nat8"}])
def test_torch_code_paths_give_the_same_bits(options, monkeypatch):
    assert_kernels_match_torch(lambda: Natural(**options), monkeypatch, seed=6)


def test_nat8_range_and_low_clip():
    c = make(wire="nat8")
    inside = torch.tensor([2.0**-50, -(2.0**10), 2.0**-3, 0.0, -1.0])
    assert torch.equal(cnat(c, inside), inside)
    out = cnat(c, torch.tensor([2.0**12]))
    assert out.item() == 2.0**10 and c.metrics.pop()["saturated"] == 1
    draws = cnat(c, torch.full((10**6,), 2.0**-52)).double()
    assert set(draws.unique().tolist()) <= {0.0, 2.0**-50}
    sigma = 2.0**-50 * math.sqrt(0.25 * 0.75 / 10**6)
    assert abs(float(draws.mean()) - 2.0**-52) < 5 * sigma
    assert cnat(make(wire="nat8", low_clip="flush"), torch.tensor([2.0**-60])).item() == 0.0
    assert cnat(make(wire="nat8", low_clip="clamp"), torch.tensor([2.0**-60])).item() == 2.0**-50


def test_int_fixed_is_summable_and_checks_headroom():
    c = make(wire="int_fixed")
    assert c.capabilities().summable and not Natural.summable
    x = torch.tensor([2.0**-50, -(2.0**10), 0.75, 0.0])
    payload, ctx = c.compress(x, "t")
    assert payload[0].dtype == torch.int64
    summed = (payload[0] + payload[0],)  # what allreduce hands decompress for 2 equal ranks
    assert torch.equal(c.decompress(summed, ctx) / 2, cnat(make(wire="int_fixed"), x))

    class EightRanks:
        world_size, rank = 8, 0

    with pytest.raises(ConfigError, match="int64"):
        Natural(wire="int_fixed").bind(EightRanks(), Metrics())


def test_malformed_payloads_raise():
    c = make()
    payload, ctx = c.compress(gaussian(20), "t")
    bad_code = payload[0].clone()
    bad_code[3] = 255
    with pytest.raises(PayloadError, match="reserved"):
        c.decompress((bad_code, payload[1]), ctx)
    with pytest.raises(PayloadError, match="elements"):
        c.decompress((payload[0][:-1], payload[1]), ctx)
    with pytest.raises(PayloadError, match="dtype"):
        c.decompress((payload[0].to(torch.int16), payload[1]), ctx)
    c8 = make(wire="nat8")
    code, ctx8 = c8.compress(gaussian(4), "t")
    for reserved in (0b0100_0001, 61):  # zero flag with an offset; offset past e_max - e_min
        with pytest.raises(PayloadError, match="reserved"):
            c8.decompress((torch.full_like(code[0], reserved),), ctx8)


# 7. deterministic rounding
def test_deterministic_rounding():
    c = make(rounding="deterministic")
    assert c.capabilities().default_memory == "residual"
    k = torch.tensor([-3.0, 0.0, 5.0])
    x = torch.cat([1.4999 * torch.exp2(k), -1.5 * torch.exp2(k)])
    out = cnat(c, x)
    assert torch.equal(out, torch.cat([torch.exp2(k), -torch.exp2(k + 1)]))
    assert torch.equal(cnat(c, out), out)  # idempotent
    y = gaussian(10**4, seed=7)
    assert float(((cnat(c, y) - y).abs() / y.abs()).max()) <= 1 / 3 + 1e-7
    assert c.streams.counters == {}  # no random numbers drawn


def test_half_precision_and_float64_inputs():
    half = torch.tensor([65504.0, 1.0, -3.0], dtype=torch.float16)
    c = make()
    out = cnat(c, half)
    assert out.dtype == torch.float16 and out[0].item() == 2.0**15
    assert c.metrics.pop()["saturated"] == 1
    bf = torch.tensor([1e38, -3.0], dtype=torch.bfloat16)
    assert torch.isfinite(cnat(make(), bf)).all()
    x = gaussian(1000).double() * 1e200
    out64 = cnat(make(), x)
    assert out64.dtype == torch.float64
    ratio = out64 / x
    assert bool(((ratio >= 0.5) & (ratio <= 2)).all())
    with pytest.raises(TypeError, match="nat9"):
        make(wire="nat8").compress(x, "t")


def test_empty_and_scalar_tensors():
    for x in (torch.empty(0), torch.tensor(3.0), torch.empty(2, 0)):
        out = cnat(make(), x)
        assert out.shape == x.shape and out.dtype == x.dtype


def test_state_dict_resumes_the_random_stream(tmp_path):
    x = gaussian(100)
    c = make()
    cnat(c, x)
    torch.save(c.state_dict(), tmp_path / "s.pt")
    expected = cnat(c, x)
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert torch.equal(cnat(resumed, x), expected)


@pytest.mark.parametrize("options,message", [
    ({"wire": "nat7"}, "option 'wire' must be one of"),
    ({"exp_range": [10, -50]}, "e_max - e_min"),
    ({"exp_range": [-200, 0]}, "exp_range[0]"),
    ({"rng": "philox"}, "option 'rng'"),
    ({"rounding": "nearest"}, "option 'rounding'"),
])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ConfigError) as err:
        Natural(**options)
    assert message in str(err.value)
