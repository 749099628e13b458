"""The benchmark suites that hold the library against outside references: the GRACE
framework's own code (``grace_reference``, against a stand-in checkout here: GRACE is not
part of this repository) and the natural-compression paper's second-moment bounds
(``variance``)."""

import math
import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from gracecomm.experiments.bench.grace_reference import grace_factory, run
from gracecomm.experiments.bench.variance import omega_bound
from gracecomm.experiments.bench.variance import run as variance

# a stand-in for GRACE's grace_dl/dist/helper.py: Top-k written as GRACE writes it, and a
# natural compression that needs cupy, as GRACE's does
HELPER = '''
import torch


class TopK:
    def __init__(self, ratio):
        self.ratio = ratio

    def compress(self, tensor, name):
        k = max(1, int(tensor.numel() * self.ratio))
        _, indices = torch.topk(tensor.abs(), k, sorted=False)
        return (tensor[indices], indices.int()), tensor.size()

    def decompress(self, tensors, shape):
        values, indices = tensors
        out = torch.zeros(shape.numel(), dtype=values.dtype)
        out.scatter_(0, indices.long(), values)
        return out.view(shape)


class Natural:
    def compress(self, tensor, name):
        import cupy  # noqa: F401

    def decompress(self, tensors, ctx):
        pass


class Communicator:
    def __init__(self, compressor):
        self.compressor = compressor


def grace_from_params(params):
    assert params["memory"] == "none" and params["world_size"] == 1
    if params["compressor"] == "topk":
        return Communicator(TopK(params["compress_ratio"]))
    return Communicator(Natural())
'''


def checkout(tmp_path):
    package = tmp_path / "grace_dl" / "dist"
    package.mkdir(parents=True)
    for init in (tmp_path / "grace_dl", package):
        (init / "__init__.py").write_text("")
    (package / "helper.py").write_text(textwrap.dedent(HELPER))
    return tmp_path


def test_grace_reference_is_skipped_with_a_reason_without_a_checkout(tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.delenv("GRACE_PATH", raising=False)
    assert run(OmegaConf.create({"seed": 0})) == []
    assert "grace_reference: skipped, no GRACE checkout given" in capsys.readouterr().out
    build, why = grace_factory(str(tmp_path))
    assert build is None and "is not a GRACE checkout" in why


@pytest.fixture
def isolated_imports(monkeypatch):
    """The suite puts the checkout on sys.path and imports grace_dl from it: undo both."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "grace_dl"]:
        del sys.modules[name]


def test_grace_reference_times_both_on_the_same_tensor(tmp_path, isolated_imports):
    cfg = OmegaConf.create({"seed": 0, "grace_reference": {
        "path": str(checkout(tmp_path)), "methods": ["topk", "natural", "powersgd"],
        "ratios": [0.01], "numel": 20_000, "rounds": 2}})
    records = {r["method"]: r for r in run(cfg)}
    topk = records["topk 0.01"]
    assert topk["bits_per_element"] == topk["grace_bits_per_element"] == 64 * 200 / 20_000
    assert topk["x_faster_than_grace"] == pytest.approx(topk["grace_total_s"] / topk["total_s"])
    assert min(topk["read_s"], topk["total_s"], topk["grace_total_s"]) > 0
    assert "needs cupy" in records["natural"]["skipped"]
    assert "process group" in records["powersgd"]["skipped"]


def test_variance_bounds_and_measurements():
    d = 10**5
    assert omega_bound("natural", 0, None, d) == 9 / 8
    assert omega_bound("standard_dithering", 8, 2, d) == pytest.approx(1 + math.sqrt(d) / 8)
    assert omega_bound("natural_dithering", 8, 2, d) == pytest.approx(
        9 / 8 + math.sqrt(d) / 128 * min(1, math.sqrt(d) / 128))
    records = variance(OmegaConf.create({"seed": 0, "variance": {"numel": 20_000, "draws": 8}}))
    by = {(r["method"], r["data"]): r for r in records}
    worst = by["natural", "(4/3) 2^k"]
    assert worst["second_moment"] == pytest.approx(9 / 8, abs=0.005)  # Theorem 1 is tight
    assert by["natural", "gaussian"]["second_moment"] == pytest.approx(1.0818, abs=0.005)
    for rec in records:  # unbiased: the variance is the second moment less one
        assert rec["variance"] == pytest.approx(rec["second_moment"] - 1, rel=0.02, abs=0.01), rec
        assert rec["within_bound"], rec
