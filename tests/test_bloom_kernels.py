"""The numba kernels of the Bloom index codec give the payloads and selections of the torch
code (same filter bytes, positives, P0/P1/P2 choices), and keep nothing per tensor."""

from __future__ import annotations

import warnings

import pytest
import torch

from gracecomm.compressors.deepreduce import BloomIndex, CodecCtx, DeepReduce
from gracecomm.compressors.deepreduce.policies import POLICIES
from gracecomm.compressors.topk import TopK
from gracecomm.validation import numba_available

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba not installed")


def codec(kernel: str, **options) -> BloomIndex:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # policy naive warns
        return BloomIndex(kernel=kernel, **options)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["round_robin", "cover"])
def test_kernels_send_and_decode_what_the_torch_code_does(policy, mode):
    for d, r, fpr, seed in ((1, 1, 0.001, 0), (97, 5, 0.3, 1), (5_000, 60, 0.05, 2),
                            (70_001, 700, 0.01, 3), (20_000, 19_990, 0.6, 4)):
        gen = torch.Generator().manual_seed(seed)
        flat = torch.randn(d, generator=gen)
        indices = torch.randperm(d, generator=gen)[:r].sort().values
        ctx = CodecCtx(d, "w", seed, 7 + seed, torch.device("cpu"))
        fast = codec("numba", fpr=fpr, policy=policy, p2_mode=mode)
        slow = codec("python", fpr=fpr, policy=policy, p2_mode=mode)
        a, b = fast.select(indices, flat, ctx), slow.select(indices, flat, ctx)
        assert torch.equal(a.section, b.section)  # identical payload bytes
        assert torch.equal(a.values_at, b.values_at) and torch.equal(a.values, b.values)
        assert a.stats == b.stats
        n = a.values_at.numel()
        assert torch.equal(fast.decode(a.section, n, ctx), slow.decode(b.section, n, ctx))
        assert torch.equal(fast.encode(indices, ctx), slow.encode(indices, ctx))


def test_no_state_grows_with_the_tensors():
    c = codec("numba", policy="p2")
    for i in range(5):
        d = 10_000 + i
        c.select(torch.arange(0, d, 50), torch.randn(d), CodecCtx(d, f"t{i}", i, i, "cpu"))
    assert c.backend.tables == {}  # no position table is cached per tensor by default


def test_deepreduce_round_trip_on_the_kernels():
    d = 300_000
    t = torch.randn(d, generator=torch.Generator().manual_seed(0))
    for policy in ("p0", "p2"):
        sender = DeepReduce(TopK(0.01), {"name": "bloom", "policy": policy}, "raw", seed=3)
        receiver = DeepReduce(TopK(0.01), {"name": "bloom", "policy": policy}, "raw", seed=3)
        (container,), ctx = sender.compress(t, "w")
        _, rctx = receiver.compress(t, "w")  # the receiver's own ctx of the same call
        out = receiver.decompress((container,), rctx)
        kept = out.nonzero().view(-1)
        assert torch.equal(out[kept], t[kept])  # values land where the sender chose them
        assert kept.numel() >= 0.98 * (d // 100)
