"""The quantisers on real ranks: every communicator returns the mean (or majority vote) of
what each rank's own payload decodes to, identically on every rank; PowerSGD's two rounds;
DDP training through the comm hook; and two-rank training through the real entry point
with each registered method."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gracecomm
from gracecomm import register_comm_hook
from gracecomm.compressors.compose import Compose
from gracecomm.compressors.dithering import NaturalDithering
from gracecomm.compressors.natural import Natural
from gracecomm.compressors.randomk import RandomK
from gracecomm.compressors.topk import TopK
from tests.helpers import run_ranks
from tests.test_train import train

SHAPES = {"w": (6, 10), "b": (13,), "one": (1,)}
METHODS = [
    ({"name": "natural"}, ("allgather", "broadcast")),
    ({"name": "natural", "wire": "nat8"}, ("allgather",)),
    ({"name": "natural", "wire": "int_fixed"}, ("allreduce", "allgather")),
    ({"name": "natural_dithering", "bucket": 4}, ("allgather", "broadcast")),
    ({"name": "standard_dithering", "p": "inf"}, ("allgather",)),
    ({"name": "qsgd", "bucket": 8}, ("allgather",)),
    ({"name": "terngrad"}, ("allgather",)),
    ({"name": "signsgd"}, ("allgather", "broadcast")),
    ({"name": "signum"}, ("allgather",)),
    ({"name": "efsignsgd"}, ("allgather",)),
    ({"name": "onebit"}, ("allgather",)),
    (lambda: Compose([TopK(0.3), Natural()]), ("allgather",)),
    (lambda: Compose([RandomK(0.5, seed=3), NaturalDithering()]), ("allgather",)),
]


def gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def check_quantizers(rank, world_size):
    gen = torch.Generator().manual_seed(10 + rank)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}
    for spec, comms in METHODS:
        for comm in comms:
            memory = {"name": "efsignsgd", "lr": 0.5} if spec == {"name": "efsignsgd"} else "none"
            g = gracecomm.build(spec() if callable(spec) else dict(spec), memory, comm)
            c = g.compressor
            for name, x in tensors.items():
                payload, ctx = c.compress(x, name)
                own = c.decompress(payload, ctx)
                out = g.communicator.send_receive(payload, ctx, name)
                peers = gather(own)
                if c.registry_name in ("signsgd", "signum"):
                    want = torch.sign(sum(peers))  # majority vote
                else:
                    want = sum(peers) / world_size
                    if c.registry_name == "efsignsgd":
                        want = want / c.lr
                assert torch.allclose(out, want, atol=1e-6), (spec, comm, name)
                assert all(torch.equal(o, out) for o in gather(out)), (spec, comm, name)
    # PowerSGD: P is summed by its own allreduce, Q averaged by the communicator's
    g = gracecomm.build({"name": "powersgd", "rank": 2})
    m = tensors["w"]
    payload, ctx = g.compressor.compress(m, "w")
    assert all(torch.equal(p, ctx.p) for p in gather(ctx.p))  # the same P on every rank
    q_sum = sum(gather(payload[0]))
    out = g.communicator.send_receive(payload, ctx, "w")
    assert torch.allclose(out, ctx.p @ q_sum.t() / world_size, atol=1e-6)
    assert torch.allclose(g.compressor.q["w"], q_sum / world_size)  # warm start: the mean Q
    stats = g.metrics.pop()
    assert stats["wire_bytes"] == 4 * 2 * (6 + 10)


    # DDP training through the comm hook with the variants the entry-point sweep leaves out
    for spec in (lambda: Compose([RandomK(0.5, scale="unbiased"), Natural()]),
                 lambda: Compose([RandomK(0.5, scale="unbiased"), NaturalDithering()]),
                 lambda: Natural(wire="nat8"), lambda: Natural(wire="int_fixed")):
        train_tiny_ddp(rank, gracecomm.build(spec()))


def train_tiny_ddp(rank, pipeline, steps=3):
    """A few SGD steps of a small model under DDP with `pipeline` as its comm hook; the
    replicas must stay identical."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ddp = DistributedDataParallel(model)
    register_comm_hook(ddp, pipeline)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    for p in model.parameters():
        assert all(torch.equal(q, p.detach()) for q in gather(p.detach())), pipeline


@pytest.mark.slow
def test_quantizers_on_two_ranks():
    run_ranks(check_quantizers, 2)


# natural, qsgd, efsignsgd and powersgd train on two ranks through the trainer's worker in
# tests/test_reliability.py::test_resume_is_bit_identical (30 steps, resumed bit for bit)
TRAINED = ["natural_dithering", "standard_dithering", "terngrad", "signsgd", "signum", "onebit",
           "compose"]


@pytest.mark.slow
def test_two_rank_training_with_each_method(tmp_path):
    """Every registered quantizer not trained elsewhere through the real entry point, in one
    Hydra multirun (one parent process; every job spawns two workers)."""
    proc = train(tmp_path, f"compressor={','.join(TRAINED)}", "trainer.max_steps=3",
                 multirun=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "sweep").glob("*/summary.json")]
    assert sorted(s["compressor"] for s in summaries) == sorted(TRAINED)
    for summary in summaries:
        assert summary["steps"] == 3 and summary["world_size"] == 2
        assert 0 < summary["wire_bytes_per_step"] < summary["dense_bytes_per_step"]
