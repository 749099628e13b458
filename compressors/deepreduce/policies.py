"""Bloom-filter decoding policies (paper Sec. 4; thesis Sec. 5): how a receiver turns the
positives P of a Bloom filter (true and false, ascending) into a selection of indices.

- ``naive``: the first r of P, filled with the sent values in order (thesis: one false
  positive shifts every later value).
- ``p0``: all of P (no error; the sender sends |P| values).
- ``leftmost``, ``middle``, ``rightmost``: the first, middle or last r of P.
- ``p1``: the r members of P with the smallest shared-seed priority (random policy).
- ``p2``: conflict sets, paper Algorithm 1 made deterministic (spec Sec. 5).

Priorities rho(x) = mix(x xor mix(sigma_step)) are identical on every rank; ties go by index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from grace.validation import MissingDependency

MASK32 = 0xFFFFFFFF
POLICIES = ("naive", "p0", "leftmost", "middle", "rightmost", "p1", "p2")
P2_MODES = ("round_robin", "cover")


def mix(x: Any) -> Any:
    """The normative 32-bit integer hash of spec Sec. 5 (works on Python ints and int64
    tensors alike; every product stays below 2**63)."""
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


_KERNELS: dict[tuple[str, bool], Callable[..., np.ndarray]] = {}


def p2_kernel(mode: str, compiled: bool) -> Callable[..., np.ndarray]:
    """The P2 kernel for `mode`, numba-compiled (`compiled`) or plain Python."""
    key = (mode, compiled)
    if key not in _KERNELS:
        fn = _p2_round_robin if mode == "round_robin" else _p2_cover
        if compiled:
            try:
                import numba
            except ImportError:
                raise MissingDependency("the compiled P2 kernel needs numba: pip install "
                                        "'numba>=0.59', or set kernel: python") from None
            fn = numba.njit(cache=True, nogil=True)(fn)
        _KERNELS[key] = fn
    return _KERNELS[key]


def numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def conflict_selection(positions: torch.Tensor, rank: torch.Tensor, r: int, mode: str,
                       compiled: bool) -> torch.Tensor:
    """Policy P2 (paper Algorithm 1) on the |P| x k filter positions of the positives:
    conflict set C_j holds the positives that hash to bit j. Returns a bool mask over P."""
    count, k = positions.shape
    member = torch.arange(count, device=positions.device).repeat_interleave(k)
    slots = positions.reshape(-1)
    by_priority = torch.sort(rank[member], stable=True).indices
    by_slot = by_priority[torch.sort(slots[by_priority], stable=True).indices]
    _, sizes = torch.unique_consecutive(slots[by_slot], return_counts=True)
    starts = torch.cumsum(sizes, 0) - sizes
    set_order = torch.sort(sizes, stable=True).indices
    by_rank = torch.empty_like(rank)
    by_rank[rank] = torch.arange(count, device=rank.device)
    arrays = [t.cpu().numpy() for t in (member[by_slot], starts, sizes, set_order, by_rank)]
    mask = p2_kernel(mode, compiled)(*arrays, int(r))
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
    rank = priority_rank(positives, step_seed)
    if policy == "p1":
        return positives[rank < r]
    return positives[conflict_selection(positions(positives), rank, r, p2_mode, compiled)]
