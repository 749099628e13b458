"""Numba kernels: the optional CPU fast paths of the quantisers (needs numba, the ``fast``
extra). Each has a torch implementation elsewhere that gives the same bits; callers pick
the kernel for contiguous float32 CPU tensors when numba is importable.

- the counter generator of `gracecomm.compressors.shared.stochastic` (`hash_array`,
  `uniform_array`);
- sign planes (`pack_signs`, `signs_sum`), as `gracecomm.wire.pack_bits(x < 0)`
  would write;
- natural compression fused with its 9-bit wire format (`nat9_encode`, `nat9_sum`);
- dithering fused with its wire format (`dither_encode`, `dither_sum`): scale, draw,
  round, and write the sign plane and the b-bit level plane (LSB-first) in one pass;
- the receiving side (`*_sum`): every rank's payload decoded and summed a block at a time,
  so the sum is written once and each further rank costs a read of its payload and the
  decode, not a pass over a float32 tensor;
- shared-seed random subsets (`random_subset`): Random-k's indices by rejection into a
  bitmap, as `gracecomm.compressors.randomk` draws them in torch.

Why kernels: on CPU every torch temporary of a 26M-element tensor costs a pass over memory
plus fresh pages, and the random numbers dominate; a fused pass reads the input once and
writes only the packed output.

Threads: a tensor of at least `PARALLEL_MIN` elements is split into `torch.get_num_threads()`
parts (whole groups of 8 elements) run by Python threads on the GIL-free kernels, so the
kernels use the threads torch uses (one per rank when several ranks share a machine).
numba's own thread pool (``prange``) is not used: next to torch's OpenMP threads, which spin
after every torch operation, it made the fused pass 3x slower on the 2-core test machine.
Results do not depend on the split: element i always draws mix(i, key). Inside a kernel a
plain loop over an array slice, counting from 0, lets LLVM vectorise the hash.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import types
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from gracecomm.compressors.shared.simd_kernels import data_pointer
from gracecomm.compressors.shared.stochastic import FLOAT_BITS

U32, U64, U8, F32 = np.uint32, np.uint64, np.uint8, np.float32
PARALLEL_MIN = 1 << 20
_BLOCK = 1 << 16  # elements per block, a multiple of 8 (whole packed groups); a block's float32
# sum (256 KiB) stays in L2 while every rank's planes are added to it: blocks of 4096 made the
# receiving side 20-40% slower (docs/quantizers.md)
_POOLS: dict[int, ThreadPoolExecutor] = {}
F32_BIAS = FLOAT_BITS[torch.float32].bias


def _split(n: int, kernel: Callable[..., Any], args: Callable[[int, int], tuple]) -> list[Any]:
    """Results of kernel(*args(lo, hi)) over parts [lo, hi) covering [0, n), lo a multiple
    of 8, one part per torch thread (one part below `PARALLEL_MIN`)."""
    threads = torch.get_num_threads()
    if n < PARALLEL_MIN or threads == 1:
        return [kernel(*args(0, n))]
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(threads, "gracecomm-kernel")
    per = ((n + threads - 1) // threads + 7) // 8 * 8
    futures = [pool.submit(kernel, *args(lo, min(n, lo + per))) for lo in range(0, n, per)]
    return [f.result() for f in futures]


@intrinsic
def _as_float32(typingctx, pattern):  # pragma: no cover - compiled
    """The float32 whose bit pattern is the uint32 `pattern`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@numba.njit(inline="always")
def _mix(i, k1, k2):  # pragma: no cover - compiled
    x = U32(i) ^ k1
    x = U32(x * U32(0x9E3779B1))
    x = U32(x ^ (x >> U32(16)))
    x = U32(x + k2)
    x = U32(x * U32(0x85EBCA6B))
    x = U32(x ^ (x >> U32(13)))
    x = U32(x * U32(0xC2B2AE35))
    return U32(x ^ (x >> U32(16)))


def _keys(key: int) -> tuple[np.uint32, np.uint32]:
    return U32(key & 0xFFFFFFFF), U32((key >> 32) & 0xFFFFFFFF)


# -- counter generator --------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _hash(out, start, k1, k2, uniform):  # pragma: no cover - compiled
    if uniform:
        for k in range(out.size):
            out[k] = F32(_mix(U32(k) + U32(start), k1, k2) >> U32(8)) * F32(2.0**-24)
    else:
        for k in range(out.size):
            out[k] = _mix(U32(k) + U32(start), k1, k2)


def _fill(n: int, key: int, uniform: bool) -> np.ndarray:
    out = np.empty(n, dtype=np.float32 if uniform else np.uint32)
    k1, k2 = _keys(key)
    _split(n, _hash, lambda lo, hi: (out[lo:hi], lo, k1, k2, uniform))
    return out


def hash_array(n: int, key: int) -> np.ndarray:
    """mix(i, key) for i in [0, n) as uint32."""
    return _fill(n, key, False)


def uniform_array(n: int, key: int) -> np.ndarray:
    """(mix(i, key) >> 8) * 2**-24 for i in [0, n) as float32."""
    return _fill(n, key, True)


# -- sign planes --------------------------------------------------------------------------
@numba.njit(inline="always")
def _pack_sign_bits(bits, signs):  # pragma: no cover - compiled
    """Sign bits of the float32 patterns `bits` into `signs` (LSB-first); returns the number
    of set bits. Two patterns per uint64 word: sign bits at 31 and 63."""
    groups = bits.size // 8
    words = bits[:8 * groups].view(np.uint64)
    count = 0
    for j in range(groups):
        s = U64(0)
        for q in range(4):
            w = words[4 * j + q]
            s |= ((w >> U64(31 - 2 * q)) & U64(1 << 2 * q)) | (
                (w >> U64(62 - 2 * q)) & U64(2 << 2 * q))
        signs[j] = U8(s)
        count += _popcount8(s)
    if bits.size > 8 * groups:
        s = U64(0)
        for lane in range(bits.size - 8 * groups):
            s |= U64(bits[8 * groups + lane] >> U32(31)) << U64(lane)
        signs[groups] = U8(s)
        count += _popcount8(s)
    return count


@numba.njit(inline="always")
def _popcount8(s):  # pragma: no cover - compiled
    s = s - ((s >> U64(1)) & U64(0x55))
    s = (s & U64(0x33)) + ((s >> U64(2)) & U64(0x33))
    return int((s + (s >> U64(4))) & U64(0x0F))


@numba.njit(cache=True, fastmath={"reassoc", "nsz", "contract"})
def _sign_sums(x):  # pragma: no cover - compiled
    """float64 sums of the negative elements and of |x| (reassociated: vectorised)."""
    negative, absolute = 0.0, 0.0
    for k in range(x.size):
        negative += min(np.float64(x[k]), 0.0)
        absolute += abs(np.float64(x[k]))
    return negative, absolute


@numba.njit(cache=True, nogil=True)
def _signs(x, signs, sums):  # pragma: no cover - compiled
    count = _pack_sign_bits(x.view(np.uint32), signs)
    if sums:
        negative, absolute = _sign_sums(x)
        return count, negative, absolute
    return count, 0.0, 0.0


def pack_signs(x: np.ndarray, sums: bool) -> tuple[np.ndarray, int, float, float]:
    """(sign plane of float32 `x`, number of set sign bits, and with `sums` the float64 sums
    of the negative elements and of |x|; else 0.0, 0.0)."""
    signs = np.empty((x.size + 7) // 8, dtype=np.uint8)
    parts = _split(x.size, _signs, lambda lo, hi: (x[lo:hi], signs[lo // 8:(hi + 7) // 8], sums))
    return (signs, sum(int(p[0]) for p in parts), sum(float(p[1]) for p in parts),
            sum(float(p[2]) for p in parts))


@numba.njit(cache=True, nogil=True)
def _signs_sum(signs, lows, highs, out, lo, hi, accumulate):  # pragma: no cover - compiled
    """out[lo:hi] = the sum over ranks r of lows[r] where the sign bit is set, else
    highs[r] (added to out[lo:hi] with `accumulate`); a block at a time, so `out` is written
    once whatever the number of ranks. The select per lane of a sign byte vectorises (a
    mask per group of 8); with `accumulate` the first rank is decoded into a block-sized
    buffer and added from there (decoding straight into an add ran 3x slower)."""
    buffer = np.empty(_BLOCK if accumulate else 0, out.dtype)
    for b0 in range(lo, hi, _BLOCK):
        m = min(_BLOCK, hi - b0)
        block = out[b0:b0 + m]
        for r in range(len(signs)):
            plane, low, high = signs[r][b0 // 8:(b0 + m + 7) // 8], lows[r], highs[r]
            dest = buffer[:m] if accumulate and r == 0 else block
            if r == 0:
                for g in range(m // 8):
                    byte = plane[g]
                    for lane in range(8):
                        dest[8 * g + lane] = low if (byte >> U8(lane)) & U8(1) else high
            else:
                for g in range(m // 8):
                    byte = plane[g]
                    for lane in range(8):
                        block[8 * g + lane] += low if (byte >> U8(lane)) & U8(1) else high
            for k in range(m // 8 * 8, m):  # the tensor's last, partial group
                value = low if (plane[k // 8] >> U8(k % 8)) & U8(1) else high
                dest[k] = value if r == 0 else block[k] + value
            if accumulate and r == 0:
                for i in range(m):
                    block[i] += dest[i]


def signs_sum(signs: tuple[np.ndarray, ...], lows: np.ndarray, highs: np.ndarray,
              out: np.ndarray, accumulate: bool = False) -> None:
    """Write into the float32 array `out` (add to it with `accumulate`) the sum over
    ranks, in rank order, of `lows[r]` where rank r's sign plane has the bit set, else
    `highs[r]` (one rank: the decoded plane)."""
    lows, highs = lows.astype(np.float32), highs.astype(np.float32)
    _split(out.size, _signs_sum, lambda lo, hi: (signs, lows, highs, out, lo, hi, accumulate))


# -- packed planes to a byte per element ----------------------------------------------------
@numba.njit(inline="always")
def _spread(w, bits):  # pragma: no cover - compiled
    """The 8 `bits`-wide codes packed LSB-first in `w` moved to the 8 bytes of the result, in
    three halving steps (4 codes, 2, 1): a dozen integer operations whatever `bits` is."""
    m1 = U64((1 << (4 * bits)) - 1)
    m2 = U64(((1 << (2 * bits)) - 1) * (1 | 1 << 32))
    m3 = U64(((1 << bits) - 1) * 0x0001000100010001)
    w = (w & m1) | (((w >> U64(4 * bits)) & m1) << U64(32))
    w = (w & m2) | (((w >> U64(2 * bits)) & m2) << U64(16))
    return (w & m3) | (((w >> U64(bits)) & m3) << U64(8))


@numba.njit(inline="always")
def _unpack_codes(plane, bits, out):  # pragma: no cover - compiled
    """The `bits`-wide codes of `plane` (LSB-first, 8 codes per `bits` bytes; a short last
    group reads as zeros past the end) into `out`, one byte each (the groups `_unpack_wide`
    leaves)."""
    words = out.view(np.uint64)
    whole = plane.size // bits
    for g in range(whole):
        w = U64(0)
        for b in range(bits):  # a constant trip count: the loads combine
            w |= U64(plane[g * bits + b]) << U64(8 * b)
        words[g] = _spread(w, bits)
    if plane.size > whole * bits:
        w = U64(0)
        for b in range(plane.size - whole * bits):
            w |= U64(plane[whole * bits + b]) << U64(8 * b)
        words[whole] = _spread(w, bits)


def _lane_step(builder: ir.IRBuilder, w: ir.Value, down: int, up: int, keep: int) -> ir.Value:
    """(w & keep) | (((w >> down) & keep) << up) in every 64-bit lane of `w`: one halving
    step of `_spread_groups` (fields moved up) or `_pack_groups` (moved down, up < down)."""
    def lanes_of(value: int) -> ir.Constant:
        return ir.Constant(w.type, [value] * w.type.count)
    moved = builder.and_(builder.lshr(w, lanes_of(down)), lanes_of(keep))
    return builder.or_(builder.and_(w, lanes_of(keep)), builder.shl(moved, lanes_of(up)))


def _loaded(bits: int) -> int:
    """Bytes `_spread_groups` loads for 8 groups of `bits`-bit codes: 8 * bits rounded up to a
    power of two (a whole vector register; other widths compiled to slow shuffles)."""
    return 1 << (8 * bits - 1).bit_length()


@intrinsic
def _spread_groups(typingctx, plane, start, width, out, at):  # pragma: no cover - compiled
    """`_spread` of 8 groups at once: the 8 * bits bytes of plane[start:] (bits =
    len(width), 1..7; `_loaded(bits)` bytes are read) placed a group per 64-bit lane by one
    byte shuffle, then the three halving steps on the vector; the 64 codes are stored at
    out[at:at + 64]."""
    sig = types.void(plane, start, width, out, at)

    def codegen(context, builder, signature, args):
        plane_v, start_v, _, out_v, at_v = args
        bits = signature.args[2].count
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        size = _loaded(bits)
        packed = ir.VectorType(i8, size)
        source = data_pointer(context, builder, signature.args[0], plane_v, start_v)
        loaded = builder.load(builder.bitcast(source, packed.as_pointer()), align=1)
        order = [j * bits + b if b < bits else size for j in range(8) for b in range(8)]
        lanes = builder.shuffle_vector(loaded, ir.Constant(packed, [0] * size),
                                       ir.Constant(ir.VectorType(i32, 64), order))
        w = builder.bitcast(lanes, ir.VectorType(i64, 8))

        w = _lane_step(builder, w, 4 * bits, 32, (1 << (4 * bits)) - 1)
        w = _lane_step(builder, w, 2 * bits, 16, ((1 << (2 * bits)) - 1) * (1 | 1 << 32))
        w = _lane_step(builder, w, bits, 8, ((1 << bits) - 1) * 0x0001000100010001)
        target = data_pointer(context, builder, signature.args[3], out_v, at_v)
        builder.store(builder.bitcast(w, ir.VectorType(i8, 64)),
                      builder.bitcast(target, ir.VectorType(i8, 64).as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


_LOADED = tuple(_loaded(bits) if bits else 0 for bits in range(8))


@numba.njit(inline="always")
def _unpack_wide(plane, width, out):  # pragma: no cover - compiled
    """`_unpack_codes` for bits = len(width) in 1..7: runs of 8 groups by `_spread_groups`
    while its load stays inside `plane`, the rest group by group."""
    bits = len(width)
    size = _LOADED[bits]
    runs = max(0, plane.size - size) // (8 * bits) + (plane.size >= size)
    for g in range(0, 8 * runs, 8):
        _spread_groups(plane, g * bits, width, out, g * 8)
    _unpack_codes(plane[runs * 8 * bits:], bits, out[runs * 64:])


@numba.njit(inline="always")
def _largest(codes):  # pragma: no cover - compiled
    """The largest of the uint8 `codes` (0 if empty)."""
    top = U8(0)
    for j in range(codes.size):
        top = max(top, codes[j])
    return top


# -- natural compression, nat9 -------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _nat9_encode(bits, exps, signs, start, k1, k2, rmask, rconst):  # pragma: no cover
    top = U32(0)
    for k in range(bits.size):
        mag = U32(bits[k] & U32(0x7FFFFFFF))
        top = max(top, mag)
        r = U32(U32(_mix(U32(k) + U32(start), k1, k2) >> U32(9)) & rmask) | rconst
        exps[k] = U8(U32(mag + r) >> U32(23))
    _pack_sign_bits(bits, signs)
    return top


def nat9_encode(bits: np.ndarray, key: int, stochastic: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Round the float32 bit patterns `bits` (uint32) to powers of two and split them into
    the exponent plane (biased exponent, one byte each; 255 where a value rounded past
    2**127) and the sign plane.

    Returns (exponents, signs, largest magnitude pattern): a largest pattern >= 0x7F800000
    means the input held Inf or NaN and those elements' planes are meaningless."""
    n = bits.size
    exps = np.empty(n, dtype=np.uint8)
    signs = np.empty((n + 7) // 8, dtype=np.uint8)
    if n == 0:
        return exps, signs, 0
    rmask, rconst = (U32(0x7FFFFF), U32(0)) if stochastic else (U32(0), U32(0x400000))
    k1, k2 = _keys(key)
    tops = _split(n, _nat9_encode, lambda lo, hi: (
        bits[lo:hi], exps[lo:hi], signs[lo // 8:(hi + 7) // 8], lo, k1, k2, rmask, rconst))
    return exps, signs, int(max(tops))


@numba.njit(cache=True, nogil=True)
def _nat9_sum(exps, signs, out, lo, hi):  # pragma: no cover - compiled
    """out[lo:hi] = the sum over ranks of the values (sign << 31) | (exponent << 23), a block
    at a time: the sign plane is spread to a byte per element, then each value is formed
    and added in one vectorised loop; the largest exponent byte."""
    negative = np.zeros(_BLOCK, dtype=np.uint8)
    top = U8(0)
    for b0 in range(lo, hi, _BLOCK):
        m = min(_BLOCK, hi - b0)
        block = out[b0:b0 + m]
        for r in range(len(exps)):
            e = exps[r][b0:b0 + m]
            _unpack_wide(signs[r][b0 // 8:(b0 + m + 7) // 8], (0,), negative)
            top = max(top, _largest(e))
            sign = negative[:m]
            if r == 0:
                for j in range(m):
                    block[j] = _as_float32((U32(sign[j]) << U32(31)) | (U32(e[j]) << U32(23)))
            else:
                for j in range(m):
                    block[j] += _as_float32((U32(sign[j]) << U32(31)) | (U32(e[j]) << U32(23)))
    return top


def nat9_sum(exps: tuple[np.ndarray, ...], signs: tuple[np.ndarray, ...],
             out: np.ndarray) -> int:
    """Write into the float32 array `out` the sum over ranks, in rank order, of the values
    (sign << 31) | (exponent << 23) of the nat9 planes (one rank: the decoded values);
    returns the largest exponent byte (255 is a reserved code the caller rejects)."""
    if out.size == 0:
        return 0
    return int(max(_split(out.size, _nat9_sum, lambda lo, hi: (exps, signs, out, lo, hi))))


# -- dithering ----------------------------------------------------------------------------


@numba.njit(inline="always")
def _pack_codes(cbuf, x, m, bits, signs, codes, g0):  # pragma: no cover - compiled
    """Pack the m codes of a block (8 per `bits` bytes) and their signs (x < 0 and code > 0)
    starting at group g0."""
    for g in range((m + 7) // 8):
        word = U64(0)
        s = U64(0)
        for lane in range(min(8, m - 8 * g)):
            c = U64(cbuf[8 * g + lane])
            word |= c << U64(bits * lane)
            s |= U64((x[8 * g + lane] < 0) & (c != U64(0))) << U64(lane)
        signs[g0 + g] = U8(s)
        for b in range(bits):
            if (g0 + g) * bits + b < codes.size:
                codes[(g0 + g) * bits + b] = U8((word >> U64(8 * b)) & U64(0xFF))


@intrinsic
def _pack_groups(typingctx, cbuf, at, width, x, codes, start, signs, group):  # pragma: no cover
    """`_pack_codes` of 8 groups at once, the inverse of `_spread_groups`: the 64 codes of
    cbuf[at:at + 64] (one per byte, below 2^bits, bits = len(width)) merged by three halving
    steps into 8 * bits bits per 64-bit lane, whose low bytes one shuffle writes to
    codes[start:start + 8 * bits]; the 64 signs (x[at + j] < 0 and code j > 0) to
    signs[group:group + 8]."""
    sig = types.void(cbuf, at, width, x, codes, start, signs, group)

    def codegen(context, builder, signature, args):
        cbuf_v, at_v, _, x_v, codes_v, start_v, signs_v, group_v = args
        bits = signature.args[2].count
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        bytes64 = ir.VectorType(i8, 64)

        def load(arg, value, index, vector):
            pointer = data_pointer(context, builder, signature.args[arg], value, index)
            return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=1)

        c8 = load(0, cbuf_v, at_v, bytes64)
        w = builder.bitcast(c8, ir.VectorType(i64, 8))

        w = _lane_step(builder, w, 8, bits, 0x00FF00FF00FF00FF)
        w = _lane_step(builder, w, 16, 2 * bits, 0x0000FFFF0000FFFF)
        w = _lane_step(builder, w, 32, 4 * bits, 0x00000000FFFFFFFF)
        order = [8 * j + b for j in range(8) for b in range(bits)]
        packed = builder.shuffle_vector(builder.bitcast(w, bytes64), ir.Constant(bytes64, None),
                                        ir.Constant(ir.VectorType(i32, 8 * bits), order))
        target = data_pointer(context, builder, signature.args[4], codes_v, start_v)
        builder.store(packed, builder.bitcast(target, packed.type.as_pointer()), align=1)
        values = load(3, x_v, at_v, ir.VectorType(ir.FloatType(), 64))
        negative = builder.fcmp_ordered("<", values, ir.Constant(values.type, [0.0] * 64))
        sent = builder.icmp_unsigned("!=", c8, ir.Constant(bytes64, [0] * 64))
        plane = builder.bitcast(builder.and_(negative, sent), i64)
        target = data_pointer(context, builder, signature.args[6], signs_v, group_v)
        builder.store(plane, builder.bitcast(target, i64.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(inline="always")
def _pack_wide(cbuf, x, m, width, signs, codes, g0):  # pragma: no cover - compiled
    """`_pack_codes` with bits = len(width): whole runs of 8 groups by `_pack_groups`, the
    rest group by group."""
    bits = len(width)
    runs = m // 64
    for r in range(runs):
        _pack_groups(cbuf, 64 * r, width, x, codes, (g0 + 8 * r) * bits, signs, g0 + 8 * r)
    _pack_codes(cbuf[64 * runs:], x[64 * runs:], m - 64 * runs, bits, signs, codes,
                g0 + 8 * runs)


@numba.njit(cache=True, nogil=True)
def _dither_encode(x, scale, bucket, start, units, natural, k1, k2, width, signs,
                   codes):  # pragma: no cover - compiled
    """Level codes of z = min(|x| scale[bucket], units) and the signs, packed (see
    `gracecomm.compressors.dithering`); per block: scale (per bucket segment), round, pack."""
    zbuf = np.empty(_BLOCK, dtype=np.float32)
    zbits = zbuf.view(np.uint32)
    cbuf = np.empty(_BLOCK, dtype=np.uint8)
    for b0 in range(0, x.size, _BLOCK):
        m = min(_BLOCK, x.size - b0)
        k = 0
        while k < m:  # segments of one bucket: a constant scale
            index = (start + b0 + k) // bucket
            end = min(m, (index + 1) * bucket - start - b0)
            factor = scale[index]
            segment, out = x[b0 + k:b0 + end], zbuf[k:end]
            for j in range(segment.size):  # over slices from 0: vectorised (a loop from k was not)
                out[j] = min(abs(segment[j]) * factor, units)
            k = end
        base = U32(start + b0)
        if natural:  # z >= 1: natural rounding of z, code = exponent + 1; else 1 w.p. z
            for j in range(m):
                r = U32(_mix(U32(j) + base, k1, k2) >> U32(9))
                high = U32(U32(U32(zbits[j] + r) >> U32(23)) - U32(126))
                low = U32(F32(r) * F32(2.0**-23) < zbuf[j])
                cbuf[j] = U8(high if zbits[j] >= U32(0x3F800000) else low)
        else:
            for j in range(m):
                u = F32(_mix(U32(j) + base, k1, k2) >> U32(8)) * F32(2.0**-24)
                lower = F32(np.floor(zbuf[j]))
                cbuf[j] = U8(lower) + U8(u < zbuf[j] - lower)
        _pack_wide(cbuf, x[b0:b0 + m], m, width, signs, codes, b0 // 8)


def dither_encode(x: np.ndarray, scale: np.ndarray, bucket: int, units: float, natural: bool,
                  key: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(sign plane, packed level codes) of float32 `x` for `bits` <= 8; see
    `gracecomm.compressors.dithering`."""
    n = x.size
    signs = np.empty((n + 7) // 8, dtype=np.uint8)
    codes = np.empty((n * bits + 7) // 8, dtype=np.uint8)
    k1, k2 = _keys(key)
    if n:
        _split(n, _dither_encode, lambda lo, hi: (
            x[lo:hi], scale, bucket, lo, F32(units), natural, k1, k2, (0,) * bits,
            signs[lo // 8:(hi + 7) // 8], codes[lo // 8 * bits:(hi + 7) // 8 * bits]))
    return signs, codes


@numba.njit(inline="always")
def _code_value(c, negative, levels, natural):  # pragma: no cover - compiled
    """The signed value of code `c`: +-c (standard levels) or +-2^(c - levels) and 0 for
    c = 0 (natural levels). The sign is a multiplication: setting the sign bit with integer
    operations made natural dithering's receiving side a fifth slower."""
    if natural:
        c = U32(c)
        size = _as_float32(((c + U32(F32_BIAS - levels)) << U32(23)) & (U32(0) - U32(c > U32(0))))
    else:
        size = F32(np.int32(c))
    return size * (F32(1.0) - F32(2.0) * F32(np.int32(negative)))


@numba.njit(inline="always")
def _add_values(block, codes, negative, levels, natural, scale, first):  # pragma: no cover
    """block = (the signed code values) * scale for the first rank, block += for the others
    (one pass, vectorised)."""
    if first:
        for j in range(block.size):
            block[j] = _code_value(codes[j], negative[j], levels, natural) * scale
    else:
        for j in range(block.size):
            block[j] += _code_value(codes[j], negative[j], levels, natural) * scale


@numba.njit(cache=True, nogil=True)
def _dither_sum(signs, codes, scales, levels, natural, bucket, width, out, lo,
                hi):  # pragma: no cover - compiled
    """out[lo:hi] = the sum over ranks of the signed code values times their bucket's
    scale, a block at a time: the planes are unpacked to a byte per element, then the values
    are formed and accumulated in one vectorised loop per bucket segment. `width` is a tuple
    of `bits` items, so bits = len(width) is a constant of each compiled kernel."""
    bits = len(width)
    top = U8(0)
    negative = np.zeros(_BLOCK, dtype=np.uint8)
    unpacked = np.zeros(_BLOCK, dtype=np.uint8)
    for b0 in range(lo, hi, _BLOCK):
        m = min(_BLOCK, hi - b0)
        g0, groups = b0 // 8, (m + 7) // 8
        for r in range(len(codes)):
            _unpack_wide(signs[r][g0:g0 + groups], (0,), negative)
            if bits == 8:
                plane = codes[r][b0:b0 + m]
            else:
                _unpack_wide(codes[r][g0 * bits:(g0 + groups) * bits], width, unpacked)
                plane = unpacked[:m]
            top = max(top, _largest(plane))
            k = 0
            while k < m:  # segments of one bucket: a constant scale
                index = (b0 + k) // bucket
                end = min(m, (index + 1) * bucket - b0)
                _add_values(out[b0 + k:b0 + end], plane[k:end], negative[k:end], levels,
                            natural, scales[r][index], r == 0)
                k = end
    return top


def dither_sum(signs: tuple[np.ndarray, ...], codes: tuple[np.ndarray, ...],
               scales: tuple[np.ndarray, ...], levels: int, natural: bool, bucket: int,
               out: np.ndarray, bits: int) -> int:
    """Write into the float32 array `out` the sum over ranks, in rank order, of the
    dithering planes' values (`bits` <= 8; one rank: the decoded values); returns the
    largest level code. A code c decodes to +-c (standard levels) or +-2^(c - levels)
    (natural levels; 0 for c = 0) times its bucket's entry of `scales[r]`; codes above
    `levels` are reported through the largest code, which the caller rejects."""
    if out.size == 0:
        return 0
    return int(max(_split(out.size, _dither_sum, lambda lo, hi: (
        signs, codes, scales, levels, natural, bucket, (0,) * bits, out, lo, hi))))


# -- shared-seed random subsets -----------------------------------------------------------
@numba.njit(inline="always")
def _draw(i, d, k1, k2, k3, k4):  # pragma: no cover - compiled
    """Draw i: floor(u d / 2^64) for the 64-bit u = (mix(i, k1, k2) << 32) | mix(i, k3, k4),
    exact in 64-bit arithmetic for d < 2^32."""
    hi, lo = U64(_mix(U32(i), k1, k2)), U64(_mix(U32(i), k3, k4))
    return (hi * U64(d) + ((lo * U64(d)) >> U64(32))) >> U64(32)


@numba.njit(cache=True, nogil=True)
def _subset(d, m, k1, k2, k3, k4, complement):  # pragma: no cover - compiled
    bits = np.zeros((d + 63) // 64, np.uint64)
    drawn, i = 0, 0
    while drawn < m:
        j = _draw(i, d, k1, k2, k3, k4)
        word, bit = j >> U64(6), U64(1) << (j & U64(63))
        if not bits[word] & bit:
            bits[word] |= bit
            drawn += 1
        i += 1
    size = d - m if complement else m
    out = np.empty(size, np.int64)
    n = 0
    for w in range(bits.size):
        word = ~bits[w] if complement else bits[w]
        if complement and w == bits.size - 1 and d % 64:
            word &= (U64(1) << U64(d % 64)) - U64(1)
        while word:
            out[n] = 64 * w + trailing_zeros(word)
            n += 1
            word &= word - U64(1)
    return out


def random_subset(d: int, k: int, key: int, key2: int) -> np.ndarray:
    """Ascending positions of a uniformly random k-subset of range(d), d < 2^31: the first k
    distinct values of the draws j(0), j(1), ... (`_draw`, keyed by the 64-bit keys `key`
    and `key2`); for k > d/2 the complement of the first d - k distinct draws."""
    complement = 2 * k > d
    return _subset(d, d - k if complement else k, *_keys(key), *_keys(key2), complement)
