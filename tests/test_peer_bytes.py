"""Every byte from a peer is validated before it reaches Gloo or a decoder (issue 34): a rank
whose announced sizes differ from what it sends, a parameter server whose downlink header
carries negative dtype codes or dimensions, and NaN written into a peer's float fields all
end in a `PayloadError` naming the rank at fault, never an abort, a tensor of another dtype
or shape, or a non-finite mean. Each case here aborted a rank or passed silently before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import gracecomm
from gracecomm.communicators import parameter_server
from gracecomm.experiments.launch import WorkerError
from gracecomm.wire import unpack_described
from tests.helpers import run_ranks

SHAPES = {"w": (8, 12), "b": (40,)}
THRESHOLD = {"name": "threshold", "threshold": 0.5}


def lie_about_sizes(comm: Any, by: int) -> None:
    """This rank announces its first payload tensor `by` bytes longer than it is, and sends
    what it has."""
    gather = comm._gather_ints
    comm._gather_ints = lambda link, ints, device: gather(link, [ints[0] + by, *ints[1:]],
                                                           device)


def nan_in_first_field(payload: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    first = payload[0].clone()
    first.view(-1)[0] = float("nan")
    return (first, *payload[1:])


def corrupt_header(edit: Any) -> Any:
    """`parameter_server.pack` with its header words edited by `edit`."""
    pack = parameter_server.pack

    def corrupted(payloads: Any) -> tuple[torch.Tensor, torch.Tensor]:
        meta, buf = pack(payloads)
        return edit(meta.clone(), buf)

    return corrupted


def set_word(index: int, value: int) -> Any:
    def edit(meta: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        meta[index] = value
        return meta, buf
    return edit


# header: [items, dtype, ndim, *shape, tensors, (dtype, ndim, *shape) per tensor, ...]; the
# first item is "w" (8, 12) with one float32 tensor of (96,) on a dense downlink
CASES: dict[str, dict[str, Any]] = {
    **{f"{comm}_announces_{'less' if by < 0 else 'more'}": {
        "spec": THRESHOLD, "comm": comm, "lie": by, "faulty": 1}
       for comm in ("broadcast", "allgather", "parameter_server") for by in (-16, 16)},
    "allreduce_announces_less": {"spec": "randomk", "comm": "allreduce", "lie": -16,
                                 "faulty": 1, "step": 0},  # fixed sizes: agreed at step 0
    "downlink_result_dtype_minus_1": {"spec": "none", "comm": "parameter_server",
                                      "header": set_word(1, -1), "faulty": 0},
    "downlink_tensor_dtype_minus_9": {"spec": "none", "comm": "parameter_server",
                                      "header": set_word(6, -9), "faulty": 0},
    "downlink_result_dim_minus_5": {"spec": "none", "comm": "parameter_server",
                                    "header": set_word(3, -5), "faulty": 0},
    "downlink_result_of_another_shape": {"spec": "none", "comm": "parameter_server",
                                         "header": set_word(3, 12), "faulty": 0},
    **{f"nan_in_{spec}_{comm}": {"spec": spec, "comm": comm, "corrupt": nan_in_first_field,
                                 "faulty": 1}
       for spec in ("topk", "qsgd", "terngrad")
       for comm in ("allgather", "broadcast", "parameter_server")},
    "nan_in_fp16_allreduce": {"spec": "fp16", "comm": "allreduce",
                              "corrupt": nan_in_first_field, "faulty": 1},
}


def peer(rank: int, world_size: int, case: str, out: str) -> None:
    setup = CASES[case]
    pipe = gracecomm.build(setup["spec"], communicator=setup["comm"])
    comm = pipe.communicator
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(3):
            if step == setup.get("step", 1) and rank == 1 and "lie" in setup:
                lie_about_sizes(comm, setup["lie"])
            if step == 1 and rank == 1 and "corrupt" in setup:
                compress = pipe.compressor.compress_rounds

                def corrupted(named: Any, link: Any) -> Any:
                    done = yield from compress(named, link)
                    return [(setup["corrupt"](p), c) if i == 0 else (p, c)
                            for i, (p, c) in enumerate(done)]

                pipe.compressor.compress_rounds = corrupted
            if step == 1 and rank == 0 and "header" in setup:
                parameter_server.pack = corrupt_header(setup["header"])
            grads = [(n, torch.randn(*s, generator=gen)) for n, s in SHAPES.items()]
            means = pipe.step_many(grads)
            for (name, grad), mean in zip(grads, means):
                assert mean.dtype == grad.dtype and mean.shape == grad.shape, (
                    f"tensor '{name}': a {mean.dtype} mean of shape {tuple(mean.shape)}")
                assert bool(torch.isfinite(mean).all()), f"tensor '{name}': a non-finite mean"
    except Exception as err:
        Path(out).with_suffix(f".{rank}").write_text(json.dumps([type(err).__name__, str(err)]))
        raise


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_faulty_peer_is_named_by_a_payload_error(case, tmp_path):
    with pytest.raises(WorkerError) as info:
        run_ranks(peer, 2, case, str(tmp_path / "err"), timeout_s=60)
    message = str(info.value)
    assert "signal" not in message.split("\n")[0], message  # no SIGABRT
    assert "PayloadError" in message, message
    errors = {int(p.suffix[1:]): json.loads(p.read_text()) for p in tmp_path.glob("err.*")}
    faulty = CASES[case]["faulty"]
    named = [m for kind, m in errors.values() if kind == "PayloadError"
             and f"rank {faulty}" in m]
    assert named, errors


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
