"""Wire formats: bit packing and the byte layout of payloads.

Sub-byte formats (bitmaps, n-bit levels, exponents, Bloom filters) are packed into uint8
tensors here so that the bytes a method is credited with are the bytes of real tensors.
Bit streams are LSB-first: bit j of the stream lives in byte j // 8 at bit position j % 8,
and the n-bit integer i occupies stream bits [i*n, (i+1)*n), least significant bit first.
All functions are vectorised torch code and run on CPU and CUDA tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from gracecomm.validation import PayloadError

_MAX_BITS = 32
_LITTLE_ENDIAN = sys.byteorder == "little"  # the word-based packing views int64 as bytes


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by `n` integers of `bits` bits each."""
    return (n * bits + 7) // 8


def pack_uint(values: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Pack non-negative integers below 2**bits into a uint8 tensor of
    ceil(n * bits / 8) bytes. Values outside the range raise (skip the two extra passes
    with `check=False` when the caller guarantees the range)."""
    if not 1 <= bits <= _MAX_BITS:
        raise ValueError(f"pack_uint: bits must be in [1, {_MAX_BITS}], got {bits}")
    v = values.reshape(-1)
    n = v.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=v.device)
    if v.dtype == torch.bool:
        v = v.view(torch.uint8)
    if v.is_floating_point():
        raise TypeError(f"pack_uint: expected an integer tensor, got {v.dtype}")
    if check and (bits < 8 or v.dtype != torch.uint8):
        lo, hi = int(v.min()), int(v.max())
        if lo < 0 or hi >= (1 << bits):
            raise ValueError(f"pack_uint: values must lie in [0, {(1 << bits) - 1}] for "
                             f"{bits}-bit fields, got range [{lo}, {hi}]")
    if bits == 8:
        return v.to(torch.uint8)
    if bits < 8 and _LITTLE_ENDIAN:
        return _pack_words(v.to(torch.uint8), bits, n)
    return _pack_generic(v.to(torch.int64), bits, n)


# Fields of fewer than 8 bits: 8 fields make exactly `bits` bytes. The 8 fields of a group
# are loaded as the 8 bytes of one int64 word (little-endian), and three steps pair up
# neighbours inside 16-, 32- and 64-bit lanes: the upper half of each lane (at bit lane/2)
# moves down next to the lower half (at bit `width`), so field l ends at bit bits*l.
# Unpacking runs the steps backwards.
_STEPS = ((16, 1), (32, 2), (64, 4))  # (lane, fields per half-lane)


def _lanes(width: int, lane: int) -> int:
    """Mask of the lowest `width` bits of every `lane`-bit lane of a 64-bit word."""
    return sum(((1 << width) - 1) << (lane * j) for j in range(64 // lane))


def _pack_words(v8: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    pad = (-n) % 8
    if pad:
        v8 = torch.cat([v8, v8.new_zeros(pad)])
    w = v8.view(torch.int64)
    for lane, fields in _STEPS:  # in place after the first step (fewer fresh pages)
        width = bits * fields
        low = _lanes(width, lane)
        high = (w >> (lane // 2 - width)).bitwise_and_(low << width)
        w = (w & low) if w.data_ptr() == v8.data_ptr() else w.bitwise_and_(low)
        w.bitwise_or_(high)
    packed = w.view(torch.uint8).view(-1, 8)[:, :bits]
    return packed.reshape(-1)[: packed_nbytes(n, bits)].contiguous()


def _unpack_words(p: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    groups = (n + 7) // 8
    p = torch.cat([p, p.new_zeros(groups * bits - p.numel())]).view(groups, bits)
    w = torch.cat([p, p.new_zeros(groups, 8 - bits)], dim=1).reshape(-1).view(torch.int64)
    for lane, fields in reversed(_STEPS):
        width = bits * fields
        low = _lanes(width, lane)
        high = (w << (lane // 2 - width)).bitwise_and_(low << (lane // 2))
        w.bitwise_and_(low).bitwise_or_(high)
    return w.view(torch.uint8)[:n]


def _pack_generic(v: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    # Each value, shifted to its bit offset inside its first byte, spans at most 5 bytes;
    # contributions to one byte occupy disjoint bits, so adding them is the same as OR-ing.
    offset = torch.arange(n, dtype=torch.int64, device=v.device) * bits
    first = offset >> 3
    shifted = v << (offset & 7)
    out = torch.zeros(packed_nbytes(n, bits) + 5, dtype=torch.int64, device=v.device)
    for j in range((bits + 7 + 7) // 8):
        out.index_add_(0, first + j, (shifted >> (8 * j)) & 0xFF)
    return out[: packed_nbytes(n, bits)].to(torch.uint8)


def unpack_uint(packed: torch.Tensor, bits: int, n: int, *,
                dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of `pack_uint`: return `n` integers of `bits` bits each, as `dtype` (int64 by
    default; uint8 skips a widening copy for fields of at most 8 bits)."""
    if not 1 <= bits <= _MAX_BITS:
        raise ValueError(f"unpack_uint: bits must be in [1, {_MAX_BITS}], got {bits}")
    if dtype == torch.uint8 and bits > 8:
        raise ValueError(f"unpack_uint: {bits}-bit fields do not fit dtype uint8")
    if packed.dtype != torch.uint8:
        raise PayloadError(f"packed data must be uint8, got {packed.dtype}")
    need = packed_nbytes(n, bits)
    if packed.numel() != need:
        raise PayloadError(f"packed data holds {packed.numel()} bytes; {n} fields of "
                           f"{bits} bits need exactly {need}")
    p = packed.reshape(-1)
    if n == 0:
        return torch.empty(0, dtype=dtype, device=p.device)
    if bits == 8:
        return p.to(dtype)
    if bits < 8 and _LITTLE_ENDIAN:
        return _unpack_words(p, bits, n).to(dtype)
    offset = torch.arange(n, dtype=torch.int64, device=p.device) * bits
    first = offset >> 3
    padded = torch.cat([p, p.new_zeros(5)]).to(torch.int64)
    word = torch.zeros(n, dtype=torch.int64, device=p.device)
    for j in range((bits + 7 + 7) // 8):
        word |= padded[first + j] << (8 * j)
    return ((word >> (offset & 7)) & ((1 << bits) - 1)).to(dtype)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool (or 0/1) tensor into ceil(n / 8) bytes, LSB-first."""
    flat = bits.reshape(-1)
    flat = flat if flat.dtype == torch.bool else flat.ne(0)
    return pack_uint(flat, 1, check=False)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: a bool tensor of `n` elements."""
    return unpack_uint(packed, 1, n, dtype=torch.uint8).view(torch.bool)


VARINT_MAX_BYTES = 5  # LEB128 bytes of a 32-bit value


def varint_bytes(values: torch.Tensor) -> torch.Tensor:
    """Non-negative integers below 2**32 as unsigned LEB128 varints: 7 payload bits per
    byte, least significant group first, high bit set on every byte but a value's last."""
    v = values.reshape(-1).to(torch.int64)
    low, high = (int(b) for b in torch.aminmax(v)) if v.numel() else (0, 0)
    if low < 0 or high >= 1 << 32:
        raise ValueError(f"varint_bytes: values must lie in [0, 2**32), got [{low}, {high}]")
    shifts = 7 * torch.arange(VARINT_MAX_BYTES, device=v.device)
    groups = v.unsqueeze(1) >> shifts  # (n, 5): the value from each 7-bit group upwards
    more = groups >= 0x80  # a higher group is non-zero, so another byte follows
    keep = torch.cat([torch.ones_like(more[:, :1]), more[:, :-1]], dim=1)
    return torch.masked_select(((groups & 0x7F) | (more.long() << 7)).to(torch.uint8), keep)


def varint_values(data: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `varint_bytes`: the `n` values (int64) of a uint8 stream that holds exactly
    `n` complete varints of at most `VARINT_MAX_BYTES` bytes; `PayloadError` otherwise."""
    d = data.reshape(-1).long()
    last = d < 0x80
    if int(last.sum()) != n or (d.numel() and not bool(last[-1])):
        raise PayloadError(f"the stream holds {int(last.sum())} complete varints"
                           f"{' and a truncated one' if d.numel() and not bool(last[-1]) else ''}"
                           f", expected {n}")
    owner = torch.cumsum(last, 0) - last.long()
    starts = torch.cat([d.new_zeros(1), last.nonzero().view(-1) + 1])[:n]
    shift = torch.arange(d.numel(), device=d.device) - starts[owner]
    if d.numel() and int(shift.max()) >= VARINT_MAX_BYTES:
        raise PayloadError(f"a varint is longer than {VARINT_MAX_BYTES} bytes")
    values = torch.zeros(n, dtype=torch.int64, device=d.device)
    values.index_add_(0, owner, (d & 0x7F) << (7 * shift))
    return values


def bits_for(count: int) -> int:
    """Bits needed to write integers in [0, count): max(1, ceil(log2(count)))."""
    return max(1, (int(count) - 1).bit_length())


# ---------------------------------------------------------------------------------------
# Payload byte layout, used by communicators that move several tensors in one collective.
# ---------------------------------------------------------------------------------------

# dtype codes of self-describing layouts (announced payload dtypes, the parameter server's
# downlink header)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype)


def dtype_of(code: int) -> torch.dtype:
    """The dtype of a `DTYPES` code read from the wire; `PayloadError` for a code out of
    range (a negative one would otherwise index from the end)."""
    if not 0 <= code < len(DTYPES):
        raise PayloadError(f"dtype code {code} is not one of 0..{len(DTYPES) - 1}")
    return DTYPES[code]


Described = tuple[torch.Size, torch.dtype, Sequence[torch.Tensor]]
MAX_DIMS = 16  # the most dimensions a described shape may have
MAX_DESCRIBED_TENSORS = 64  # the most payload tensors one described item may have


def pack_described(items: Sequence[Described]) -> tuple[torch.Tensor, torch.Tensor]:
    """A self-describing layout of (shape, dtype, payload) items (a result's shape and dtype,
    and the payload it is decoded from): an int64 header with every shape and `DTYPES` code,
    and one uint8 buffer with the payloads' bytes (`to_bytes`)."""
    header: list[int] = [len(items)]
    tensors: list[torch.Tensor] = []
    for shape, dtype, payload in items:
        header += [dtype_code(dtype), len(shape), *shape, len(payload)]
        for t in payload:
            header += [dtype_code(t.dtype), t.dim(), *t.shape]
            tensors.append(t)
    return torch.tensor(header, dtype=torch.int64), to_bytes(tensors)


def unpack_described(header: torch.Tensor, buf: torch.Tensor) -> list[Described]:
    """Inverse of `pack_described`; its tensors are copies, independent of `buf`. Every
    word is checked before it is used: `PayloadError` for a dtype code or a count out of
    range, a negative dimension, a header with words missing or left over, and payloads
    whose bytes do not fill `buf` exactly."""
    words = header.tolist()
    pos = 0

    def word(what: str, low: int, high: int) -> int:
        nonlocal pos
        if pos >= len(words):
            raise PayloadError(f"the header ends at word {pos}, where {what} should follow")
        value = words[pos]
        if not low <= value <= high:
            raise PayloadError(f"header word {pos} ({what}) is {value}, allowed {low}..{high}")
        pos += 1
        return value

    def shaped() -> tuple[torch.dtype, torch.Size]:
        dtype = dtype_of(word("a dtype code", -(2**63), 2**63))
        ndim = word("a number of dimensions", 0, MAX_DIMS)
        dims = []
        for _ in range(ndim):
            dim = word("a dimension", -(2**63), 2**63)
            if dim < 0:
                raise PayloadError(f"header word {pos - 1} is dimension {dim}, which is "
                                   "negative")
            dims.append(dim)
        return dtype, torch.Size(dims)

    out, offset = [], 0
    for _ in range(word("the number of items", 0, len(words))):
        dtype, shape = shaped()
        payload = []
        for _ in range(word("a number of payload tensors", 0, MAX_DESCRIBED_TENSORS)):
            t_dtype, t_shape = shaped()
            size = t_shape.numel() * t_dtype.itemsize
            if offset + size > buf.numel():
                raise PayloadError(f"the header describes more payload bytes than the "
                                   f"{buf.numel()} bytes received")
            payload.append(buf[offset:offset + size].clone().view(t_dtype).reshape(t_shape))
            offset += size
        out.append((shape, dtype, tuple(payload)))
    if pos != len(words):
        raise PayloadError(f"the header holds {len(words)} words, its items use {pos}")
    if offset != buf.numel():
        raise PayloadError(f"the header describes {offset} payload bytes, {buf.numel()} bytes "
                           "were received")
    return out


def payload_nbytes(payload: Sequence[torch.Tensor]) -> int:
    """Bytes on the wire of a payload: sum of numel * element_size over its tensors."""
    return sum(t.numel() * t.element_size() for t in payload)


def to_bytes(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Concatenate the raw bytes of `tensors` into one flat uint8 tensor."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors
             if t.numel()]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def from_bytes(buf: torch.Tensor, numels: Sequence[int],
               like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split `buf` into tensors with the dtypes and trailing dimensions of `like` and the
    element counts `numels` (the leading dimension may differ from `like`): views of `buf`
    where the offset suits the dtype, else copies, so `buf` must not change while they are
    used. Raises `PayloadError` if the counts do not fit the buffer exactly."""
    if len(numels) != len(like):
        raise PayloadError(f"payload has {len(numels)} tensors, expected {len(like)}")
    need = 0
    for count, ref in zip(numels, like):
        if count < 0:
            raise PayloadError(f"payload tensor size {count} is negative")
        trailing = ref.shape[1:].numel() if ref.dim() > 1 else 1
        if trailing and count % trailing:
            raise PayloadError(f"payload tensor of {count} elements does not fit trailing "
                               f"shape {tuple(ref.shape[1:])}")
        need += count * ref.element_size()
    if buf.numel() < need:
        raise PayloadError(f"payload buffer holds {buf.numel()} bytes, its size header "
                           f"announces {need}: truncated")
    out, pos = [], 0
    for count, ref in zip(numels, like):
        size = count * ref.element_size()
        chunk = buf[pos:pos + size]
        if (buf.storage_offset() + pos) % ref.element_size():  # a view needs alignment
            chunk = chunk.clone()
        chunk = chunk.view(ref.dtype)
        shape = (-1, *ref.shape[1:]) if ref.dim() > 1 else (count,) if ref.dim() == 1 else ()
        if ref.dim() == 0 and count != 1:
            raise PayloadError(f"payload scalar arrived with {count} elements")
        out.append(chunk.reshape(shape))
        pos += size
    return out


def contiguous_runs(tensors: Sequence[torch.Tensor]) -> list[range]:
    """The maximal runs of consecutive `tensors` that lie back to back in one storage with
    one dtype (a DDP bucket's gradients are views of its flat buffer), as index ranges in
    order; a tensor that is not contiguous is a run of its own."""
    runs: list[range] = []
    start, end = 0, -1
    for i, t in enumerate(tensors):
        if i and not (t.data_ptr() == end and t.is_contiguous() and t.dtype == tensors[i - 1].dtype
                      and t.untyped_storage().data_ptr()
                      == tensors[i - 1].untyped_storage().data_ptr()):
            runs.append(range(start, i))
            start = i
        end = t.data_ptr() + t.numel() * t.element_size() if t.is_contiguous() else -1
    if tensors:
        runs.append(range(start, len(tensors)))
    return runs


def flat_run(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat view over `tensors`, which form one run of `contiguous_runs` (no copy); a
    run of one is its tensor, as it is."""
    first = tensors[0]
    if len(tensors) == 1:
        return first
    return first.as_strided((sum(t.numel() for t in tensors),), (1,))


def joined(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
    """`named`'s tensors as one flat tensor, named after all of them (each set of tensors its
    own name, so its own payload layout), as ``strategy="auto"`` sends its fp16 and dense
    forms: a view where they lie back to back (`flat_run`: a DDP bucket's gradients), else a
    copy; None for fewer than two tensors or several dtypes."""
    if len(named) < 2 or len({t.dtype for _, t in named}) > 1:
        return None
    tensors = [t for _, t in named]
    flat = (flat_run(tensors) if len(contiguous_runs(tensors)) == 1
            else torch.cat([t.reshape(-1) for t in tensors]))
    return "+".join(name for name, _ in named), flat


def split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`flat`'s elements cut back into `tensors`' shapes, in order (views): the inverse of
    `flat_run` and `joined`, for a joint mean."""
    parts = flat.reshape(-1).split([t.numel() for t in tensors])
    return [part.view_as(t) for part, t in zip(parts, tensors)]
