"""Dithering family: standard and natural dithering, QSGD, TernGrad (spec natural.md,
Sec. 10, item 8): unbiasedness, the variance figures, levels, wire sizes, malformed payloads
and the fused kernels against the torch code paths."""

import math

import pytest
import torch

import gracecomm.compressors.shared.stochastic as stochastic
from gracecomm.compressors.dithering import QSGD, NaturalDithering, StandardDithering, TernGrad
from gracecomm.validation import ConfigError, PayloadError
from tests.quantizer_checks import assert_kernels_match_torch, bound, gaussian, roundtrip

UNBIASED = [
    lambda: StandardDithering(levels=4),
    lambda: StandardDithering(levels=3, p=1, bucket=50),
    lambda: NaturalDithering(levels=3),
    lambda: NaturalDithering(levels=5, p="inf", bucket=64, norm_compression="natural"),
    lambda: QSGD(levels=7, bucket=128),
    lambda: TernGrad(clip=None),
    lambda: TernGrad(clip=None, rng="torch"),
]


@pytest.mark.parametrize("make", UNBIASED)
def test_dithering_is_unbiased(make):
    x = gaussian(2000, seed=1)
    c = bound(make())
    draws = torch.stack([roundtrip(c, x).double() for _ in range(400)])
    mean, var = draws.mean(0), draws.var(0)
    err = mean - x.double()
    z_global = err.sum() / torch.sqrt(var.sum() / len(draws))
    assert abs(float(z_global)) < 5
    live = var > 0
    rms = float((err[live] / torch.sqrt(var[live] / len(draws))).pow(2).mean().sqrt())
    assert rms == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("make,expected", [
    (lambda: StandardDithering(levels=8), 30.5),
    (lambda: NaturalDithering(levels=8), 0.99),
    (lambda: StandardDithering(levels=128), 0.99),
    (lambda: NaturalDithering(levels=16, p="inf"), 0.081),
    (lambda: StandardDithering(levels=16, p="inf"), 0.013),
])
def test_normalised_variance_matches_the_paper(make, expected):
    x = gaussian(10**5, seed=2)
    c = bound(make())
    var = sum(float((roundtrip(c, x).double() - x.double()).pow(2).sum()) for _ in range(3)) / 3
    assert var / float(x.double().pow(2).sum()) == pytest.approx(expected, rel=0.1)


def levels_of(compressor):
    """Every code's level in units of the norm: its value times the scale of a unit norm."""
    codes = torch.arange(compressor.levels + 1)
    return compressor.code_values(codes) * compressor.code_scales(torch.ones(1))


def test_natural_levels_are_a_subset_of_the_matching_standard_levels():
    for s in (1, 3, 8):
        natural = levels_of(NaturalDithering(levels=s))
        standard = levels_of(StandardDithering(levels=2 ** (s - 1)))
        assert set(natural.tolist()) <= set(standard.tolist())


@pytest.mark.parametrize("make,n", [
    (lambda: NaturalDithering(levels=8), 1001),
    (lambda: StandardDithering(levels=128, bucket=100), 1001),
    (lambda: StandardDithering(levels=300), 64),
    (lambda: QSGD(), 5000),
    (lambda: TernGrad(), 17),
])
def test_payload_bytes(make, n):
    c = bound(make())
    payload, _ = c.compress(gaussian(n), "t")
    buckets = math.ceil(n / (c.bucket or n))
    bits = math.ceil(math.log2(c.levels + 1))
    assert [t.numel() * t.element_size() for t in payload] == [
        4 * buckets, math.ceil(n / 8), math.ceil(n * bits / 8)]
    assert 1 + bits == math.ceil(math.log2(2 * c.levels + 1))  # = ceil(log2(2s + 1)) bits


def nbytes(payload):
    return sum(t.numel() * t.element_size() for t in payload)


def test_qsgd_and_terngrad_bits_per_element():
    n = 512 * 100
    assert nbytes(bound(QSGD()).compress(gaussian(n), "t")[0]) * 8 / n == 8 + 32 / 512
    assert nbytes(bound(TernGrad()).compress(gaussian(n), "t")[0]) == 4 + n // 4


def test_terngrad_clips_to_a_multiple_of_the_standard_deviation():
    x = gaussian(10**4, seed=3)
    x[0] = 100.0
    out = roundtrip(bound(TernGrad(clip=2.5)), x)
    scale = 2.5 * float(x.std(correction=0))
    magnitudes = out.abs().unique()
    assert magnitudes[0] == 0 and len(magnitudes) == 2
    assert float(magnitudes[1]) == pytest.approx(scale, rel=1e-6)


@pytest.mark.parametrize("make", [lambda: NaturalDithering(levels=6, bucket=333),
                                  lambda: StandardDithering(levels=100, p="inf", bucket=1000),
                                  lambda: QSGD(), lambda: TernGrad()])
def test_torch_code_paths_give_the_same_bits(make, monkeypatch):
    assert_kernels_match_torch(make, monkeypatch, seed=4)


def test_zero_and_odd_inputs():
    c = bound(NaturalDithering())
    assert torch.equal(roundtrip(c, torch.zeros(10)), torch.zeros(10))
    for x in (torch.empty(0), torch.tensor(2.0), gaussian(30).half(), gaussian(30).double()):
        out = roundtrip(c, x)
        assert out.shape == x.shape and out.dtype == x.dtype


def test_malformed_payloads_raise():
    c = bound(StandardDithering(levels=5))
    (norms, signs, codes), ctx = c.compress(gaussian(16), "t")
    with pytest.raises(PayloadError, match="reserved"):
        c.decompress((norms, signs, torch.full_like(codes, 0xFF)), ctx)
    with pytest.raises(PayloadError, match="elements"):
        c.decompress((norms, signs[:-1], codes), ctx)
    with pytest.raises(PayloadError, match="3"):
        c.decompress((norms, signs), ctx)


@pytest.mark.parametrize("make,message", [
    (lambda: StandardDithering(levels=0), "option 'levels'"),
    (lambda: NaturalDithering(levels=200), "option 'levels'"),
    (lambda: StandardDithering(p=3), "option 'p'"),
    (lambda: QSGD(bucket=0), "option 'bucket'"),
    (lambda: TernGrad(clip=-1.0), "option 'clip'"),
    (lambda: NaturalDithering(norm_compression="fp16"), "option 'norm_compression'"),
])
def test_bad_options(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.parametrize("levels", [1, 3, 7, 15, 31, 63, 127, 255])  # level codes of 1..8 bits
@pytest.mark.parametrize("n", [1, 63, 64, 65, 511, 4096 + 77])
def test_every_code_width_encodes_as_torch_does(levels, n, monkeypatch):
    """Runs of 64 codes are packed by a vector shuffle, the rest group by group; signed zeros
    and negative values that round to code 0 keep the sign bit clear."""
    x = gaussian(n, seed=levels)
    x[:2] = torch.tensor([-0.0, -1e-30])[:n]
    payloads = {}
    for kernels in (True, False):
        monkeypatch.setattr(stochastic, "KERNELS", kernels)
        payloads[kernels], _ = bound(StandardDithering(levels=levels)).compress(x, "t")
    assert all(torch.equal(a, b) for a, b in zip(payloads[True], payloads[False]))
