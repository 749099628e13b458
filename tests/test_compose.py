"""Composition of compressors (spec natural.md, Sec. 7 and Sec. 10 item 9)."""

import math

import pytest
import torch

import gracecomm
from gracecomm.compressors.cast import FP16
from gracecomm.compressors.compose import Compose
from gracecomm.compressors.dithering import NaturalDithering
from gracecomm.compressors.natural import Natural
from gracecomm.compressors.randomk import RandomK
from gracecomm.compressors.topk import TopK
from gracecomm.config import instantiate
from gracecomm.metrics import Metrics
from gracecomm.validation import ConfigError, PayloadError
from tests.helpers import compose_train


def gaussian(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def nbytes(payload):
    return sum(t.numel() * t.element_size() for t in payload)


def test_topk_then_natural_sends_nine_bits_per_value_plus_indices():
    c = Compose([TopK(0.1), Natural()])
    c.bind(None, Metrics())
    x = gaussian(1000)
    payload, ctx = c.compress(x, "t")
    k = 100
    assert nbytes(payload) == k + math.ceil(k / 8) + 4 * k
    out = c.decompress(payload, ctx)
    kept = torch.topk(x.abs(), k).indices
    assert torch.equal(out != 0, torch.zeros(1000, dtype=torch.bool).index_fill_(0, kept, True))
    exp = torch.log2(out[kept].abs())
    assert torch.equal(exp, exp.round())  # the kept values are powers of two


def test_randomk_then_natural_sends_only_values_and_is_in_b_of_9d_over_8k():
    d, k = 1000, 100
    c = Compose([RandomK(k / d, scale="unbiased"), Natural()])
    c.bind(None, Metrics())
    x = gaussian(d, seed=1)
    draws = []
    for _ in range(400):
        payload, ctx = c.compress(x, "t")
        draws.append(c.decompress(payload, ctx).double())
    assert nbytes(payload) == k + math.ceil(k / 8)
    draws = torch.stack(draws)
    second = float(draws.pow(2).sum(1).mean())
    assert second <= 9 / 8 * d / k * float(x.double().pow(2).sum()) * 1.05
    err = draws.mean(0) - x.double()
    assert float(err.norm() / x.norm()) < 5 * math.sqrt((9 / 8 * d / k) / 400)


def test_capabilities_follow_the_stages():
    assert Compose([RandomK(0.1), FP16()]).capabilities().summable
    summable = gracecomm.build(Compose([RandomK(0.1), FP16()]))
    assert summable.communicator.registry_name == "allreduce"
    assert summable.memory.registry_name == "residual"
    dithered = gracecomm.build(Compose([RandomK(0.1), NaturalDithering()]))
    assert dithered.communicator.registry_name == "allgather"
    with pytest.raises(Exception, match="not summable"):
        gracecomm.build(Compose([TopK(0.1), Natural()]), communicator="allreduce")


def test_yaml_lists_the_stages():
    cfg = compose_train("compressor=compose")
    c = instantiate(cfg.compressor)
    assert [type(s) for s in c.stages] == [TopK, Natural]
    assert c.label == "compressor 'compose(topk, natural)'"
    cfg = compose_train("compressor=compose", "compressor.compressors.0.ratio=0.2")
    assert instantiate(cfg.compressor).stages[0].ratio == 0.2


def test_aggregate_is_the_mean_of_the_decoded_payloads():
    c = Compose([TopK(0.2), Natural()])
    c.bind(None, Metrics())
    items = [c.compress(gaussian(50, seed=s), "t") for s in range(3)]
    mean = c.aggregate([p for p, _ in items], items[0][1])
    want = sum(c.decompress(p, ctx) for p, ctx in items) / 3
    assert torch.allclose(mean, want)


def test_bad_compositions_and_payloads():
    with pytest.raises(ConfigError, match="at least two"):
        Compose([TopK(0.1)])
    with pytest.raises(ConfigError, match=r"compressors\[1\] must be a per-tensor"):
        Compose([TopK(0.1), "lgc_rar"])
    with pytest.raises(ConfigError, match="a name, a mapping or a Compressor"):
        Compose([TopK(0.1), 42])
    c = Compose([Natural(), TopK(0.1)])
    with pytest.raises(TypeError, match="floating-point"):
        c.compress(gaussian(10), "t")
    c = Compose([TopK(0.1), Natural()])
    c.bind(None, Metrics())
    payload, ctx = c.compress(gaussian(100), "t")
    with pytest.raises(PayloadError):
        c.decompress(payload + payload[-1:], ctx)
    with pytest.raises(PayloadError):
        c.decompress((payload[0][:-1], *payload[1:]), ctx)
