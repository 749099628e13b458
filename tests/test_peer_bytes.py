"""Every byte from a peer is validated before it reaches Gloo or a decoder (issue 34): a rank
whose announced sizes differ from what it sends, a parameter server whose downlink header
carries negative dtype codes or dimensions, and NaN written into a peer's float fields all
end in a `PayloadError` naming the rank at fault, never an abort, a tensor of another dtype
or shape, or a non-finite mean. Each case here aborted a rank or passed silently before."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gracecomm
from gracecomm.wire import unpack_described
from tests.reliability import PEER_CASES, named_by_a_payload_error

# One case of each kind here (each starts two processes); the reliability suite runs all
# of PEER_CASES: python -m tests.reliability -k peers
CHOSEN = ["broadcast_announces_less", "allgather_announces_more",
          "parameter_server_announces_less", "allreduce_announces_less",
          "downlink_result_dtype_minus_1", "downlink_tensor_dtype_minus_9",
          "downlink_result_dim_minus_5", "downlink_result_of_another_shape",
          "nan_in_topk_broadcast", "nan_in_qsgd_parameter_server", "nan_in_terngrad_allgather",
          "nan_in_fp16_allreduce"]


def test_the_chosen_cases_exist():
    assert set(CHOSEN) <= set(PEER_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", CHOSEN)
def test_a_faulty_peer_is_named_by_a_payload_error(case, tmp_path):
    named_by_a_payload_error(tmp_path, case)


# -- the downlink header, in one process ----------------------------------------------------

def header_of(*items: Any) -> tuple[torch.Tensor, torch.Tensor]:
    from gracecomm.wire import pack_described
    return pack_described(items)


@pytest.mark.parametrize("word, value, says", [
    (1, -1, "dtype code -1"), (1, 10, "dtype code 10"), (6, -9, "dtype code -9"),
    (3, -5, "dimension -5"), (8, -96, "dimension -96"), (2, 99, "dimensions"),
    (0, 7, "header"), (8, 200, "bytes")])
def test_a_malformed_downlink_header_is_a_payload_error(word, value, says):
    meta, buf = header_of((torch.Size([8, 12]), torch.float32, (torch.ones(96),)))
    meta[word] = value
    with pytest.raises(gracecomm.PayloadError, match=says):
        unpack_described(meta, buf)


def test_a_downlink_buffer_of_another_length_is_a_payload_error():
    meta, buf = header_of((torch.Size([8, 12]), torch.float32, (torch.ones(96),)))
    for bad in (buf[:-4], torch.cat([buf, buf[:4]])):
        with pytest.raises(gracecomm.PayloadError, match="bytes"):
            unpack_described(meta, bad)


def test_a_downlink_status_out_of_range_is_a_payload_error():
    from gracecomm.communicators.parameter_server import ParameterServer
    from gracecomm.exchange import Link
    server = ParameterServer()
    link = Link(server, None)
    server.check_downlink(link, 0, 3, 8)
    for status in (-1, 3, 7):
        with pytest.raises(gracecomm.PayloadError, match=f"status {status}"):
            server.check_downlink(link, status, 3, 8)


# -- a peer's announced counts under a fixed-size method --------------------------------------

LIES = {"more": lambda n: n + 8, "odd": lambda n: n + 1, "negative": lambda n: -n - 4}


def announced_counts_worker(rank: int, world_size: int, communicator: str, out: str) -> None:
    """Top-k over `communicator`, three steps, once honest and then once per lie of rank 1
    about its first payload tensor's bytes (`LIES`), told from the first step or only from
    the second on. Each rank writes what happened per run to ``out.<rank>``: the means'
    equality with the honest run's, or the error."""
    import json
    from pathlib import Path
    gen = torch.Generator().manual_seed(rank)
    steps = [[(n, torch.randn(*s, generator=gen)) for n, s in (("w", (8, 12)), ("b", (40,)))]
             for _ in range(3)]

    def run(lie: str | None, first_step: int) -> tuple[list[torch.Tensor], int]:
        pipe = gracecomm.build({"name": "topk", "ratio": 0.25}, communicator=communicator)
        comm, told = pipe.communicator, [0]
        gather = comm._gather_ints

        def lying(link: Any, ints: list[int], device: Any) -> Any:
            told[0] += 1
            return gather(link, [LIES[lie](ints[0]), *ints[1:]], device)

        means = []
        for step, grads in enumerate(steps):
            if lie is not None and rank == 1 and step == first_step:
                comm._gather_ints = lying
            means += pipe.step_many([(n, g.clone()) for n, g in grads])
        return means, told[0]

    honest, _ = run(None, 0)
    found: dict[str, Any] = {}
    for lie in LIES:
        for first_step in (0, 1):
            try:
                means, told = run(lie, first_step)
            except gracecomm.PayloadError as err:  # both ranks refuse at the size round
                found[f"{lie}@{first_step}"] = ["PayloadError", str(err)]
                continue
            same_means = all(torch.equal(a, b) for a, b in zip(means, honest))
            found[f"{lie}@{first_step}"] = ["same" if same_means else "changed", told]
    Path(f"{out}.{rank}").write_text(json.dumps(found))


@pytest.mark.slow
@pytest.mark.parametrize("communicator", ["broadcast", "allgather"])
def test_a_peers_announced_count_cannot_change_a_top_k_result(communicator, tmp_path):
    """Top-k's payload sizes are fixed by the shapes: they are announced once, at the first
    exchange, where a rank that announces more bytes than it sends, an odd or a negative
    count is refused with a `PayloadError` naming it on every rank; after that no count is
    exchanged at all (rank 1's lie is never told) and the received values, parsed by the
    agreed layout, give the honest run's means bit for bit."""
    import json

    from tests.helpers import run_ranks
    run_ranks(announced_counts_worker, 2, communicator, str(tmp_path / "out"), timeout_s=90)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"out.{rank}").read_text())
        for lie in LIES:
            kind, message = found[f"{lie}@0"]
            assert kind == "PayloadError" and "rank 1 announced" in message, found
            assert found[f"{lie}@1"] == ["same", 0], found  # never told, result unchanged
