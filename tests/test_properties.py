"""Property-based tests (hypothesis) over every registered compressor: hostile tensors give a
correct result or a clear error; malformed peer payloads raise instead of scattering out of
bounds or decoding garbage."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gracecomm import registry
from gracecomm.config import instantiate
from gracecomm.metrics import Metrics
from gracecomm.validation import NonFiniteError
from tests.helpers import compose_train

NAMES = registry.available("compressor")
SIZES = [0, 1, 2, 3, 7, 13, 64, 97, 1000, 4099]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
UNSCALED = {"signsgd", "signum"}  # send sign(x): outputs +-1 whatever the magnitude
# Natural compression (Horvath et al., the 9-bit format) flushes a float32 denormal to 0 or
# +-2^-126 without bias (docs/quantizers.md), so any element's error may reach 2^-126
FLUSH = torch.finfo(torch.float32).smallest_normal
CLEAR_ERRORS = (ValueError, TypeError, FloatingPointError, NotImplementedError)


@functools.cache
def yaml_config(name: str):
    return compose_train(f"compressor={name}").compressor


def make(name: str):
    """A fresh compressor as its YAML configures it, bound to a local metrics object."""
    comp = instantiate(yaml_config(name))
    comp.bind(None, Metrics())
    return comp


def values(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=gen, dtype=torch.float64)
    finfo = torch.finfo(dtype)
    if kind == "zeros":
        t = torch.zeros(n, dtype=torch.float64)
    elif kind == "constant":
        t = torch.full((n,), 0.5, dtype=torch.float64)
    elif kind == "denormal":
        t = base * finfo.smallest_normal / 8
    elif kind == "tiny":
        t = base * finfo.smallest_normal * 4
    elif kind == "huge":
        t = base.clamp(-1, 1) * finfo.max / 4
    elif kind == "mixed":
        t = base * torch.logspace(-20, 20, n, dtype=torch.float64).clamp(max=finfo.max / 8)
    else:
        t = base
    return t.to(dtype)


tensors = st.tuples(st.sampled_from(SIZES), st.sampled_from(DTYPES),
                    st.sampled_from(["normal", "zeros", "constant", "denormal", "tiny", "huge",
                                     "mixed"]),
                    st.integers(0, 2**16))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=tensors)
@example(spec=(1, torch.float32, "denormal", 580))  # Top-k + natural rounds it up to 2^-126
def test_hostile_finite_tensors(name, spec):
    n, dtype, kind, seed = spec
    comp = make(name)
    t = values(kind, n, dtype, seed)
    try:
        payload, ctx = comp.compress(t, "t")
    except CLEAR_ERRORS as err:
        assert str(err), f"{name}: empty error message"
        return
    out = comp.decompress(payload, ctx)
    assert out.shape == t.shape and out.dtype == t.dtype, name
    assert torch.isfinite(out).all(), f"{name} turned finite {kind} input into non-finite output"
    t64, o64 = t.double(), out.double()
    bound = (1 + n) * (float(t64.abs().max()) if n else 0.0) * math.sqrt(max(n, 1))
    bound += (1.0 if name in UNSCALED else 0.0) + FLUSH
    assert float((o64 - t64).abs().max() if n else 0.0) <= bound + 1e-300, name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises_or_propagates(name, bad):
    comp = make(name)
    t = torch.randn(257)
    t[100] = bad
    try:
        payload, ctx = comp.compress(t, "grad.w")
        out = comp.decompress(payload, ctx)
    except CLEAR_ERRORS + (NonFiniteError,) as err:
        assert str(err)
        return
    assert out.shape == t.shape and out.dtype == t.dtype


def corrupt(payload, how: str):
    """Malformed versions of a payload, one tensor at a time."""
    for i, p in enumerate(payload):
        bad = list(payload)
        if how == "truncate" and p.numel():
            bad[i] = p.reshape(-1)[:-1]
        elif how == "extend":
            bad[i] = torch.cat([p.reshape(-1), p.reshape(-1)[:1] if p.numel() else
                                torch.zeros(1, dtype=p.dtype)])
        elif how == "dtype":
            bad[i] = p.to(torch.float64 if p.dtype != torch.float64 else torch.float32)
        elif how == "range" and not p.is_floating_point() and p.numel():
            bad[i] = torch.full_like(p, torch.iinfo(p.dtype).max if p.dtype != torch.uint8 else 255)
        else:
            continue
        yield i, tuple(bad)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["truncate", "extend", "dtype", "range"])
def test_malformed_peer_payload_raises(name, how):
    comp = make(name)
    t = torch.randn(4, 250)
    payload, ctx = comp.compress(t, "w")
    for i, bad in corrupt(payload, how):
        try:
            out = comp.aggregate([payload, bad], ctx)
        except CLEAR_ERRORS as err:
            assert str(err)
            continue
        # a change that still decodes must at least decode to a finite tensor of the right shape
        assert out.shape == t.shape and out.dtype == t.dtype, (name, how, i)
        assert how == "range" or how == "dtype" and bad[i].is_floating_point(), (
            f"{name}: {how} payload tensor {i} was accepted silently")


# -- DeepReduce codecs ----------------------------------------------------------------------

INDEX_CODECS = registry.available("index_codec")
VALUE_CODECS = registry.available("value_codec")


def codec_ctx(d: int):
    from gracecomm.compressors.deepreduce.codec import CodecCtx
    return CodecCtx(d=d, name="w", tensor_seed=11, step_seed=12, device=torch.device("cpu"))


index_sets = st.tuples(st.sampled_from([1, 2, 7, 64, 1000, 4099]),
                       st.sampled_from(["random", "run", "ends", "empty", "full", "strided"]),
                       st.floats(0.0, 1.0), st.integers(0, 2**16))


def index_set(d: int, kind: str, density: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "empty":
        return torch.empty(0, dtype=torch.int64)
    if kind == "full":
        return torch.arange(d)
    if kind == "ends":
        return torch.tensor(sorted({0, d - 1}))
    if kind == "run":
        start = int(torch.randint(0, d, (1,), generator=gen))
        return torch.arange(start, min(d, start + max(1, int(density * d))))
    if kind == "strided":
        return torch.arange(0, d, max(1, int(1 / max(density, 1e-3))))
    r = max(1, int(density * d))
    return torch.randperm(d, generator=gen)[:r].sort().values


@pytest.mark.parametrize("name", INDEX_CODECS)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=index_sets)
def test_index_codecs_round_trip(name, spec):
    d, kind, density, seed = spec
    codec = registry.create("index_codec", name)
    indices = index_set(d, kind, density, seed)
    ctx = codec_ctx(d)
    flat = torch.randn(d, generator=torch.Generator().manual_seed(seed))
    sel = codec.select(indices, flat, ctx)  # what the sender sends values for
    section = sel.section if sel.section is not None else codec.encode(sel.values_at, ctx)
    assert section.dtype == torch.uint8
    decoded = codec.decode(section, sel.values_at.numel(), ctx)
    assert decoded.dtype == torch.int64
    got = decoded if not codec.any_order else decoded.sort().values
    want = sel.values_at if not codec.any_order else sel.values_at.sort().values
    assert torch.equal(got, want), name  # the receiver rebuilds the sender's selection
    if name != "bloom":
        assert torch.equal(want, indices)  # lossless
    elif codec.sends_all_positives:
        assert bool(torch.isin(indices, decoded).all())  # P0: no false negatives


@pytest.mark.parametrize("name", INDEX_CODECS)
@pytest.mark.parametrize("how", ["truncate", "extend", "garbage"])
def test_malformed_index_sections_raise_or_stay_in_range(name, how):
    d = 1000
    codec = registry.create("index_codec", name)
    indices = index_set(d, "random", 0.05, 3)
    section = codec.encode(indices, codec_ctx(d))
    gen = torch.Generator().manual_seed(5)
    if how == "truncate":
        bad = section[:-1]
    elif how == "extend":
        bad = torch.cat([section, section[:1]])
    else:
        bad = torch.randint(0, 256, section.shape, generator=gen, dtype=torch.uint8)
    try:
        decoded = codec.decode(bad, indices.numel(), codec_ctx(d))
    except CLEAR_ERRORS as err:
        assert str(err)
        return
    assert how == "garbage", f"{name}: a {how} section was accepted"
    assert decoded.numel() == 0 or (int(decoded.min()) >= 0 and int(decoded.max()) < d)


value_arrays = st.tuples(st.sampled_from([0, 1, 2, 7, 64, 513, 2000]),
                         st.sampled_from(["normal", "zeros", "constant", "tiny", "mixed",
                                          "sorted"]), st.integers(0, 2**16))


@pytest.mark.parametrize("name", VALUE_CODECS)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=value_arrays)
def test_value_codecs_decode_finite_values_of_bounded_error(name, spec):
    n, kind, seed = spec
    codec = registry.create("value_codec", name)
    base = kind if kind != "sorted" else "normal"
    values = values_of(base, n, seed)
    if kind == "sorted":
        values = values.sort(descending=True).values
    section, order = codec.encode(values, codec_ctx(max(n, 1)))
    decoded = codec.decode(section, n, codec_ctx(max(n, 1)))
    assert decoded.shape == (n,) and decoded.dtype == torch.float32
    assert torch.isfinite(decoded).all(), name
    if n and order is not None:
        values = values[order]
    if n:
        scale = float(values.abs().max())
        assert float((decoded - values).abs().max()) <= 2 * scale + 1e-30, name
    if name in ("raw", "deflate"):
        assert torch.equal(decoded, values)


def values_of(kind: str, n: int, seed: int) -> torch.Tensor:
    return values(kind, n, torch.float32, seed)


@pytest.mark.parametrize("name", VALUE_CODECS)
@pytest.mark.parametrize("how", ["truncate", "extend"])
def test_malformed_value_sections_raise(name, how):
    codec = registry.create("value_codec", name)
    vals = values_of("normal", 600, 1)
    section, _ = codec.encode(vals, codec_ctx(600))
    bad = section[:-1] if how == "truncate" else torch.cat([section, section[:1]])
    with pytest.raises(CLEAR_ERRORS):
        codec.decode(bad, 600, codec_ctx(600))
