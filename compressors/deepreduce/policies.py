"""Bloom-filter decoding policies (paper Sec. 4; thesis Sec. 5): how a receiver turns the
positives P of a Bloom filter (true and false, ascending) into a selection of indices.

- ``naive``: the first r of P, filled with the sent values in order (thesis: one false
  positive shifts every later value).
- ``p0``: all of P (no error; the sender sends |P| values).
- ``leftmost``, ``middle``, ``rightmost``: the first, middle or last r of P.
- ``p1``: the r members of P with the smallest shared-seed priority (random policy).
- ``p2``: conflict sets, paper Algorithm 1 (Sec. 4) made deterministic.

Priorities rho(x) = mix(x xor mix(sigma_step)) are identical on every rank; ties go by index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gracecomm.compressors.shared.stochastic import kernels_enabled
from gracecomm.validation import require_numba

MASK32 = 0xFFFFFFFF
POLICIES = ("naive", "p0", "leftmost", "middle", "rightmost", "p1", "p2")
P2_MODES = ("round_robin", "cover")


def mix(x: Any) -> Any:
    """This library's fixed 32-bit integer hash, the same on every rank (works on Python ints
    and int64 tensors alike; every product stays below 2**63)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def priority(positives: torch.Tensor, step_seed: int) -> torch.Tensor:
    """rho(x) = mix(x xor mix(sigma_step)) for every x in `positives`."""
    return mix(positives ^ mix(step_seed))


def priority_rank(positives: torch.Tensor, step_seed: int) -> torch.Tensor:
    """Position of each positive in the order of (rho, index): P is ascending, so a
    stable sort on rho breaks ties by index."""
    order = torch.sort(priority(positives, step_seed), stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return rank


# ---------------------------------------------------------------------------------------
# P2 kernels: sequential, compiled with numba where available. The same source runs as
# plain Python when numba is missing (slow but identical).
# ---------------------------------------------------------------------------------------

def _p2_round_robin(members: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
                    set_order: np.ndarray, by_rank: np.ndarray, r: int) -> np.ndarray:
    """Rounds over the conflict sets in (size, slot) order: drop selected members, discard
    emptied sets, else select the remaining member of smallest priority; stop at r.
    Members of each set are stored by increasing priority, so a pointer per set skips the
    selected ones."""
    selected = np.zeros(by_rank.size, dtype=np.bool_)
    pointer = starts.copy()
    active = set_order.copy()
    n_active, count = active.size, 0
    while count < r and n_active > 0:
        keep = 0
        for a in range(n_active):
            s = active[a]
            p, end = pointer[s], starts[s] + sizes[s]
            while p < end and selected[members[p]]:
                p += 1
            if p == end:
                continue
            selected[members[p]] = True
            count += 1
            pointer[s] = p + 1
            active[keep] = s
            keep += 1
            if count == r:
                return selected
        n_active = keep
    return selected


def _p2_cover(members: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
              set_order: np.ndarray, by_rank: np.ndarray, r: int) -> np.ndarray:
    """Thesis prioritisation: in (size, slot) order (initial singletons first), every set
    with no selected member contributes its member of smallest priority; then fill up to r
    from the unselected positives by priority."""
    selected = np.zeros(by_rank.size, dtype=np.bool_)
    count = 0
    for s in set_order:
        if count == r:
            return selected
        covered = False
        for p in range(starts[s], starts[s] + sizes[s]):
            if selected[members[p]]:
                covered = True
                break
        if not covered:
            selected[members[starts[s]]] = True
            count += 1
    for x in by_rank:
        if count == r:
            break
        if not selected[x]:
            selected[x] = True
            count += 1
    return selected


def _conflict_sets(positions: np.ndarray, rank: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The conflict sets of the |P| x k filter bits `positions` with counting sorts only:
    (members grouped by bit, each group by increasing priority; the groups' starts and
    sizes in bit order; the groups by (size, bit); the positives by priority), from the
    priority `rank` of every positive (a permutation of 0..|P|-1)."""
    count, k = positions.shape
    by_rank = np.empty(count, dtype=np.int64)
    for x in range(count):
        by_rank[rank[x]] = x
    slots = 0
    for x in range(count):
        for j in range(k):
            slots = max(slots, positions[x, j] + 1)
    fill = np.zeros(slots + 1, dtype=np.int64)
    for x in range(count):
        for j in range(k):
            fill[positions[x, j] + 1] += 1
    largest = 0
    for slot in range(slots):
        largest = max(largest, fill[slot + 1])
        fill[slot + 1] += fill[slot]
    members = np.empty(count * k, dtype=np.int64)
    for q in range(count):  # by priority: every group fills in priority order
        x = by_rank[q]
        for j in range(k):
            members[fill[positions[x, j]]] = x
            fill[positions[x, j]] += 1
    sets = 0  # fill[slot] is now the end of the slot's group
    for slot in range(slots):
        sets += fill[slot] > (fill[slot - 1] if slot else 0)
    starts = np.empty(sets, dtype=np.int64)
    sizes = np.empty(sets, dtype=np.int64)
    by_size = np.zeros(largest + 2, dtype=np.int64)
    s = 0
    for slot in range(slots):
        begin = fill[slot - 1] if slot else 0
        if fill[slot] > begin:
            starts[s], sizes[s] = begin, fill[slot] - begin
            by_size[sizes[s] + 1] += 1
            s += 1
    for size in range(largest + 1):
        by_size[size + 1] += by_size[size]
    set_order = np.empty(sets, dtype=np.int64)
    for s in range(sets):  # stable: equal sizes stay in bit order
        set_order[by_size[sizes[s]]] = s
        by_size[sizes[s]] += 1
    return members, starts, sizes, set_order, by_rank


_JITTED: dict[Callable[..., Any], Callable[..., Any]] = {}


def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` compiled by numba (once per process; cached on disk)."""
    if fn not in _JITTED:
        require_numba("the compiled P2 kernel", "kernel: python")
        import numba

        _JITTED[fn] = numba.njit(cache=True, nogil=True)(fn)
    return _JITTED[fn]


def p2_kernel(compiled: bool) -> Callable[[np.ndarray, np.ndarray, int, str], np.ndarray]:
    """Policy P2 on the |P| x k filter bits of the positives and their priority ranks: a
    bool mask over P; numba-compiled (`compiled`) or plain Python, the same source."""
    sets, round_robin, cover = (jit(f) if compiled else f
                                for f in (_conflict_sets, _p2_round_robin, _p2_cover))

    def p2(positions: np.ndarray, rank: np.ndarray, r: int, mode: str) -> np.ndarray:
        kernel = round_robin if mode == "round_robin" else cover
        return kernel(*sets(positions, rank), r)

    return p2


def conflict_selection(positions: torch.Tensor, rank: torch.Tensor, r: int, mode: str,
                       compiled: bool) -> torch.Tensor:
    """Policy P2 (paper Algorithm 1) on the |P| x k filter positions of the positives:
    conflict set C_j holds the positives that hash to bit j. Returns a bool mask over P."""
    mask = p2_kernel(compiled)(positions.cpu().numpy(), rank.cpu().numpy(), int(r), mode)
    return torch.from_numpy(mask).to(positions.device)


def select(policy: str, positives: torch.Tensor, r: int, step_seed: int,
           positions: Callable[[torch.Tensor], torch.Tensor], p2_mode: str = "round_robin",
           compiled: bool = True) -> torch.Tensor:
    """The ascending selection S~ of `policy` from the ascending positives P (|P| >= r).
    `positions(P)` gives the |P| x k filter bits of each positive (needed by P2 only)."""
    size = positives.numel()
    if policy == "p0" or r >= size:
        return positives
    if policy in ("naive", "leftmost"):
        return positives[:r]
    if policy == "rightmost":
        return positives[size - r:]
    if policy == "middle":
        start = (size - r) // 2
        return positives[start:start + r]
    if compiled and kernels_enabled(positives.device):
        from gracecomm.compressors.deepreduce.bloom_kernels import rank as kernel_rank

        rank = torch.from_numpy(kernel_rank(positives.numpy(), mix(step_seed)))
    else:
        rank = priority_rank(positives, step_seed)
    if policy == "p1":
        return positives[rank < r]
    return positives[conflict_selection(positions(positives), rank, r, p2_mode, compiled)]
