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
