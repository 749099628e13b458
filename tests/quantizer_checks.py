"""Helpers shared by the quantiser tests (natural, dithering, sign methods, composition)."""

import torch

import gracecomm.compressors.shared.stochastic as stochastic
from gracecomm.compressors.shared.quantizer_kernels import PARALLEL_MIN
from gracecomm.metrics import Metrics


def gaussian(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def bound(compressor):
    """`compressor` bound to a fresh `Metrics` and no communicator (a world of one rank)."""
    compressor.bind(None, Metrics())
    return compressor


def roundtrip(compressor, x, name="t"):
    payload, ctx = compressor.compress(x, name)
    return compressor.decompress(payload, ctx)


def assert_kernels_match_torch(make, monkeypatch, seed=0):
    """The numba kernels and the torch code paths (GRACECOMM_KERNELS=0) produce the same
    payload and decode it to the same bits: a tensor large enough to be split over threads,
    with an odd tail and signed zeros."""
    x = gaussian(PARALLEL_MIN + 5, seed=seed)
    x[:2] = torch.tensor([0.0, -0.0])
    payload, ctx = bound(make()).compress(x, "t")
    fast = bound(make()).decompress(payload, ctx)
    monkeypatch.setattr(stochastic, "KERNELS", False)
    slow_payload, _ = bound(make()).compress(x, "t")
    assert all(torch.equal(a, b) for a, b in zip(payload, slow_payload))
    assert torch.equal(bound(make()).decompress(slow_payload, ctx), fast)
