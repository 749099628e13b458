"""Numba kernels of the Bloom-filter index codec (`gracecomm.compressors.deepreduce.bloom`):
insert, query and the filter bits of given elements, one call per tensor each, with the bits
of the torch code: the hash `mix` of `policies`, the slice salts of `bloom.HashFamily` and
the LSB-first bit stream of `gracecomm.wire`. Imported only when numba is installed.

``x mod w`` is Lemire's exact "fastmod" (Lemire, Kaser, Kurz, *Faster remainder by direct
computation*, 2019): with M = floor((2^64 - 1) / w) + 1, x mod w = ((M x mod 2^64) w) >> 64
for every 32-bit x and w, the 128-bit product formed from 32-bit halves; unlike a division
it vectorises, so the query hashes a whole block of elements per vector loop.
"""

import numba
import numpy as np

from gracecomm.compressors.deepreduce import policies
from gracecomm.compressors.shared.simd_kernels import LANES, compress

U8, U32, U64 = np.uint8, np.uint32, np.uint64
BLOCK = 4096  # elements the query takes through the slices together


@numba.njit(inline="always")
def _mix(x):  # pragma: no cover - compiled
    x = U32(x ^ (x >> U32(16)))
    x = U32(x * U32(0x7FEB352D))
    x = U32(x ^ (x >> U32(15)))
    x = U32(x * U32(0x2C1B3C6D))
    return U32(x ^ (x >> U32(16)))


@numba.njit(inline="always")
def _mod(x, w, m):  # pragma: no cover - compiled
    """x mod w for 32-bit x and w, with m = floor((2^64 - 1) / w) + 1."""
    low = U64(m * U64(x))
    return ((low >> U64(32)) * U64(w) + (((low & U64(0xFFFFFFFF)) * U64(w)) >> U64(32))) \
        >> U64(32)


@numba.njit(inline="always")
def _slot(x, salt, w, m, i):  # pragma: no cover - compiled
    """The bit of element x in slice i: i w + mix(x xor salt_i) mod w."""
    return np.int64(i) * w + np.int64(_mod(_mix(U32(x) ^ salt), w, m))


@numba.njit(inline="always")
def _test(bits, p):  # pragma: no cover - compiled
    return (bits[p >> 3] >> U8(p & 7)) & U8(1)


@numba.njit(cache=True, nogil=True)
def insert(indices, salts, w, m):  # pragma: no cover - compiled
    """The packed filter (k w bits, LSB-first) of the elements `indices`."""
    k = salts.size
    bits = np.zeros((k * w + 7) // 8, np.uint8)
    for x in indices:
        for i in range(k):
            p = _slot(x, salts[i], w, m, i)
            bits[p >> 3] |= U8(1) << U8(p & 7)
    return bits


@numba.njit(cache=True, nogil=True)
def slots(elements, salts, w, m):  # pragma: no cover - compiled
    """The |elements| x k filter bits of `elements`."""
    k = salts.size
    out = np.empty((elements.size, k), np.int64)
    for j in range(elements.size):
        for i in range(k):
            out[j, i] = _slot(elements[j], salts[i], w, m, i)
    return out


@numba.njit(cache=True, nogil=True)
def query(bits, salts, w, m, d, expected):  # pragma: no cover - compiled
    """Ascending positives among 0..d-1 (every slice bit set); `expected` sizes the first
    buffer. Blocks of BLOCK elements go through the slices one at a time: each slice is
    tested for all remaining candidates in one vector loop and the survivors (about half)
    compacted with compress-store, so no branch depends on a bit."""
    k = salts.size
    words = np.zeros((bits.size + 3) // 4, np.uint32)  # 32-bit loads: vector gathers
    words.view(np.uint8)[:bits.size] = bits
    out = np.empty(max(LANES, expected), np.int64)
    n = 0
    candidates = np.empty(BLOCK + LANES, np.int32)  # offsets in the block
    where = np.empty(BLOCK, np.int64)
    flags = np.zeros(BLOCK + LANES, np.uint8)
    for start in range(0, d, BLOCK):
        size = min(BLOCK, d - start)
        for j in range(size):
            candidates[j] = j
        for i in range(k):
            salt = salts[i]
            for j in range(size):  # hashing alone: one vector loop
                where[j] = _slot(start + candidates[j], salt, w, m, i)
            for j in range(size):
                flags[j] = (words[where[j] >> 5] >> U32(where[j] & 31)) & U32(1)
            flags[size:size + LANES] = 0
            kept = 0
            for j in range(0, size, LANES):
                kept = compress(candidates, flags, j, candidates, kept)
            size = kept
        if n + size > out.size:
            grown = np.empty(max(2 * out.size, n + size), np.int64)
            grown[:n] = out[:n]
            out = grown
        for j in range(size):
            out[n + j] = start + candidates[j]
        n += size
    return out[:n]


@numba.njit(cache=True, nogil=True)
def rank(positives, salt):  # pragma: no cover - compiled
    """The position of every positive in the order of (rho, index), rho(x) =
    mix(x xor salt): `policies.priority_rank` (a stable sort of the ascending P)."""
    priority = np.empty(positives.size, np.uint32)
    for i in range(positives.size):
        priority[i] = _mix(U32(positives[i]) ^ U32(salt))
    order = np.argsort(priority, kind="mergesort")
    out = np.empty(positives.size, np.int64)
    for q in range(order.size):
        out[order[q]] = q
    return out


@numba.njit(cache=True, nogil=True)
def member(a, b):  # pragma: no cover - compiled
    """For ascending `a` and `b`: which elements of `a` are in `b` (a merge)."""
    out = np.zeros(a.size, np.bool_)
    j = 0
    for i in range(a.size):
        while j < b.size and b[j] < a[i]:
            j += 1
        out[i] = j < b.size and b[j] == a[i]
    return out


_conflict_sets = policies.jit(policies._conflict_sets)
_round_robin = policies.jit(policies._p2_round_robin)
_cover = policies.jit(policies._p2_cover)


@numba.njit(cache=True, nogil=True)
def p2(positives, salts, w, m, r, salt, round_robin):  # pragma: no cover - compiled
    """Policy P2 in one call: priorities, filter bits and conflict sets of the ascending
    positives, then Algorithm 1 (`round_robin`) or the thesis' cover; the r chosen,
    ascending."""
    sets = _conflict_sets(slots(positives, salts, w, m), rank(positives, salt))
    chosen = _round_robin(*sets, r) if round_robin else _cover(*sets, r)
    return positives[chosen]


P0, P2_ROUND_ROBIN, P2_COVER = 0, 1, 2  # the policies `sender` and `receiver` apply


@numba.njit(cache=True, nogil=True)
def _choose(positives, salts, w, m, r, salt, policy):  # pragma: no cover - compiled
    if policy == P0 or r >= positives.size:
        return positives
    return p2(positives, salts, w, m, r, salt, policy == P2_ROUND_ROBIN)


@numba.njit(cache=True, nogil=True)
def sender(indices, salts, w, m, d, salt, policy):  # pragma: no cover - compiled
    """The sender's whole codec in one call: (packed filter, number of positives, the
    selection of `policy` (P0 or P2), which of it is true and how many)."""
    packed = insert(indices, salts, w, m)
    positives = query(packed, salts, w, m, d, 2 * indices.size + LANES)
    chosen = _choose(positives, salts, w, m, indices.size, salt, policy)
    true = member(chosen, indices)
    return packed, positives.size, chosen, true, np.count_nonzero(true)


@numba.njit(cache=True, nogil=True)
def receiver(packed, salts, w, m, d, n, salt, policy):  # pragma: no cover - compiled
    """The receiver's decoding in one call: (number of positives, the selection of n; empty
    when there are fewer than n positives)."""
    positives = query(packed, salts, w, m, d, n + LANES)
    if n > positives.size:
        return positives.size, positives[:0]
    return positives.size, _choose(positives, salts, w, m, n, salt, policy)


def hash_args(salts: list[int], w: int) -> tuple[np.ndarray, int, np.uint64]:
    """(salts, w, M) as the kernels take them; M = floor((2^64 - 1) / w) + 1 of `_mod`."""
    return np.array(salts, dtype=np.uint32), w, np.uint64(((1 << 64) - 1) // w + 1 & (2**64 - 1))
