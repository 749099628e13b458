"""Numba kernels: the optional CPU fast paths of the quantisers (needs numba, the ``fast``
extra). Each has a torch implementation elsewhere that gives the same bits; callers pick
the kernel for contiguous float32 CPU tensors when numba is importable.

- the counter generator of `gracecomm.compressors.shared.stochastic` (`hash_array`, `uniform_array`);
- sign planes (`pack_signs`, `signs_sum`, `count_signs`), as `grace.wire.pack_bits(x < 0)`
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
from numba.cpython.unsafe.numbers import trailing_zeros

U32, U64, U8, F32 = np.uint32, np.uint64, np.uint8, np.float32
PARALLEL_MIN = 1 << 20
_BLOCK = 4096  # elements per block (stays in cache): a multiple of 8, whole packed groups
_BYTE_BITS = ((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(bool)  # [byte, lane]
_POOLS: dict[int, ThreadPoolExecutor] = {}


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


@numba.njit(inline="always")
def _accumulate(block, values, scale, first):  # pragma: no cover - compiled
    """block = values * scale for the first rank, block += values * scale for the others
    (both arrays indexed from 0, so the loop vectorises; times 1.0 is exact)."""
    if first:
        for j in range(block.size):
            block[j] = values[j] * scale
    else:
        for j in range(block.size):
            block[j] += values[j] * scale


@numba.njit(cache=True, nogil=True)
def _signs_sum(signs, tables, out, lo, hi):  # pragma: no cover - compiled
    """out[lo:hi] = the sum over ranks r of tables[r, byte, lane] for each element's sign
    byte and lane; a block at a time, so `out` is written once whatever the number of
    ranks, and a group of 8 is one row of the table (one vector load)."""
    values = np.empty(_BLOCK, dtype=np.float32)
    for b0 in range(lo, hi, _BLOCK):
        m = min(_BLOCK, hi - b0)
        g0 = b0 // 8
        block = out[b0:b0 + m]
        for r in range(len(signs)):
            plane, table = signs[r], tables[r]
            for g in range(m // 8):
                byte = plane[g0 + g]
                for lane in range(8):
                    values[8 * g + lane] = table[byte, lane]
            for k in range(m // 8 * 8, m):  # the tensor's last, partial group
                values[k] = table[plane[g0 + k // 8], k % 8]
            _accumulate(block, values, F32(1.0), r == 0)


def signs_sum(signs: tuple[np.ndarray, ...], lows: np.ndarray, highs: np.ndarray,
              n: int) -> np.ndarray:
    """float32 array of n values: the sum over ranks, in rank order, of `lows[r]` where rank
    r's sign plane has the bit set, else `highs[r]` (one rank: the decoded plane)."""
    out = np.empty(n, dtype=np.float32)
    # each rank's table of the 8 values of every sign byte, built once for every part
    tables = np.where(_BYTE_BITS, lows[:, None, None], highs[:, None, None]).astype(np.float32)
    _split(n, _signs_sum, lambda lo, hi: (signs, tables, out, lo, hi))
    return out


@numba.njit(cache=True, nogil=True)
def _count_bits(signs, counts):  # pragma: no cover - compiled
    for k in range(counts.size):
        counts[k] += (signs[k >> 3] >> U8(k & 7)) & U8(1)


def count_signs(signs: np.ndarray, counts: np.ndarray) -> None:
    """Add the sign plane's bits (1 where set) to the integer `counts` in place."""
    _split(counts.size, _count_bits, lambda lo, hi: (signs[lo // 8:(hi + 7) // 8],
                                                     counts[lo:hi]))


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


@numba.njit(inline="always")
def _nat9_patterns(exps, signs, out):  # pragma: no cover - compiled
    """(sign << 31) | (exponent << 23) into the uint32 `out`; the largest exponent byte."""
    top = U8(0)
    for k in range(exps.size):
        top = max(top, exps[k])
    groups = exps.size // 8
    words = out[:8 * groups].view(np.uint64)  # two float32 patterns per word
    e8 = exps[:8 * groups].view(np.uint64)
    for j in range(groups):
        s = U64(signs[j])
        e = e8[j]
        for q in range(4):
            lo = (((s >> U64(2 * q)) & U64(1)) << U64(31)) | (
                ((e >> U64(16 * q)) & U64(0xFF)) << U64(23))
            hi = (((s >> U64(2 * q + 1)) & U64(1)) << U64(63)) | (
                ((e >> U64(16 * q + 8)) & U64(0xFF)) << U64(55))
            words[4 * j + q] = lo | hi
    for k in range(8 * groups, exps.size):
        sign = U32(U32(signs[groups]) >> U32(k - 8 * groups)) & U32(1)
        out[k] = U32(sign << U32(31)) | U32(U32(exps[k]) << U32(23))
    return top


@numba.njit(cache=True, nogil=True)
def _nat9_sum(exps, signs, out, lo, hi):  # pragma: no cover - compiled
    """out[lo:hi] = the sum over ranks of the decoded float32 values, a block of patterns
    (in cache) at a time; the largest exponent byte."""
    patterns = np.empty(_BLOCK, dtype=np.uint32)
    values = patterns.view(np.float32)
    top = U8(0)
    for b0 in range(lo, hi, _BLOCK):
        m = min(_BLOCK, hi - b0)
        for r in range(len(exps)):
            top = max(top, _nat9_patterns(exps[r][b0:b0 + m],
                                          signs[r][b0 // 8:(b0 + m + 7) // 8], patterns[:m]))
            _accumulate(out[b0:b0 + m], values, F32(1.0), r == 0)
    return top


def nat9_sum(exps: tuple[np.ndarray, ...], signs: tuple[np.ndarray, ...],
             n: int) -> tuple[np.ndarray, int]:
    """(float32 sum over ranks, in rank order, of the values (sign << 31) | (exponent << 23)
    of the nat9 planes, largest exponent byte); 255 is a reserved code the caller rejects.
    One rank: the decoded values."""
    out = np.empty(n, dtype=np.float32)
    if n == 0:
        return out, 0
    tops = _split(n, _nat9_sum, lambda lo, hi: (exps, signs, out, lo, hi))
    return out, int(max(tops))


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


@numba.njit(cache=True, nogil=True)
def _dither_encode(x, scale, bucket, start, units, natural, k1, k2, bits, signs,
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
            for j in range(k, end):
                zbuf[j] = min(abs(x[b0 + j]) * factor, units)
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
        _pack_codes(cbuf, x[b0:b0 + m], m, bits, signs, codes, b0 // 8)


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
            x[lo:hi], scale, bucket, lo, F32(units), natural, k1, k2, bits,
            signs[lo // 8:(hi + 7) // 8], codes[lo // 8 * bits:(hi + 7) // 8 * bits]))
    return signs, codes


@numba.njit(inline="always")
def _group_word(codes, g, bits):  # pragma: no cover - compiled
    """The `bits` bytes of packed group g (8 codes) as one word; bytes past the end are 0."""
    word = U64(0)
    for b in range(min(bits, codes.size - g * bits)):
        word |= U64(codes[g * bits + b]) << U64(8 * b)
    return word


@numba.njit(inline="always")
def _group_levels(word, s, bits, lanes, signed, levels, at):  # pragma: no cover - compiled
    """The signed levels signed[code | negative << bits] of the first `lanes` codes of a
    group (packed `word`, sign byte `s`) into levels[at:]; the largest code."""
    top = U64(0)
    mask = U64((1 << bits) - 1)
    for lane in range(lanes):
        code = (word >> U64(bits * lane)) & mask
        top = max(top, code)
        levels[at + lane] = signed[code | (((s >> U64(lane)) & U64(1)) << U64(bits))]
    return top


@numba.njit(inline="always")
def _dither_levels(signs, codes, signed, g0, m, bits, levels):  # pragma: no cover - compiled
    """The m signed levels of the block of packed groups starting at group g0, into
    `levels`; the largest code. Whole groups unpack 8 constant lanes (vectorised)."""
    top = U64(0)
    for g in range(m // 8):
        word = U64(0)
        for b in range(bits):
            word |= U64(codes[(g0 + g) * bits + b]) << U64(8 * b)
        top = max(top, _group_levels(word, U64(signs[g0 + g]), bits, 8, signed, levels, 8 * g))
    if m % 8:  # the tensor's last, partial group
        g = m // 8
        top = max(top, _group_levels(_group_word(codes, g0 + g, bits), U64(signs[g0 + g]), bits,
                                     m % 8, signed, levels, 8 * g))
    return top


@numba.njit(cache=True, nogil=True)
def _dither_sum(signs, codes, norms, signed, bucket, width, out, lo,
                hi):  # pragma: no cover - compiled
    """out[lo:hi] = the sum over ranks of the signed levels times their bucket norms, a
    block at a time. `width` is a tuple of `bits` items, so bits = len(width) is a constant
    of each compiled kernel and the unpacking of a group of 8 codes vectorises."""
    bits = len(width)
    top = U64(0)
    levels = np.empty(_BLOCK, dtype=np.float32)
    for b0 in range(lo, hi, _BLOCK):
        m = min(_BLOCK, hi - b0)
        for r in range(len(codes)):
            top = max(top, _dither_levels(signs[r], codes[r], signed, b0 // 8, m, bits, levels))
            k = 0
            while k < m:  # segments of one bucket: a constant norm
                index = (b0 + k) // bucket
                end = min(m, (index + 1) * bucket - b0)
                _accumulate(out[b0 + k:b0 + end], levels[k:end], norms[r][index], r == 0)
                k = end
    return top


def dither_sum(signs: tuple[np.ndarray, ...], codes: tuple[np.ndarray, ...],
               norms: tuple[np.ndarray, ...], table: np.ndarray, bucket: int, n: int,
               bits: int) -> tuple[np.ndarray, int]:
    """(float32 sum over ranks, in rank order, of the values of the dithering planes (`bits`
    <= 8), largest level code), with `table[c]` the level of code c (codes past the table
    decode to 0 and are reported through the largest code, which the caller rejects). One
    rank: the decoded values."""
    out = np.empty(n, dtype=np.float32)
    if n == 0:
        return out, 0
    magnitudes = np.zeros(1 << bits, dtype=np.float32)
    magnitudes[:min(table.size, 1 << bits)] = table[:1 << bits]
    signed = np.concatenate([magnitudes, -magnitudes])  # index: code | negative << bits
    tops = _split(n, _dither_sum, lambda lo, hi: (
        signs, codes, norms, signed, bucket, (0,) * bits, out, lo, hi))
    return out, int(max(tops))


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
