"""Shared-seed randomness: every rank derives the same seed for the same (tensor, call) so
that random choices (Random-k indices, Bloom-filter priorities, leaders) agree without being
sent. Seeds come from BLAKE2b, never from Python's per-process salted `hash()`."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from gracecomm.state import Stateful


def stable_hash(*parts: Any) -> int:
    """A 63-bit hash of `parts` that is identical in every process and on every machine."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SharedStreams(Stateful):
    """Per-tensor call counters from which shared seeds are derived: seed s = H(base, name, c)
    for the c-th call with `name`. Ranks agree as long as each compresses the same tensors
    the same number of times, which the pipeline guarantees."""

    state_attrs = ("seed", "counters")

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self.counters: dict[str, int] = {}

    def next_seed(self, name: str) -> int:
        count = self.counters.get(name, 0)
        self.counters[name] = count + 1
        return stable_hash(self.seed, name, count)

    def generator(self, name: str, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh generator seeded for the next call with `name`."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self.next_seed(name))
        return gen
