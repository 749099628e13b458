"""Sign methods: signSGD, Signum, EF-signSGD (with its memory) and 1-bit SGD."""

import math

import pytest
import torch

import gracecomm
from gracecomm.compressors.sign import EFSignSGD, OneBit, SignSGD, Signum
from gracecomm.memories.efsignsgd import EFSignSGDMemory
from gracecomm.validation import ConfigError, IncompatibleError, PayloadError
from tests.helpers import compose_train
from tests.quantizer_checks import assert_kernels_match_torch, bound, gaussian, roundtrip


@pytest.mark.parametrize("make,scales", [(SignSGD, 0), (lambda: Signum(0.5), 0),
                                         (EFSignSGD, 1), (OneBit, 2)])
@pytest.mark.parametrize("n", [1, 8, 1003])
def test_one_bit_per_element_plus_scales(make, scales, n):
    payload, _ = bound(make()).compress(gaussian(n), "t")
    assert sum(t.numel() * t.element_size() for t in payload) == math.ceil(n / 8) + 4 * scales


def test_decoded_values():
    x = torch.tensor([1.5, -2.0, 0.0, -0.0, 3.0, -1.0])
    sign = bound(SignSGD())
    assert roundtrip(sign, x).tolist() == [1, -1, 1, -1, 1, -1]  # sign bit: -0.0 counts as negative
    ef = roundtrip(bound(EFSignSGD()), x)
    assert torch.allclose(ef, torch.tensor([1.25, -1.25, 1.25, -1.25, 1.25, -1.25]))
    one = roundtrip(bound(OneBit()), x)
    assert torch.allclose(one, torch.tensor([1.5, -1.0, 1.5, -1.0, 1.5, -1.0]))


def test_majority_vote():
    c = bound(SignSGD())
    votes = [torch.tensor([1.0, 1.0, -1.0, 2.0]), torch.tensor([1.0, -1.0, -1.0, -2.0]),
             torch.tensor([-1.0, -1.0, -1.0, 5.0])]
    payloads = [c.compress(v, "t") for v in votes]
    assert c.aggregate([p for p, _ in payloads], payloads[0][1]).tolist() == [1, -1, -1, 1]
    assert c.aggregate([p for p, _ in payloads[:2]], payloads[0][1]).tolist() == [1, 0, -1, 0]


def test_signum_keeps_a_momentum_per_tensor(tmp_path):
    c = bound(Signum(momentum=0.5))
    c.compress(torch.tensor([1.0, -1.0]), "a")
    c.compress(torch.tensor([-4.0, -1.0]), "a")  # m = 0.5 * m + 0.5 * g = [-1.5, -1]
    assert torch.equal(c.momentums["a"], torch.tensor([-1.5, -1.0]))
    torch.save(c.state_dict(), tmp_path / "s.pt")
    resumed = Signum(momentum=0.5)
    resumed.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert torch.equal(resumed.momentums["a"], c.momentums["a"])


def test_efsignsgd_memory_and_aggregate_follow_the_paper():
    lr = 0.1
    g = gracecomm.build("efsignsgd", {"name": "efsignsgd", "lr": lr})
    assert g.compressor.lr == lr  # handed over by the memory
    grad = torch.tensor([0.5, -1.0, 2.0, -0.3])
    out = g.step(grad, "w")
    p = lr * grad  # first step: e = 0
    delta = p.abs().mean() * torch.sign(p)
    assert torch.allclose(out, delta / lr)  # the optimiser's step lr * out is the paper's delta
    assert torch.allclose(g.memory.residuals["w"], p - delta)
    out2 = g.step(grad, "w")
    p2 = lr * grad + (p - delta)
    assert torch.allclose(out2, p2.abs().mean() * torch.sign(p2) / lr)
    plain = gracecomm.build("efsignsgd", "residual")  # error feedback in gradient units
    assert plain.compressor.lr == 1.0
    assert torch.allclose(plain.step(grad, "w"), grad.abs().mean() * torch.sign(grad))


def test_efsignsgd_memory_needs_its_compressor():
    with pytest.raises(IncompatibleError, match="efsignsgd"):
        gracecomm.build("signsgd", EFSignSGDMemory(lr=0.2))
    cfg = compose_train("compressor=efsignsgd", "trainer.lr=0.01")
    assert cfg.memory.lr == 0.01 and "lr" not in cfg.compressor


@pytest.mark.parametrize("make", [SignSGD, EFSignSGD, OneBit])
def test_torch_code_paths_give_the_same_bits(make, monkeypatch):
    assert_kernels_match_torch(make, monkeypatch, seed=1)


def test_inputs_of_other_dtypes_and_shapes():
    for x in (torch.empty(0), torch.tensor(-2.0), gaussian(12).view(3, 4).half(),
              gaussian(5).double()):
        for make in (SignSGD, OneBit):
            out = roundtrip(bound(make()), x)
            assert out.shape == x.shape and out.dtype == x.dtype


def test_malformed_payloads_raise():
    c = bound(OneBit())
    payload, ctx = c.compress(gaussian(20), "t")
    with pytest.raises(PayloadError, match="elements"):
        c.decompress((payload[0][:-1], payload[1]), ctx)
    with pytest.raises(PayloadError, match="tensors"):
        c.decompress(payload[:1], ctx)
    with pytest.raises(PayloadError, match="dtype"):
        c.decompress((payload[0], payload[1].double()), ctx)


def test_bad_options():
    with pytest.raises(ConfigError, match="option 'momentum'"):
        Signum(momentum=1.0)
    with pytest.raises(ConfigError, match="option 'lr'"):
        EFSignSGDMemory(lr=0)
