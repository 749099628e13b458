"""The asynchronous exchange (gracecomm.exchange, gracecomm.ddp): the DDP hook gives the same bits
whether it returns before the bucket's exchange completes or waits for it, and the same as
the custom-loop path, for every communicator, methods with dependent rounds and methods that
need the whole step; and the library refuses what it cannot carry."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gracecomm
from gracecomm import ConfigError, GradientExchange, Need, register_comm_hook
from gracecomm.experiments.training.launch import WorkerError
from tests.helpers import run_ranks

LGC = {"name": "lgc_rar", "ratio": 0.05, "warmup_iters": 1, "ae_train_iters": 2}
CASES = {  # (compressor, memory, communicator): methods with one, two and four rounds
    "none": ("none", None, None),
    "fp16": ("fp16", None, None),
    "topk_allgather": ({"name": "topk", "ratio": 0.1}, None, None),
    "threshold_allgather": ({"name": "threshold", "threshold": 0.05}, None, None),
    "topk_broadcast": ({"name": "topk", "ratio": 0.1}, None, "broadcast"),
    "topk_ps": ({"name": "topk", "ratio": 0.1}, None, "parameter_server"),
    "powersgd": ({"name": "powersgd", "rank": 1}, None, None),
    "signum": ("signum", None, None),
    "dgc_clipped": ({"name": "dgc", "ratio": 0.1}, {"name": "dgc", "clip_norm": 1.0}, None),
    "lgc_rar": (LGC, None, None),
}
STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def train(rank: int, case: str, mode: str) -> tuple[torch.Tensor, gracecomm.Grace]:
    """`STEPS` steps of SGD through `mode`: the hook asynchronous or synchronous with
    buckets capped at 1e-4 MB (DDP's first bucket is capped at 1 MiB regardless), the hook
    asynchronous with DDP's default cap (one bucket for this model, which an elementwise
    method exchanges whole), or the custom-loop path; returns the parameters."""
    comp, mem, comm = CASES[case]
    pipe = gracecomm.build(comp, mem, comm)
    model = make_model()
    owns = Need.OWNS_MOMENTUM in pipe.needs
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if owns else 0.9)
    decay = 1e-3 if owns else 0.0
    if mode == "step":
        net, exchange = model, GradientExchange(pipe, model, opt, weight_decay=decay)
    else:
        cap = 25.0 if mode == "bucketed" else 1e-4
        net = DistributedDataParallel(model, bucket_cap_mb=cap)
        register_comm_hook(net, pipe, opt, weight_decay=decay, asynchronous=mode != "sync")
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        if mode == "step":
            exchange.step()
        opt.step()
    return nn.utils.parameters_to_vector(model.parameters()).detach(), pipe


def check_paths_agree(rank: int, world_size: int) -> None:
    for case in CASES:
        results = {mode: train(rank, case, mode)
                   for mode in ("async", "sync", "bucketed", "step")}
        params = {mode: p for mode, (p, _) in results.items()}
        for mode in ("sync", "bucketed", "step"):
            assert torch.equal(params["async"], params[mode]), (case, mode)
        gathered = [torch.empty_like(params["async"]) for _ in range(world_size)]
        dist.all_gather(gathered, params["async"])
        assert torch.equal(gathered[0], gathered[1]), case  # ranks agree
        if case == "lgc_rar":  # one LGC step per training step, not one per bucket
            assert all(pipe.compressor.step == STEPS for _, pipe in results.values())
        stats = results["async"][1].metrics.pop()
        assert stats["exchanges"] >= 1 and stats["wire_bytes"] > 0, case


@pytest.mark.slow
def test_async_sync_and_custom_loop_paths_give_identical_bits():
    run_ranks(check_paths_agree, 2, timeout_s=600)


def test_a_momentum_owner_refuses_an_optimizer_with_momentum():
    model = make_model()
    for pipe in (gracecomm.build("dgc"), gracecomm.build("signum")):
        with pytest.raises(ConfigError, match="pass the optimizer"):
            GradientExchange(pipe, model)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with pytest.raises(ConfigError, match=r"momentum=0\.9.*momentum=0, weight_decay=0"):
            GradientExchange(pipe, model, sgd)
        decayed = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-4)
        with pytest.raises(ConfigError, match="pass the weight decay to the exchange"):
            GradientExchange(pipe, model, decayed)
        with pytest.raises(ConfigError, match="Adam keeps moment estimates"):
            GradientExchange(pipe, model, torch.optim.Adam(model.parameters()))
        GradientExchange(pipe, model, torch.optim.SGD(model.parameters(), lr=0.1),
                         weight_decay=1e-4)
    # a method that does not own the momentum takes any optimizer, or none
    GradientExchange(gracecomm.build("topk"), model,
                     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def test_needs_are_declared_by_the_parts():
    assert gracecomm.build(LGC).needs == {Need.WHOLE_MODEL}
    assert gracecomm.build("dgc").needs == {Need.OWNS_MOMENTUM}
    assert gracecomm.build("dgc", {"name": "dgc", "clip_norm": 1.0}).needs == {
        Need.OWNS_MOMENTUM, Need.GLOBAL_NORM}
    assert gracecomm.build("topk").needs == frozenset()
    assert gracecomm.build({"name": "compose", "compressors": ["topk", "signum"]}).needs == {
        Need.OWNS_MOMENTUM}


def die_in_backward(rank: int, world_size: int, out: str) -> None:
    model = DistributedDataParallel(make_model(), bucket_cap_mb=1e-4)
    register_comm_hook(model, gracecomm.build({"name": "topk", "ratio": 0.1}))
    x = torch.randn(8, 12)
    for _ in range(2):  # good steps (DDP rebuilds its buckets in the second forward)
        model(x).sum().backward()
    if rank == 1:
        os._exit(3)  # dies before its next exchange
    try:
        model(x).sum().backward()
    except Exception as err:  # noqa: BLE001 - the test reads what the loop saw
        Path(out).write_text(f"{type(err).__name__}: {err}")
        raise


@pytest.mark.slow
def test_a_rank_dying_during_an_async_exchange_fails_the_training_loop(tmp_path):
    out = tmp_path / "rank0_error.txt"
    with pytest.raises(WorkerError, match="rank 1"):
        run_ranks(die_in_backward, 2, str(out), timeout_s=120)
    text = out.read_text()
    assert "exchange" in text and "rank 0" in text, text


def nan_in_backward(rank, world_size):
    from gracecomm.validation import NonFiniteError
    for asynchronous in (True, False):
        model = DistributedDataParallel(make_model(), bucket_cap_mb=1e-4)
        state = register_comm_hook(model, gracecomm.build({"name": "topk", "ratio": 0.1}),
                                   asynchronous=asynchronous)
        x = torch.randn(8, 12)
        model(x).sum().backward()
        assert state.error is None
        x[0, 0] = float("nan")
        with pytest.raises(Exception):  # noqa: B017 - DDP may re-raise it as a RuntimeError
            model(x).sum().backward()
        assert isinstance(state.error, NonFiniteError), repr(state.error)
        assert "NaN" in str(state.error)
    # fp16 exchanges the bucket whole; the error still names the gradient
    model = DistributedDataParallel(make_model())
    state = register_comm_hook(model, gracecomm.build("fp16"))
    model.module[2].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    with pytest.raises(Exception):  # noqa: B017 - DDP may re-raise it as a RuntimeError
        model(torch.randn(8, 12)).sum().backward()
    assert isinstance(state.error, NonFiniteError), repr(state.error)
    assert "tensor '2.weight'" in str(state.error), str(state.error)


@pytest.mark.slow
def test_the_hook_keeps_its_own_error_for_the_loop():
    run_ranks(nan_in_backward, 2)
