"""Non-finite gradients (a GradScaler's deliberate overflows): with check_finite=False a step
where any rank's gradient is non-finite reaches every rank as NaN, never enters any
compression state, and the next finite step goes on from the state before it."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gracecomm
from gracecomm import NonFiniteError
from gracecomm.experiments.workloads.models import ReferenceCNN
from gracecomm.pipeline import snapshot
from tests.helpers import run_ranks, same, state_tensors

SHAPES = {"w": (16, 12), "b": (16,), "v": (300,)}
LGC_OPTIONS = {"warmup_iters": 1, "ae_train_iters": 3}


def spec(name: str) -> dict[str, Any]:
    if name == "compose":
        return {"name": "compose", "compressors": ["topk", "natural"]}
    return {"name": name, **(LGC_OPTIONS if name.startswith("lgc") else {})}


def shapes(name: str) -> dict[str, tuple[int, ...]]:
    """LGC needs a model with layers to split; the others take any tensors."""
    if name.startswith("lgc"):
        return {n: tuple(p.shape) for n, p in ReferenceCNN().named_parameters()}
    return SHAPES


@pytest.mark.parametrize("name", [  # LGC trains its autoencoder first: seconds
    pytest.param(n, marks=pytest.mark.slow) if n.startswith("lgc") else n
    for n in gracecomm.available("compressor")])
def test_nonfinite_step_passes_through_and_leaves_the_state_as_it_was(name):
    pipe = gracecomm.build(spec(name), check_finite=False)
    gen = torch.Generator().manual_seed(0)

    def grads(bad: bool = False) -> list[tuple[str, torch.Tensor]]:
        out = [(n, torch.randn(*s, generator=gen)) for n, s in shapes(name).items()]
        if bad:
            out[0][1].view(-1)[0] = float("inf")
        return out

    for _ in range(4):
        pipe.step_many(grads())
    before = copy.deepcopy(pipe.state_dict())
    kept = snapshot(pipe.state_dict())
    means = pipe.step_many(grads(bad=True))
    assert all(bool(torch.isnan(m).all()) for m in means)
    assert same(pipe.state_dict(), before)
    assert pipe.metrics.pop()["nonfinite_steps"] == 1
    for _ in range(3):  # parts replace their state tensors: the snapshot is still valid
        pipe.step_many(grads())
    assert same(kept, before)


def test_check_finite_names_the_tensor_and_both_ways_out():
    with pytest.raises(NonFiniteError,
                       match=r"tensor 'w'.*GradScaler.*scaler=scaler.*check_finite=False"):
        gracecomm.build("topk").step(torch.tensor([1.0, float("nan")]), "w")


METHODS = {  # (compressor, memory, communicator): one of each stateful family and exchange
    "topk": ({"name": "topk", "ratio": 0.1}, None, None),
    "topk_broadcast": ({"name": "topk", "ratio": 0.1}, None, "broadcast"),
    "topk_ps": ({"name": "topk", "ratio": 0.1}, None, "parameter_server"),
    "randomk": ({"name": "randomk", "ratio": 0.1}, None, None),
    "dgc": ({"name": "dgc", "ratio": 0.1}, {"name": "dgc", "clip_norm": 10.0}, None),
    "sidco": ({"name": "sidco", "ratio": 0.1}, None, None),
    "powersgd": ({"name": "powersgd", "rank": 2}, None, None),
    "signum": ("signum", None, None),
    "efsignsgd": ("efsignsgd", None, None),
    "natural": ("natural", None, None),
    "deepreduce": ("deepreduce", None, None),
    "lgc_rar": ({"name": "lgc_rar", "ratio": 0.05, "warmup_iters": 2, "ae_train_iters": 3},
                None, None),
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def train(rank: int, method: str, bad_step: int | None, skip: bool) -> torch.Tensor:
    """Eight SGD steps through the asynchronous hook; at `bad_step` rank 1's loss is Inf
    (or, with `skip`, that step is left out); a step whose gradients are not finite is
    skipped, as a GradScaler skips it."""
    comp, mem, comm = METHODS[method]
    pipe = gracecomm.build(comp, mem, comm, check_finite=False)
    model = mlp()
    owns = gracecomm.Need.OWNS_MOMENTUM in pipe.needs
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if owns else 0.9)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-4)
    gracecomm.register_comm_hook(ddp, pipe, opt)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(8):
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        if step == bad_step and skip:
            continue
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        if step == bad_step and rank == 1:
            loss = loss * float("inf")
        loss.backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        assert finite == (step != bad_step), (method, step)  # on every rank
        if finite:
            opt.step()
    assert all(bool(torch.isfinite(t).all()) for t in state_tensors(pipe.state_dict())), method
    return nn.utils.parameters_to_vector(model.parameters()).detach()


def check_overflow_on_one_rank(rank: int, world_size: int) -> None:
    for method in METHODS:
        with_bad = train(rank, method, bad_step=3, skip=False)
        without = train(rank, method, bad_step=3, skip=True)
        assert torch.equal(with_bad, without), method
        gathered = [torch.empty_like(with_bad) for _ in range(world_size)]
        dist.all_gather(gathered, with_bad)
        assert torch.equal(gathered[0], gathered[1]), method


@pytest.mark.slow
def test_an_overflow_on_one_rank_is_skipped_everywhere_and_undone():
    """Training with a non-finite step on one rank ends bit-identical to training without
    that step, on every rank, for every stateful family and every communicator."""
    run_ranks(check_overflow_on_one_rank, 2, timeout_s=600)


SCALER_METHODS = ["topk", "randomk", "dgc", "sidco", "powersgd", "efsignsgd", "natural",
                  "lgc_rar"]


def accuracy_with_scaler(rank: int, method: str, init_scale: float) -> tuple[float, int]:
    """fp16 autocast with a GradScaler on a separable 4-class problem until 150 steps were
    applied (a skipped step retries its batch, so both runs see the same batches); returns
    the accuracy on fresh data and the number of steps the scaler skipped."""
    comp, mem, comm = METHODS[method]
    pipe = gracecomm.build(comp, mem, comm)  # the scaler alone passes overflows through
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: Random-k diverges with it
    ddp = DistributedDataParallel(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    gracecomm.register_comm_hook(ddp, pipe, opt, scaler=scaler)
    gen = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 12, generator=gen) * 2
    skipped, applied = 0, 0
    while applied < 150:
        batch = torch.Generator().manual_seed(1000 * rank + applied)
        y = torch.randint(0, 4, (32,), generator=batch)
        x = centers[y] + torch.randn(32, 12, generator=batch)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ddp(x).float(), y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skip = scaler.get_scale() < scale
        skipped, applied = skipped + skip, applied + (not skip)
    assert all(bool(torch.isfinite(t).all()) for t in state_tensors(pipe.state_dict())), method
    y = torch.randint(0, 4, (512,), generator=gen)
    x = centers[y] + torch.randn(512, 12, generator=gen)
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean()), skipped


def check_scaler(rank: int, world_size: int) -> None:
    for method in SCALER_METHODS:
        clean, clean_skips = accuracy_with_scaler(rank, method, 2.0 ** 4)
        overflowed, skips = accuracy_with_scaler(rank, method, 2.0 ** 40)
        assert clean_skips == 0 and skips > 0, (method, clean_skips, skips)
        assert clean > 0.8 and abs(overflowed - clean) < 0.05, (method, clean, overflowed)


@pytest.mark.slow
def test_gradscaler_overflows_train_every_stateful_method():
    run_ranks(check_scaler, 2, timeout_s=900)


def test_the_finiteness_check_is_exact_beyond_its_fast_path():
    from gracecomm.validation import all_finite, nonfinite_among
    huge = torch.full((8,), 3e38)  # finite, but their sum overflows to Inf
    assert all_finite(huge) and all_finite(torch.empty(0))
    assert all_finite(torch.full((4,), 60000.0, dtype=torch.float16))
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.randn(100)
        t[37] = bad
        assert not all_finite(t)
        assert nonfinite_among([torch.randn(3), huge, t, torch.empty(0), t.double()]) == [2, 4]
    assert nonfinite_among([]) == [] and nonfinite_among([huge, -huge]) == []


@pytest.mark.parametrize("name", ["fp16", "topk", "none"])
def test_a_bad_tensor_inside_a_bucket_is_named(name):
    """Tensors back to back in one buffer (a DDP bucket) are checked in one call; the
    error still names the tensor that holds the NaN."""
    buf = torch.randn(30)
    views = [("a", buf[:10]), ("b", buf[10:25].view(3, 5)), ("c", buf[25:])]
    buf[17] = math.nan
    with pytest.raises(NonFiniteError, match="tensor 'b' holds 1 NaN"):
        gracecomm.build(name).step_many(views)


def test_an_elementwise_compressor_takes_a_bucket_in_one_call(monkeypatch):
    """fp16 with no memory compresses tensors that lie back to back as one, with the same
    means as each on its own."""
    from gracecomm.compressors.cast import FP16
    calls = []
    original = FP16.compress

    def counted(self, tensor, name):
        calls.append(name)
        return original(self, tensor, name)

    monkeypatch.setattr(FP16, "compress", counted)
    buf = torch.randn(1000) * 1e3
    shapes = [(10, 20), (300,), (1,), (499,)]
    views, pos = [], 0
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        views.append((f"t{i}", buf[pos:pos + n].view(shape)))
        pos += n
    pipes = [gracecomm.build("fp16"), gracecomm.build("fp16"),
             gracecomm.build("fp16", memory="residual")]
    calls.clear()  # building warms the compressor up
    joined = pipes[0].step_many(views)
    assert calls == ["t0"]
    apart = pipes[1].step_many([(n, t.clone()) for n, t in views])
    for (_, t), a, b in zip(views, joined, apart):
        assert a.shape == t.shape and torch.equal(a, b)
    assert calls[1:] == [n for n, _ in views]
    calls.clear()
    pipes[2].step_many(views)  # a memory with state: one call per tensor
    assert calls == [n for n, _ in views]
