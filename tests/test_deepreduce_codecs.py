"""DeepReduce index and value codecs on their own (spec Sec. 9, checks 1, 8-11)."""

import math

import pytest
import torch

from gracecomm import registry
from gracecomm.compressor import Compressor, TensorInfo
from gracecomm.compressors.deepreduce import INDEX_CODECS, VALUE_CODECS, CodecCtx
from gracecomm.compressors.deepreduce.container import pack_mapping, unpack_mapping
from gracecomm.compressors.deepreduce.fitting import auto_segments, canonical_order, segment
from gracecomm.compressors.deepreduce.index import HuffmanIndex, huffman_code, rle_runs
from gracecomm.validation import ConfigError, PayloadError
from gracecomm.wire import pack_uint

LOSSLESS = [("raw32", {}), ("packed", {}), ("bitmap", {}), ("rle", {}),
            ("rle", {"mode": "alternate"}), ("huffman", {}), ("delta_varint", {}),
            ("deflate", {}), ("deflate", {"source": "bitmap"})]


def ctx(d, name="w", step=1):
    return CodecCtx(d, name, 11, step, torch.device("cpu"))


def index_sets(d):
    gen = torch.Generator().manual_seed(d)
    yield "random", torch.randperm(d, generator=gen)[: max(1, d // 50)].sort().values
    yield "dense random", torch.randperm(d, generator=gen)[: d // 2].sort().values
    yield "contiguous", torch.arange(d // 3, d // 3 + d // 4)
    yield "ends", torch.unique(torch.tensor([0, d - 1]))
    yield "first", torch.tensor([0])
    yield "last", torch.tensor([d - 1])
    yield "empty", torch.empty(0, dtype=torch.int64)
    yield "all", torch.arange(d)
    yield "strided", torch.arange(1, d, 7)


@pytest.mark.parametrize("name,options", LOSSLESS, ids=lambda x: str(x))
@pytest.mark.parametrize("d", [1, 2, 13, 300, 20_011])
def test_lossless_index_codecs_round_trip(name, options, d):
    codec = INDEX_CODECS.create(name, **options)
    for label, indices in index_sets(d):
        if indices.numel() and int(indices.max()) >= d:
            continue
        section = codec.encode(indices, ctx(d))
        assert section.dtype == torch.uint8 and section.dim() == 1
        out = codec.decode(section, indices.numel(), ctx(d))
        assert torch.equal(out, indices), (name, options, d, label)


def test_raw32_and_packed_keep_any_order():
    indices = torch.tensor([9, 2, 77, 0, 5])
    for name in ("raw32", "packed"):
        codec = INDEX_CODECS.create(name)
        assert torch.equal(codec.decode(codec.encode(indices, ctx(100)), 5, ctx(100)), indices)
    assert INDEX_CODECS.create("packed").encode(indices, ctx(100)).numel() == math.ceil(5 * 7 / 8)


def test_thesis_rle_fixtures():
    """Thesis Sec. 2.3.1: 0110010100011 -> runs 1,2,2,1,1,1,3,2 in 2-bit fields (16 bits);
    six zeros then seven ones -> 6, 7 in 3-bit fields (6 bits)."""
    bits_a = [0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1]
    a = torch.tensor([i for i, b in enumerate(bits_a) if b])
    runs = rle_runs(a, "alternate")
    assert runs.tolist() == [1, 2, 2, 1, 1, 1, 3, 2]
    codec = INDEX_CODECS.create("rle", mode="alternate")
    section = codec.encode(a, ctx(13))
    assert section.numel() == 5 + 2  # u8 width + u32 count + 16 bits
    assert section[0] == 2
    b = torch.arange(6, 13)
    assert rle_runs(b, "alternate").tolist() == [6, 7]
    section = codec.encode(b, ctx(13))
    assert section[0] == 3 and section.numel() == 5 + 1  # 6 bits
    assert torch.equal(codec.decode(section, 7, ctx(13)), b)
    # zeros mode: zeros before each set bit
    assert rle_runs(a, "zeros").tolist() == [1, 0, 2, 1, 3, 0]


def test_rle_zeros_costs_about_ten_bits_per_index_at_one_percent():
    gen = torch.Generator().manual_seed(0)
    d = 36_864
    indices = torch.randperm(d, generator=gen)[:368].sort().values
    bits = 8 * (INDEX_CODECS.create("rle").encode(indices, ctx(d)).numel() - 5) / 368
    assert 8.5 <= bits <= 11


def test_huffman_code_is_canonical_and_complete():
    for d in (1, 2, 255, 257, 36_864, 2_621_440):
        lengths, codes = huffman_code(d)
        used = lengths.nonzero().view(-1)
        kraft = sum(2.0 ** -int(lengths[v]) for v in used)
        assert kraft == pytest.approx(1.0) or len(used) == 1
        ordered = sorted(used.tolist(), key=lambda v: (int(lengths[v]), v))
        left = [int(codes[v]) << (40 - int(lengths[v])) for v in ordered]
        assert left == sorted(left) and len(set(left)) == len(left)
    lengths, _ = huffman_code(2_621_440)
    assert lengths[0] < lengths[200]  # byte 0 is by far the most frequent


def test_huffman_shrinks_indices_and_rejects_garbage():
    d = 36_864
    indices = torch.randperm(d, generator=torch.Generator().manual_seed(1))[:368].sort().values
    codec = HuffmanIndex()
    section = codec.encode(indices, ctx(d))
    assert section.numel() < 4 * 368 * 0.7
    with pytest.raises(PayloadError):
        codec.decode(section[:-3], 368, ctx(d))
    with pytest.raises(PayloadError):
        codec.decode(section, 400, ctx(d))


@pytest.mark.parametrize("name,options", LOSSLESS, ids=lambda x: str(x))
def test_index_codecs_refuse_bad_input(name, options):
    codec = INDEX_CODECS.create(name, **options)
    with pytest.raises(PayloadError, match=r"outside \[0, 10\)"):
        codec.encode(torch.tensor([1, 10]), ctx(10))
    if not codec.any_order:
        with pytest.raises(PayloadError, match="ascending"):
            codec.encode(torch.tensor([5, 2]), ctx(10))
    section = codec.encode(torch.tensor([1, 4, 8]), ctx(10))
    with pytest.raises(PayloadError):
        codec.decode(section[:-1], 3, ctx(10))


def test_delta_varint_and_deflate_sizes():
    d = 2**20
    indices = torch.tensor([0, 127, 128 + 127, 2**20 - 1])
    section = INDEX_CODECS.create("delta_varint").encode(indices, ctx(d))
    # 0 -> 1 byte, 127 -> 1 byte, 128 -> 2 bytes, 2**20-1-255 -> 3 bytes
    assert section.numel() == 1 + 1 + 2 + 3
    runs = torch.arange(1000, 1400)
    assert INDEX_CODECS.create("deflate").encode(runs, ctx(d)).numel() < 4 * 400
    assert INDEX_CODECS.create("deflate", source="bitmap").encode(runs, ctx(d)).numel() < 400


def test_unknown_options_are_refused():
    with pytest.raises(ConfigError, match="option 'mode' must be one of"):
        INDEX_CODECS.create("rle", mode="ones")
    with pytest.raises(ConfigError, match="option 'source'"):
        INDEX_CODECS.create("deflate", source="bloom")
    with pytest.raises(ConfigError, match="option 'levels'"):
        VALUE_CODECS.create("qsgd", levels=0)


# ---------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------

def laplace(n, seed=0):
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed)) - 0.5
    return -torch.sign(u) * torch.log1p(-2 * u.abs())


@pytest.mark.parametrize("name", ["raw", "deflate"])
def test_lossless_value_codecs_round_trip(name):
    codec = VALUE_CODECS.create(name)
    for n in (0, 1, 1000):
        v = laplace(n)
        section, order = codec.encode(v, ctx(10))
        assert order is None and torch.equal(codec.decode(section, n, ctx(10)), v)


def test_fp16_saturates_instead_of_overflowing():
    codec = VALUE_CODECS.create("fp16")
    v = torch.tensor([1e6, -1e6, 0.5, 70000.0, -3.0])
    section, _ = codec.encode(v, ctx(10))
    out = codec.decode(section, 5, ctx(10))
    assert section.numel() == 10 and torch.isfinite(out).all()
    assert out.tolist() == [65504.0, -65504.0, 0.5, 65504.0, -3.0]


def test_qsgd_is_unbiased_and_sized():
    codec = VALUE_CODECS.create("qsgd")
    v = laplace(1296, seed=3)
    total = torch.zeros_like(v)
    trials = 400
    for _ in range(trials):  # every call draws new rounding noise
        section, _ = codec.encode(v, ctx(10))
        assert section.numel() == 1296 + 4 * 3  # n + 4 ceil(n / 512)
        total += codec.decode(section, 1296, ctx(10))
    mean = total / trials
    # levels are 1/127 of a bucket norm (~1.4 * sqrt(512)) apart: the mean of 400
    # draws is within a few standard errors of v
    assert float((mean - v).abs().max()) < 0.05
    assert float((mean - v).abs().mean()) < 0.01
    assert abs(float((mean - v).mean())) < 0.002
    # the same seed, tensor and call give the same rounding (checkpoints resume exactly)
    a, b = VALUE_CODECS.create("qsgd", seed=4), VALUE_CODECS.create("qsgd", seed=4)
    assert torch.equal(a.encode(v, ctx(10))[0], b.encode(v, ctx(10))[0])
    with pytest.raises(PayloadError, match="need"):
        codec.decode(section[:-1], 1296, ctx(10))


def test_canonical_order():
    v = torch.tensor([0.5, -2.0, 0.0, 3.0, -0.1, 0.5])
    order, n_pos, n_zero, n_neg = canonical_order(v)
    assert torch.equal(v[order], torch.tensor([3.0, 0.5, 0.5, 0.0, -2.0, -0.1]))
    assert (n_pos, n_zero, n_neg) == (3, 1, 2)
    assert order.tolist()[1:3] == [0, 5]  # ties keep their order


def test_segmentation_splits_at_the_chord_extremum():
    y = torch.cat([torch.linspace(1.0, 0.5, 20), torch.linspace(0.49, 0.45, 60)]).double()
    assert segment(y, 2, 6) == [0, 20]  # the point farthest from the chord starts the right piece
    assert segment(y[:11], 4, 6) == [0]  # too short to split into two pieces of 6
    flat = torch.linspace(1.0, 0.0, 100).double()
    assert auto_segments(flat, 4) == 1  # a straight line needs one piece
    curved = torch.exp(-torch.linspace(0, 8, 200)).double()
    assert auto_segments(curved, 4) == 4


@pytest.mark.parametrize("name", ["polyfit", "dexp"])
def test_fitting_codecs_decode_in_canonical_order(name):
    codec = VALUE_CODECS.create(name)
    v = torch.cat([laplace(500, seed=5), torch.zeros(7)])
    section, order = codec.encode(v, ctx(10))
    out = codec.decode(section, v.numel(), ctx(10))
    target = v[order]
    assert torch.equal(out[target == 0], target[target == 0])
    assert bool((out * target >= 0).all())  # magnitudes are clamped at 0, signs restored
    err = float(torch.linalg.vector_norm(out - target) / torch.linalg.vector_norm(target))
    assert err < 0.1
    # short parts travel raw
    small = torch.tensor([0.3, -0.2, 0.1])
    section, order = codec.encode(small, ctx(10))
    assert torch.equal(codec.decode(section, 3, ctx(10)), small[order])


def test_fitting_refuses_inconsistent_sections():
    codec = VALUE_CODECS.create("polyfit")
    section, _ = codec.encode(laplace(300), ctx(10))
    with pytest.raises(PayloadError, match="do not add up"):
        codec.decode(section, 301, ctx(10))
    with pytest.raises(PayloadError):
        codec.decode(section[:-4], 300, ctx(10))
    with pytest.raises(PayloadError, match="bytes left"):
        codec.decode(torch.cat([section, section[:2]]), 300, ctx(10))


def test_mapping_is_a_packed_permutation():
    order = torch.randperm(300, generator=torch.Generator().manual_seed(2))
    section = pack_mapping(order)
    assert section.numel() == math.ceil(300 * 9 / 8)  # ceil(log2 300) = 9 bits
    pi = unpack_mapping(section, 300)
    assert torch.equal(order[pi], torch.arange(300))
    bad = pack_uint(torch.tensor([0, 1, 1]), 2)
    with pytest.raises(PayloadError, match="not a permutation"):
        unpack_mapping(bad, 3)
    with pytest.raises(PayloadError, match="not a permutation"):
        unpack_mapping(pack_uint(torch.tensor([0, 3, 1]), 2), 3)


# ---------------------------------------------------------------------------------------
# Any compressor as the value codec
# ---------------------------------------------------------------------------------------

DECLARE_LAYOUT = [name for name in registry.available("compressor")
                  if registry.get("compressor", name).payload_spec is not Compressor.payload_spec]


def test_the_quantizers_and_casts_declare_their_layout():
    assert {"fp16", "bf16", "natural", "qsgd", "terngrad", "natural_dithering",
            "standard_dithering"} <= set(DECLARE_LAYOUT)


@pytest.mark.parametrize("name", DECLARE_LAYOUT)
@pytest.mark.parametrize("n", [0, 1, 513, 4097])
def test_payload_spec_is_what_compress_sends(name, n):
    """A declared payload layout is exactly the dtypes and sizes of the payload, since the
    value codec splits received bytes by it alone."""
    compressor = registry.get("compressor", name)()
    info = TensorInfo(torch.Size([n]), torch.float32)
    spec = compressor.payload_spec(info)
    payload, _ = compressor.compress(torch.randn(n, generator=torch.Generator().manual_seed(n)),
                                     "w")
    assert [(t.dtype, t.numel()) for t in payload] == list(spec), name


@pytest.mark.parametrize("inner", ["fp16", "bf16", "natural", {"name": "natural", "wire": "nat8"},
                                   "qsgd", "terngrad", "natural_dithering"])
def test_any_fixed_size_compressor_is_a_value_codec(inner):
    codec = VALUE_CODECS.create("compressor", compressor=inner)
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    section, order = codec.encode(values, ctx(1000))
    decoded = codec.decode(section, 1000, ctx(1000))
    payload, info = codec.compressor.compress(values, "again")  # the same rounding, by itself
    assert order is None and decoded.dtype == torch.float32 and decoded.shape == (1000,)
    assert section.numel() == sum(t.numel() * t.element_size() for t in payload)
    assert float((decoded - values).abs().max()) <= 2 * float(values.abs().max())
    with pytest.raises(PayloadError, match="section holds"):
        codec.decode(section[:-1], 1000, ctx(1000))


def test_a_compressor_without_a_layout_is_refused_as_value_codec():
    with pytest.raises(ConfigError, match="declares its payload layout"):
        VALUE_CODECS.create("compressor", compressor="topk")
