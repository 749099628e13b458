"""The receiving side of non-summable quantizers: `aggregate`, which the kernels decode into
one sum a block at a time, gives the same bits as decompressing every payload and adding them
in rank order, with the kernels and with the torch paths, on payloads parsed as views of a
receive buffer at any offset, and refuses reserved codes in any rank's payload."""

import pytest
import torch

import gracecomm.compressors.shared.stochastic as stochastic
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import PayloadError
from gracecomm.wire import from_bytes, to_bytes
from tests.quantizer_checks import bound, gaussian

QUANTIZERS = {
    "natural": {},
    "natural_dithering": {},
    "standard_dithering": {},
    "qsgd": {},
    "terngrad": {},
    "efsignsgd": {},
    "onebit": {},
    "standard_dithering_buckets": {"bucket": 1000},
}
RANKS = 3


def make(name):
    options = dict(QUANTIZERS[name])
    return bound(COMPRESSORS.get(name.removesuffix("_buckets"))(**options))


def payloads_of(name, x):
    """One payload per rank (independent draws), each parsed from a receive buffer one byte
    past an aligned start, as a communicator hands them over."""
    out, ctx = [], None
    for rank in range(RANKS):
        compressor = make(name)
        payload, ctx = compressor.compress(x * (rank + 1), "t")
        buf = torch.cat([torch.zeros(1, dtype=torch.uint8), to_bytes(payload)])[1:]
        out.append(from_bytes(buf, [t.numel() for t in payload], payload))
    return out, ctx


def reference(compressor, payloads, ctx):
    total = compressor.decompress(payloads[0], ctx).clone()
    for payload in payloads[1:]:
        total = total + compressor.decompress(payload, ctx)
    return total / len(payloads)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_aggregate_is_the_mean_of_the_decompressions(name, kernels, monkeypatch):
    monkeypatch.setattr(stochastic, "KERNELS", kernels)
    # the kernels: over PARALLEL_MIN (split over threads); both: past one block, an odd tail
    x = gaussian(13 * (80663 if kernels else 5209)).view(-1, 13)
    compressor = make(name)
    payloads, ctx = payloads_of(name, x)
    assert torch.equal(compressor.aggregate(payloads, ctx), reference(compressor, payloads, ctx))


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_aggregate_keeps_a_float64_tensor_in_float64(name):
    compressor = make(name)
    payloads, ctx = payloads_of(name, gaussian(1000).double())
    total = compressor.aggregate(payloads, ctx)
    assert total.dtype == torch.float64
    assert torch.equal(total, reference(compressor, payloads, ctx))


@pytest.mark.parametrize("ranks", [4, 5])  # an even count has ties, which vote 0
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_majority_vote_counts_every_rank(kernels, ranks, monkeypatch):
    monkeypatch.setattr(stochastic, "KERNELS", kernels)
    compressor = bound(COMPRESSORS.get("signsgd")())
    grads = [gaussian(2**20 + 3, seed=s) for s in range(ranks)]
    payloads = [compressor.compress(g, "t")[0] for g in grads]
    _, ctx = compressor.compress(grads[0], "t")
    votes = sum(torch.where(torch.signbit(g), -1.0, 1.0) for g in grads)
    assert torch.equal(compressor.aggregate(payloads, ctx), torch.sign(votes))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_reserved_codes_are_refused_when_adding(kernels, monkeypatch):
    monkeypatch.setattr(stochastic, "KERNELS", kernels)
    natural, dithering = make("natural"), make("natural_dithering")
    x = gaussian(64)
    good, ctx = natural.compress(x, "t")
    bad = (torch.full_like(good[0], 255), good[1])
    with pytest.raises(PayloadError, match="reserved exponent code 255"):
        natural.aggregate([good, bad], ctx)
    (norms, signs, codes), ctx = dithering.compress(x, "t")
    with pytest.raises(PayloadError, match="codes above"):
        dithering.aggregate([(norms, signs, codes), (norms, signs, torch.full_like(codes, 255))],
                            ctx)


@pytest.mark.parametrize("levels", [1, 3, 7, 15, 31, 63, 127, 255])  # level codes of 1..8 bits
@pytest.mark.parametrize("n", [1, 63, 64, 65, 511, 4096 + 77])
def test_every_code_width_decodes_as_torch_does(levels, n, monkeypatch):
    """Runs of 8 packed groups are spread by a vector shuffle, the rest group by group."""
    compressor = bound(COMPRESSORS.get("standard_dithering")(levels=levels))
    payload, ctx = compressor.compress(gaussian(n), "t")
    decoded = {}
    for kernels in (True, False):
        monkeypatch.setattr(stochastic, "KERNELS", kernels)
        decoded[kernels] = compressor.decompress(payload, ctx)
    assert torch.equal(decoded[True], decoded[False])
