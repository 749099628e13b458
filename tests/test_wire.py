import pytest
import torch

from gracecomm.validation import PayloadError
from gracecomm.wire import (
    bits_for,
    contiguous_runs,
    flat_run,
    from_bytes,
    pack_bits,
    pack_uint,
    packed_nbytes,
    to_bytes,
    unpack_bits,
    unpack_uint,
    varint_bytes,
    varint_values,
)


@pytest.mark.parametrize("bits", list(range(1, 33)))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 1003])
def test_pack_uint_round_trip(bits, n):
    gen = torch.Generator().manual_seed(bits * 1000 + n)
    values = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.int64)
    packed = pack_uint(values, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(n, bits) == (n * bits + 7) // 8
    assert torch.equal(unpack_uint(packed, bits, n), values)


def test_bit_order_is_lsb_first():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [1, 2]
    assert pack_uint(torch.tensor([1, 2, 3]), 2).tolist() == [0b111001]
    # 3-bit fields cross byte boundaries: 5 = 101, 6 = 110, 7 = 111
    # -> stream 101 011 111 (LSB first)
    assert pack_uint(torch.tensor([5, 3, 7]), 3).tolist() == [0b11011101, 0b1]
    assert torch.equal(unpack_bits(pack_bits(bits), 10), bits)


def test_pack_uint_rejects_out_of_range_values():
    with pytest.raises(ValueError, match=r"\[0, 7\]"):
        pack_uint(torch.tensor([8]), 3)
    with pytest.raises(ValueError, match="range"):
        pack_uint(torch.tensor([-1]), 4)
    with pytest.raises(TypeError):
        pack_uint(torch.tensor([0.5]), 4)


def test_unpack_rejects_wrong_length():
    with pytest.raises(PayloadError, match="exactly 2"):
        unpack_uint(torch.zeros(3, dtype=torch.uint8), 4, 4)


def leb128(values: list[int]) -> bytes:
    """Unsigned LEB128, one value at a time: the reference for `varint_bytes`."""
    out = bytearray()
    for v in values:
        while v >= 0x80:
            out.append(v & 0x7F | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


@pytest.mark.parametrize("high", [1, 128, 129, 2**14, 2**21 + 5, 2**28, 2**32])
@pytest.mark.parametrize("n", [0, 1, 9, 1000])
def test_varints_are_leb128_and_round_trip(high, n):
    values = torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(n + high))
    if n:
        values[0] = high - 1  # the widest value of the range
    data = varint_bytes(values)
    assert data.dtype == torch.uint8 and data.numpy().tobytes() == leb128(values.tolist())
    assert torch.equal(varint_values(data, n), values)


def test_varints_refuse_values_and_streams_out_of_range():
    for bad in ([-1], [2**32]):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
            varint_bytes(torch.tensor(bad))
    with pytest.raises(PayloadError, match="truncated"):
        varint_values(torch.tensor([0x81, 0x81], dtype=torch.uint8), 1)
    with pytest.raises(PayloadError, match="2 complete varints, expected 1"):
        varint_values(torch.tensor([1, 2], dtype=torch.uint8), 1)
    with pytest.raises(PayloadError, match="longer than 5"):
        varint_values(torch.tensor([0x80] * 5 + [1], dtype=torch.uint8), 1)


def test_bits_for():
    assert [bits_for(c) for c in (1, 2, 3, 4, 5, 256, 257)] == [1, 1, 2, 2, 3, 8, 9]


def test_payload_bytes_round_trip_and_truncation():
    a = torch.randn(5)
    b = torch.arange(4, dtype=torch.int32)
    c = torch.randn(3, 2).half()
    buf = to_bytes([a, b, c])
    assert buf.numel() == 5 * 4 + 4 * 4 + 6 * 2
    out = from_bytes(buf, [5, 4, 6], [a, b, c])
    assert torch.equal(out[0], a) and torch.equal(out[1], b) and torch.equal(out[2], c)
    # the leading dimension may differ from the template
    out = from_bytes(to_bytes([torch.ones(2, 2).half()]), [4], [c])
    assert out[0].shape == (2, 2)
    with pytest.raises(PayloadError, match="truncated"):
        from_bytes(buf[:-1], [5, 4, 6], [a, b, c])
    with pytest.raises(PayloadError, match="negative"):
        from_bytes(buf, [-1, 4, 6], [a, b, c])
    with pytest.raises(PayloadError, match="trailing"):
        from_bytes(buf, [5, 4, 5], [a, b, c])


def test_contiguous_runs_find_tensors_back_to_back_in_one_storage():
    buf = torch.arange(20.0)
    views = [buf[0:3], buf[3:8].view(5, 1), buf[8:10]]
    other = torch.zeros(4)
    gap = buf[11:14]  # one element after the last view: not adjacent
    strided = buf[14:20:2]
    tensors = [*views, other, gap, strided, buf.double()[:2]]
    assert contiguous_runs(tensors) == [range(0, 3), range(3, 4), range(4, 5), range(5, 6),
                                        range(6, 7)]
    flat = flat_run(views)
    assert flat.shape == (10,) and flat.data_ptr() == buf.data_ptr()
    assert torch.equal(flat, buf[:10])
    assert flat_run([views[1]]) is views[1]  # a run of one is its tensor, shape kept
    assert contiguous_runs([]) == []
    ints = torch.arange(6)
    assert contiguous_runs([buf[:2], ints[2:4]]) == [range(0, 1), range(1, 2)]  # dtypes differ
