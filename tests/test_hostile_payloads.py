"""A peer's malformed payload cannot crash or inflate a rank: sizes that would make a
collective abort the process are refused before they go on the wire, announced sizes are
bounded by the tensors' shapes, and corrupted values are caught by the optional checksum.
Every case ends with a `PayloadError` naming the rank, never a SIGABRT or a silent result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import gracecomm
from gracecomm.experiments.training.launch import WorkerError
from tests.helpers import run_ranks

SHAPES = {"w": (8, 12), "b": (40,)}


def truncate(payload: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (payload[0].reshape(-1)[:-1], *payload[1:])


def widen(payload: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    first = payload[0]
    return (first.double() if first.is_floating_point() else first.short(), *payload[1:])


def bigger_topk(payload: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Top-k's payload for a tensor 4x larger: 4k values at indices that are all in range."""
    values, indices = payload
    return values.repeat(4), indices.repeat(4)


CASES: dict[str, dict[str, Any]] = {
    **{f"truncated_{m}": {"spec": m, "corrupt": truncate, "step": 2} for m in
       ("randomk", "fp16", "powersgd", "qsgd", "natural", "signsgd")},
    **{f"wider_{m}": {"spec": m, "corrupt": widen, "step": 2} for m in ("fp16", "natural")},
    "truncated_at_first_exchange": {"spec": "qsgd", "corrupt": truncate, "step": 0},
    "topk_sized_for_a_4x_tensor": {"spec": "topk", "corrupt": bigger_topk, "step": 2},
    "huge_announced_size": {"spec": {"name": "threshold", "threshold": 0.5},
                            "announce": 2**44, "step": 1},
    "garbled_efsignsgd_scale": {"spec": "efsignsgd", "comm": {"name": "allgather",
                                                              "checksum": True},
                                "garble": True, "step": 1},
    "garbled_topk_values_broadcast": {"spec": "topk", "comm": {"name": "broadcast",
                                                               "checksum": True},
                                      "garble": True, "step": 1},
}


def hostile(rank: int, world_size: int, case: str, out: str) -> None:
    setup = CASES[case]
    pipe = gracecomm.build(setup["spec"], communicator=setup.get("comm"))
    comm = pipe.communicator
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(4):
            if rank == 1 and step == setup["step"]:
                if "corrupt" in setup:
                    compress = pipe.compressor.compress_rounds

                    def corrupted(named: Any, link: Any) -> Any:
                        done = yield from compress(named, link)
                        return [(setup["corrupt"](p), c) if i == 0 else (p, c)
                                for i, (p, c) in enumerate(done)]

                    pipe.compressor.compress_rounds = corrupted
                if "announce" in setup:
                    gather = comm._gather_ints
                    comm._gather_ints = lambda link, ints, device: gather(
                        link, [setup["announce"], *ints[1:]], device)
                if setup.get("garble"):
                    serialise = comm.serialise

                    def garbled(*args: Any, **kwargs: Any) -> torch.Tensor:
                        buf = serialise(*args, **kwargs).clone()
                        buf[-5] ^= 0x40  # a value byte before the trailer, after the CRC
                        return buf

                    comm.serialise = garbled
            pipe.step_many([(n, torch.randn(*s, generator=gen)) for n, s in SHAPES.items()])
    except Exception as err:
        Path(out).with_suffix(f".{rank}").write_text(json.dumps([type(err).__name__, str(err)]))
        raise


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_malformed_payload_raises_payload_error_naming_the_rank(case, tmp_path):
    with pytest.raises(WorkerError) as info:
        run_ranks(hostile, 2, case, str(tmp_path / "err"), timeout_s=30)
    assert "signal" not in str(info.value), str(info.value)  # no SIGABRT
    assert "PayloadError" in str(info.value), str(info.value)  # the first error reported
    errors = [json.loads(p.read_text()) for p in tmp_path.glob("err.*")]
    refused = [message for kind, message in errors if kind == "PayloadError"]
    assert refused and all("rank" in message for message in refused), errors
