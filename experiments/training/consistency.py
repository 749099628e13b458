"""Start-up check that every rank runs the same configuration.

Ranks started with different compressor settings, parameter shapes or world sizes would
otherwise exchange payloads that the receiver misreads, or hang in mismatched collectives.
Each rank hashes named descriptions of its set-up, the hashes are all-gathered (fixed-size
int64 tensors), and where they differ the descriptions themselves are exchanged as UTF-8
bytes (never pickled) so the error can show what differs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gracecomm.rng import stable_hash
from gracecomm.validation import ConfigError

_SHOWN = 300  # characters of each differing description quoted in the error


def describe(value: Any) -> str:
    """A canonical text for plain configuration values (sorted JSON)."""
    return json.dumps(value, sort_keys=True, default=str)


def gather_text(text: str, group: Any = None) -> list[str]:
    """Every rank's `text` (UTF-8 bytes in fixed-size tensors, never pickled)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=group)
    width = max(1, max(int(s) for s in sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return [bytes(o[: int(s)].tolist()).decode(errors="replace") for o, s in zip(out, sizes)]


def verify_same_on_all_ranks(parts: Mapping[str, str], group: Any = None) -> None:
    """Raise `ConfigError` on every rank if any named description differs between ranks.
    All ranks must call this with the same part names (it is one collective per part name
    plus one for each part that differs)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    names = sorted(parts)
    local = torch.tensor([stable_hash(name, parts[name]) for name in names], dtype=torch.int64)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    problems = []
    for i, name in enumerate(names):
        if len({int(g[i]) for g in gathered}) > 1:
            texts = gather_text(parts[name], group)
            shown = "; ".join(f"rank {r}: {t[:_SHOWN]}" for r, t in enumerate(texts))
            problems.append(f"'{name}' differs between ranks ({shown})")
    if problems:
        raise ConfigError("ranks were started with different set-ups, refusing to train: "
                          + " | ".join(problems))
