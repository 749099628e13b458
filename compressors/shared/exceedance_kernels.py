"""Numba CPU kernels behind `gracecomm.compressors.shared.exceedance` (imported only when the
numba backend is used). Work is split into chunks of `CHUNK` elements, run on numba's threads
when the caller asks for them (``parallel`` True) and in the calling thread otherwise
(``parallel`` None, not False: numba compiles a kernel for each argument type and drops a
``parallel is not None`` branch when the argument is None, so the threaded kernels, whose
``prange`` loops take most of a cold cache's compile time, are compiled only by a process that
runs them; `gracecomm.compressors.shared.exceedance.threads` passes it); the float64
sums use reassociation only (no nnan/ninf), so NaN and Inf propagate into them.

The selection kernels read magnitude keys, the bit patterns of the elements with the sign
cleared and every NaN pattern lowered to one key above Inf
(`gracecomm.compressors.shared.exceedance.KeyLayout`), through the signed integer view of the
tensor (int16, int32 or int64). A key is a hit when lo <= key <= lo + span, tested as the
unsigned comparison key - lo <= span. Blocks of `LANES` keys are tested as one vector and
their hits written with compress-store (`gracecomm.compressors.shared.simd_kernels`), so the
pass costs about one read of the tensor at any hit density.

Unless the user chose a threading layer (NUMBA_THREADING_LAYER), the kernels use numba's
``workqueue`` layer: OpenMP worker threads keep spinning after each parallel region and, next
to torch's own pool on a few cores, slowed the surrounding work by up to 10x. It must not be
entered from several Python threads at once: the callers in
`gracecomm.compressors.shared.exceedance` launch parallel kernels under one lock (`threads`).
"""

import math
import os

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from gracecomm.compressors.shared.exceedance import CHUNK
from gracecomm.compressors.shared.simd_kernels import (
    LANES,
    compress_store,
    data_pointer,
    load_lanes,
    popcount,
    splat,
)

if numba.config.THREADING_LAYER == "default" and "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"


def use_torch_threads() -> None:
    """Run the kernels on as many threads as torch may use (launchers set that per rank)."""
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))

_FAST = {"reassoc", "contract", "nsz"}


@intrinsic
def _float_bits(typingctx, v):
    """The bits of a float64 as int64 (a bitcast, which vectorizes)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def _bits_float(typingctx, b):
    """The float64 whose bits are the int64 `b`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


_LN2 = math.log(2.0)
_FRACTION = (1 << 52) - 1  # float64 fraction bits
_SQRT2_FRACTION = 0x6A09E667F3BCD  # the fraction bits of sqrt(2)
_BITS_OF_ONE = 0x3FF0000000000000
_SMALLEST_NORMAL = 2.2250738585072014e-308  # float64 subnormals are scaled by 2^52 first
_SCALE_SUBNORMAL = 4503599627370496.0


@numba.njit(fastmath=_FAST, error_model="numpy", inline="always")
def _ln(a):  # pragma: no cover - compiled
    """ln a (a > 0 finite) in float64 without a call, so that a loop over it vectorizes:
    a = m 2^e with m in [1/sqrt 2, sqrt 2) read from its bits, and ln m = 2 atanh(f),
    f = (m - 1) / (m + 1), |f| < 0.172, by the series to f^17 (the terms left out are
    below 1e-15)."""
    tiny = a < _SMALLEST_NORMAL
    bits = _float_bits(a * _SCALE_SUBNORMAL if tiny else a)
    fraction = bits & _FRACTION
    high = fraction > _SQRT2_FRACTION  # m >= sqrt 2: halve it
    exponent = (bits >> 52) - (1075 if tiny else 1023) + high
    m = _bits_float(fraction | (_BITS_OF_ONE - (np.int64(high) << 52)))
    f = (m - 1.0) / (m + 1.0)
    f2 = f * f
    return exponent * _LN2 + f * (2.0 + f2 * (2.0 / 3 + f2 * (2.0 / 5 + f2 * (2.0 / 7 + f2 * (
        2.0 / 9 + f2 * (2.0 / 11 + f2 * (2.0 / 13 + f2 * (2.0 / 15 + f2 * (2.0 / 17)))))))))


@numba.njit(fastmath=_FAST, cache=True)
def _chunk_moments(y, lo):  # pragma: no cover - compiled
    count = 0
    s1 = 0.0
    s2 = 0.0
    for i in range(y.size):
        e = np.float64(abs(y[i])) - lo
        hit = not e <= 0.0  # true for NaN
        e = e if hit else 0.0
        count += hit
        s1 += e
        s2 += e * e
    return count, s1, s2


@numba.njit(fastmath=_FAST, error_model="numpy", cache=True)
def _chunk_log_sum(y, lo):  # pragma: no cover - compiled
    """Sum of ln|y| over the exceedances |y| > lo of one chunk (after `_chunk_moments`
    read it: a second loop over the chunk in cache, since one loop doing both ran slower)."""
    total = 0.0
    for i in range(y.size):
        a = np.float64(abs(y[i]))
        total += _ln(a) if a > lo else 0.0
    return total


@numba.njit(cache=True)
def _moments_chunk(x, lo, c, out):  # pragma: no cover - compiled
    chunk = x[c * CHUNK:min(x.size, (c + 1) * CHUNK)]
    out[c, 0], out[c, 1], out[c, 2] = _chunk_moments(chunk, lo)
    if out.shape[1] == 4:
        out[c, 3] = _chunk_log_sum(chunk, lo)


@numba.njit(parallel=True, cache=True)
def _moments_threads(x, lo, out):  # pragma: no cover - compiled
    for c in numba.prange(out.shape[0]):
        _moments_chunk(x, lo, c, out)


@numba.njit(cache=True)
def moments(x, lo, parallel, logs):  # pragma: no cover - compiled
    """(count, sum, sum of squares) of |x| - lo over the elements with |x| > lo, and with
    `logs` the sum of ln|x| over them (else 0), chunk by chunk."""
    out = np.zeros(((x.size + CHUNK - 1) // CHUNK, 4 if logs else 3))
    if parallel is not None:
        _moments_threads(x, lo, out)
    else:
        for c in range(out.shape[0]):
            _moments_chunk(x, lo, c, out)
    return (int(out[:, 0].sum()), out[:, 1].sum(), out[:, 2].sum(),
            out[:, 3].sum() if logs else 0.0)


# -- selection by magnitude keys -----------------------------------------------------------
def _key_hits(context, builder, array_type, y, start, mask, top, lo,  # type: ignore[no-untyped-def]
              span):
    """(block, hits) for the LANES keys of y[start:start + LANES]: the elements' bits and
    the lanes whose key (`_key`) is a hit, lo <= key <= lo + span."""
    block = load_lanes(context, builder, array_type, y, start)
    vt = block.type
    key = builder.and_(block, splat(builder, mask, vt))
    top_s = splat(builder, top, vt)
    key = builder.select(builder.icmp_unsigned(">", key, top_s), top_s, key)
    hits = builder.icmp_unsigned("<=", builder.sub(key, splat(builder, lo, vt)),
                                 splat(builder, span, vt))
    return block, hits


@intrinsic
def _compress_block(typingctx, y, start, mask, top, lo, span, offsets, raw, n, sparse,
                    source):
    """Test the LANES keys of y[start:start + LANES] and append the hits' offsets (int32)
    and elements (y's bits) at position n of `offsets` and `raw`; returns n plus the number
    of hits. The offsets are start + lane, or with a `source` array (not None) the
    source's own entries at those places (filtering a slot in place, n <= start). With
    `sparse` (few hits expected) a block without hits skips the stores: a predictable
    branch then, an unpredictable one at higher densities."""
    sig = types.int64(y, start, mask, top, lo, span, offsets, raw, n, sparse, source)

    def codegen(context, builder, signature, args):
        (y_arg, start_v, mask_v, top_v, lo_v, span_v, off_arg, raw_arg, n_v, sparse_v,
         source_arg) = args
        block, hits = _key_hits(context, builder, signature.args[0], y_arg, start_v, mask_v,
                                top_v, lo_v, span_v)
        if isinstance(signature.args[10], types.NoneType):
            i32 = ir.IntType(32)
            iv = ir.VectorType(i32, LANES)
            lane = ir.Constant(iv, [ir.Constant(i32, i) for i in range(LANES)])
            where = builder.add(splat(builder, start_v, iv), lane)
        else:
            where = load_lanes(context, builder, signature.args[10], source_arg, start_v)
        any_hit = builder.icmp_unsigned("!=", builder.bitcast(hits, ir.IntType(LANES)),
                                        ir.Constant(ir.IntType(LANES), 0))
        with builder.if_then(builder.or_(builder.not_(sparse_v), any_hit)):
            compress_store(builder, where, data_pointer(context, builder, signature.args[6],
                                                        off_arg, n_v), hits)
            compress_store(builder, block, data_pointer(context, builder, signature.args[7],
                                                        raw_arg, n_v), hits)
        return builder.add(n_v, popcount(builder, hits))

    return sig, codegen


@intrinsic
def _count_block(typingctx, y, start, mask, top, lo, span):
    """The number of hits among the LANES keys of y[start:start + LANES] (`_compress_block`
    without the stores). Inside `_chunk_collect` a scalar loop counting the same was left
    unvectorized, and a selection whose buffers filled up early read at a fifth of the
    speed of one that did not."""
    sig = types.int64(y, start, mask, top, lo, span)

    def codegen(context, builder, signature, args):
        _, hits = _key_hits(context, builder, signature.args[0], *args)
        return popcount(builder, hits)

    return sig, codegen


@numba.njit(cache=True)
def count_key(x, mask, key):  # pragma: no cover - compiled
    """Number of elements of the key view x whose key (sign cleared) equals `key`."""
    n = 0
    for i in range(x.size):
        n += (np.int64(x[i]) & mask) == key
    return n


STRIDE = 8 * LANES  # elements between two checks of the buffer's room
SPARSE_CAP = CHUNK // 128  # per-chunk buffers this small: hits sparse enough to branch on


@numba.njit(inline="always")
def _key(v, mask, top):  # pragma: no cover - compiled
    return min(np.int64(v) & mask, top)


@numba.njit(cache=True)
def _chunk_collect(y, mask, top, lo, span, offsets, raw, sparse):  # pragma: no cover
    """Hits of y: offsets (int32) and elements written while `offsets` has room for a
    whole block, then only counted. Returns (hits, hits written)."""
    n = 0
    room = offsets.size - STRIDE
    full = y.size - y.size % STRIDE
    s = 0
    while s < full and n <= room:  # room checked once per STRIDE elements
        for b in range(s, s + STRIDE, LANES):
            n = _compress_block(y, b, mask, top, lo, span, offsets, raw, n, sparse, None)
        s += STRIDE
    written = n
    for b in range(s, full, LANES):  # out of room: count the rest
        n += _count_block(y, b, mask, top, lo, span)
    for i in range(full, y.size):
        if np.uint64(_key(y[i], mask, top) - lo) <= np.uint64(span):
            if written == n and n < offsets.size:
                offsets[n] = i
                raw[n] = y[i]
                written += 1
            n += 1
    return n, written


@numba.njit(cache=True)
def _slot_sums(values, start, n, lo, sums, c):  # pragma: no cover - compiled
    """The moments over lo of a slot's entries values[start:start + n] into row c of
    `sums`, when it has rows: taken while the slot is still in cache."""
    if sums.shape[0]:
        sums[c, 0], sums[c, 1], sums[c, 2] = _chunk_moments(values[start:start + n], lo)


@numba.njit(cache=True)
def _fill_chunk(x, mask, top, lo, span, c, offsets, raw, bounds, counts, written, values,
                sums_lo, sums):  # pragma: no cover - compiled
    """Pass 1 for chunk c: its hits into its slot bounds[c]:bounds[c + 1] of the buffers
    (whose size says whether hits are sparse), and their moments over sums_lo when `sums`
    has rows (`values`: `raw` viewed as floats) and the slot held them all."""
    start, stop = bounds[c], bounds[c + 1]
    counts[c], written[c] = _chunk_collect(
        x[c * CHUNK:min(x.size, (c + 1) * CHUNK)], mask, top, lo, span,
        offsets[start:stop], raw[start:stop], stop - start - STRIDE <= SPARSE_CAP)
    if written[c] == counts[c]:
        _slot_sums(values, start, counts[c], sums_lo, sums, c)


@numba.njit(cache=True)
def _place_chunk(c, offsets, raw, bounds, counts, starts, positions,
                 out_raw):  # pragma: no cover - compiled
    """Pass 2 for chunk c: its hits, every one in its slot, at their place in the result."""
    m, o, base, slot = counts[c], starts[c], c * CHUNK, bounds[c]
    for j in range(m):
        positions[o + j] = offsets[slot + j] + base
        out_raw[o + j] = raw[slot + j]


@numba.njit(parallel=True, cache=True)
def _fill_threads(x, mask, top, lo, span, offsets, raw, bounds, counts, written, values,
                  sums_lo, sums):  # pragma: no cover - compiled
    for c in numba.prange(counts.size):
        _fill_chunk(x, mask, top, lo, span, c, offsets, raw, bounds, counts, written, values,
                    sums_lo, sums)


@numba.njit(parallel=True, cache=True)
def _place_threads(offsets, raw, bounds, counts, starts, positions,
                   out_raw):  # pragma: no cover - compiled
    for c in numba.prange(counts.size):
        _place_chunk(c, offsets, raw, bounds, counts, starts, positions, out_raw)


@numba.njit(cache=True)
def slot_bounds(sizes):  # pragma: no cover - compiled
    """Where each chunk's slot starts and the last one ends, for slots of `sizes` hits
    (each with the room a block's stores need)."""
    bounds = np.zeros(sizes.size + 1, np.int64)
    for c in range(sizes.size):
        bounds[c + 1] = bounds[c] + sizes[c] + STRIDE
    return bounds


@numba.njit(cache=True)
def fill(x, mask, top, lo, span, offsets, raw, bounds, counts, written, parallel, values,
         sums_lo, sums):  # pragma: no cover - compiled
    """Pass 1 of `collect`: every chunk's hits into its slot of the buffers `offsets` and
    `raw` (slot c is bounds[c]:bounds[c + 1], counts.size slots), their number into
    `counts` and how many were written into `written`; with rows in `sums` (one per
    slot), each slot's moments over sums_lo (`_slot_sums`; `values` is `raw` viewed as
    floats). Chunks run on numba's threads when `parallel` is True (not None)."""
    if parallel is not None:
        _fill_threads(x, mask, top, lo, span, offsets, raw, bounds, counts, written, values,
                      sums_lo, sums)
    else:
        for c in range(counts.size):
            _fill_chunk(x, mask, top, lo, span, c, offsets, raw, bounds, counts, written,
                        values, sums_lo, sums)


@numba.njit(cache=True)
def _refill_chunk(x, mask, top, lo, span, c, offsets, raw, bounds, counts, written,
                  new_offsets, new_raw, new_bounds, values, sums_lo,
                  sums):  # pragma: no cover - compiled
    """Chunk c into its slot of the new buffers: collected again if its old slot
    overflowed, else its hits copied over (their sums are the first pass's)."""
    if written[c] < counts[c]:
        _fill_chunk(x, mask, top, lo, span, c, new_offsets, new_raw, new_bounds, counts,
                    written, values, sums_lo, sums)
    else:
        old, new, m = bounds[c], new_bounds[c], counts[c]
        new_offsets[new:new + m] = offsets[old:old + m]
        new_raw[new:new + m] = raw[old:old + m]


@numba.njit(parallel=True, cache=True)
def _refill_threads(x, mask, top, lo, span, offsets, raw, bounds, counts, written, new_offsets,
                    new_raw, new_bounds, values, sums_lo, sums):  # pragma: no cover - compiled
    for c in numba.prange(counts.size):
        _refill_chunk(x, mask, top, lo, span, c, offsets, raw, bounds, counts, written,
                      new_offsets, new_raw, new_bounds, values, sums_lo, sums)


@numba.njit(cache=True)
def refill(x, mask, top, lo, span, offsets, raw, bounds, counts, written, new_offsets, new_raw,
           new_bounds, parallel, values, sums_lo, sums):  # pragma: no cover - compiled
    """After `fill`: every chunk's hits into new buffers whose slots (`new_bounds`) hold
    them all, rescanning only the chunks whose slot overflowed (`values`: `new_raw`
    viewed as floats; `sums` the rows `fill` wrote)."""
    if parallel is not None:
        _refill_threads(x, mask, top, lo, span, offsets, raw, bounds, counts, written,
                        new_offsets, new_raw, new_bounds, values, sums_lo, sums)
    else:
        for c in range(counts.size):
            _refill_chunk(x, mask, top, lo, span, c, offsets, raw, bounds, counts, written,
                          new_offsets, new_raw, new_bounds, values, sums_lo, sums)


@numba.njit(cache=True)
def place(offsets, raw, bounds, counts, positions, out_raw,
          parallel):  # pragma: no cover - compiled
    """Pass 2 of `collect`: the hits, every one in its slot (after `refill` where a slot
    overflowed), at their place in `positions` (int64) and `out_raw`, sized
    counts.sum()."""
    starts = np.zeros(counts.size + 1, np.int64)
    for c in range(counts.size):
        starts[c + 1] = starts[c] + counts[c]
    if parallel is not None:
        _place_threads(offsets, raw, bounds, counts, starts, positions, out_raw)
    else:
        for c in range(counts.size):
            _place_chunk(c, offsets, raw, bounds, counts, starts, positions, out_raw)


@numba.njit(cache=True)
def collect(x, mask, top, lo, span, cap, limit, parallel):  # pragma: no cover - compiled
    """(count, ascending int64 positions, elements) of the hits of the key view `x`; the
    positions and elements only when count <= limit (else empty arrays). `cap` sizes the
    per-chunk slots; the chunks with more hits are collected again (`refill`). For
    `top_k`'s small candidate sets: large results are collected by `fill` and `place` into
    buffers numpy allocates (`gracecomm.compressors.shared.exceedance`)."""
    chunks = (x.size + CHUNK - 1) // CHUNK
    bounds = slot_bounds(np.full(chunks, cap, np.int64))
    offsets = np.empty(bounds[-1], np.int32)
    raw = np.empty(bounds[-1], x.dtype)
    counts = np.zeros(chunks, np.int64)
    written = np.zeros(chunks, np.int64)
    none = np.empty((0, 3))
    fill(x, mask, top, lo, span, offsets, raw, bounds, counts, written, parallel, raw, 0.0,
         none)
    total = counts.sum()
    if total > limit:
        return total, np.empty(0, np.int64), np.empty(0, x.dtype)
    if (written < counts).any():
        new_bounds = slot_bounds(counts)
        new_offsets = np.empty(new_bounds[-1], np.int32)
        new_raw = np.empty(new_bounds[-1], x.dtype)
        refill(x, mask, top, lo, span, offsets, raw, bounds, counts, written, new_offsets,
               new_raw, new_bounds, parallel, new_raw, 0.0, none)
        offsets, raw, bounds = new_offsets, new_raw, new_bounds
    positions = np.empty(total, np.int64)
    out_raw = np.empty(total, x.dtype)
    place(offsets, raw, bounds, counts, positions, out_raw, parallel)
    return total, positions, out_raw


# -- pools: the slots `fill` wrote, filtered in place -----------------------------------------
@numba.njit(cache=True)
def _keep_slot(offsets, raw, mask, top, lo, span, count):  # pragma: no cover - compiled
    """The first `count` entries of one slot reduced in place to the hits; their number."""
    n = 0
    full = count - count % LANES
    for b in range(0, full, LANES):
        n = _compress_block(raw, b, mask, top, lo, span, offsets, raw, n, False, offsets)
    for i in range(full, count):
        if np.uint64(_key(raw[i], mask, top) - lo) <= np.uint64(span):
            offsets[n] = offsets[i]
            raw[n] = raw[i]
            n += 1
    return n


@numba.njit(cache=True)
def _keep_chunk(offsets, raw, bounds, counts, mask, top, lo, span, c, values, sums_lo,
                sums):  # pragma: no cover - compiled
    start, stop = bounds[c], bounds[c + 1]
    counts[c] = _keep_slot(offsets[start:stop], raw[start:stop], mask, top, lo, span,
                           counts[c])
    _slot_sums(values, start, counts[c], sums_lo, sums, c)


@numba.njit(parallel=True, cache=True)
def _keep_threads(offsets, raw, bounds, counts, mask, top, lo, span, values, sums_lo,
                  sums):  # pragma: no cover - compiled
    for c in numba.prange(counts.size):
        _keep_chunk(offsets, raw, bounds, counts, mask, top, lo, span, c, values, sums_lo,
                    sums)


@numba.njit(cache=True)
def keep(offsets, raw, bounds, counts, mask, top, lo, span, parallel, values, sums_lo,
         sums):  # pragma: no cover - compiled
    """Every slot of a pool (`fill`'s buffers, every entry written) reduced in place to
    its hits, `counts` updated; with rows in `sums`, the moments of what each slot kept
    over sums_lo, as `fill` takes them."""
    if parallel is not None:
        _keep_threads(offsets, raw, bounds, counts, mask, top, lo, span, values, sums_lo,
                      sums)
    else:
        for c in range(counts.size):
            _keep_chunk(offsets, raw, bounds, counts, mask, top, lo, span, c, values, sums_lo,
                        sums)


RADIX = 12  # bits of key resolved per histogram round of `_kth_largest`


@numba.njit(cache=True)
def _kth_largest(work, k):  # pragma: no cover - compiled
    """The k-th largest of the int64 keys `work` (overwritten), by rounds of a histogram
    of 2^RADIX buckets over the keys' current range, each keeping only the bucket that
    holds the k-th largest: O(size) for any distribution of keys."""
    n = work.size
    hist = np.empty(1 << RADIX, np.int64)
    while True:
        lo, hi = work[0], work[0]
        for i in range(1, n):
            lo, hi = min(lo, work[i]), max(hi, work[i])
        if lo == hi:
            return lo
        shift = 0
        while (hi - lo) >> shift >= 1 << RADIX:
            shift += 1
        hist[:] = 0
        for i in range(n):
            hist[(work[i] - lo) >> shift] += 1
        b = (hi - lo) >> shift
        while hist[b] < k:
            k -= hist[b]
            b -= 1
        if shift == 0:
            return lo + b
        m = 0
        for i in range(n):
            if (work[i] - lo) >> shift == b:
                work[m] = work[i]
                m += 1
        n = m


@numba.njit(cache=True)
def pick(positions, raw, k, mask, top):  # pragma: no cover - compiled
    """(positions, elements) of the k largest keys among the elements `raw` at
    `positions`, in the given order; among equal keys the earliest. 0 < k <= raw.size."""
    m = positions.size
    work = np.empty(m, np.int64)
    for i in range(m):
        work[i] = _key(raw[i], mask, top)
    v = _kth_largest(work, k)
    need = k
    for i in range(m):
        need -= _key(raw[i], mask, top) > v
    out, out_raw = np.empty(k, positions.dtype), np.empty(k, raw.dtype)
    j = 0
    for i in range(m):
        key = _key(raw[i], mask, top)
        if key > v or (key == v and need > 0):
            need -= key == v
            out[j], out_raw[j] = positions[i], raw[i]
            j += 1
    return out, out_raw


@numba.njit(cache=True)
def _sample(x, mask, top, s):  # pragma: no cover - compiled
    """Keys of s elements, one drawn from each of s equal strides of x (a fixed LCG)."""
    stride = x.size // s
    out = np.empty(s, np.int64)
    h = np.uint32(0x9E3779B9)
    for i in range(s):
        h = np.uint32(h * np.uint32(1664525) + np.uint32(1013904223))
        out[i] = _key(x[i * stride + np.int64(h >> np.uint32(8)) % stride], mask, top)
    return out


@numba.njit(cache=True)
def _ties(x, mask, top, above, v, need):  # pragma: no cover - compiled
    """(positions, elements): the ascending merge of the positions `above` (every key > v)
    and the first `need` positions whose key is v."""
    equal = np.empty(need, np.int64)
    j = 0
    for i in range(x.size):
        if j == need:
            break
        if _key(x[i], mask, top) == v:
            equal[j] = i
            j += 1
    out = np.empty(above.size + need, np.int64)
    a = e = 0
    for o in range(out.size):
        if e == need or (a < above.size and above[a] < equal[e]):
            out[o] = above[a]
            a += 1
        else:
            out[o] = equal[e]
            e += 1
    return out, x[out]


@numba.njit(cache=True)
def top_k(x, k, mask, top, s, parallel):  # pragma: no cover - compiled
    """(ascending positions, elements) of the k largest keys of the key view x
    (0 < k < x.size); among equal keys the lowest positions.

    The threshold t is the r-th largest key of a sample of s keys, r chosen so that at
    least k keys reach t with high probability; the keys >= t are collected in one pass and
    the k largest picked among them. A guess that collects fewer than k keys, or more than
    `limit`, narrows [lo, hi) with count(key >= lo) >= k > count(key >= hi); when hi = lo + 1
    the k-th key is lo and ties at lo go to the lowest positions."""
    d = x.size
    sample = _sample(x, mask, top, s)
    mean = s * k / d
    rank = min(s, int(mean + 4.0 * math.sqrt(mean) + 4.0))
    expected = max(k, rank * d // s)
    limit = max(2 * expected, expected + 4096)
    cap = min(CHUNK, 2 * expected * CHUNK // d + 16)
    lo, hi = np.int64(0), top + 1
    above = np.empty(0, np.int64)
    last_low = False
    while hi > lo + 1:
        t = np.partition(sample, s - rank)[s - rank] if rank <= s else lo
        if last_low and lo + 1 < hi:  # too many at lo: are they ties?
            t = lo + 1
        elif not lo < t < hi:
            t = lo + (hi - lo) // 2
        count, positions, raw = collect(x, mask, top, t, top - t, cap, limit, parallel)
        if count < k:
            hi, above, last_low = t, positions, False
            rank = min(4 * rank + 16, s + 1)
        elif count <= limit:
            return pick(positions, raw, k, mask, top)
        else:
            lo, last_low = t, not last_low
            rank = max(1, rank // 4)
    return _ties(x, mask, top, above, lo, k - above.size)
