"""Multi-process tests on Gloo over loopback: every communicator returns the mean over ranks
of the decompressed payloads, and the DDP hook matches hand computations."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gracecomm
from gracecomm import registry
from tests.helpers import run_ranks

SHAPES = {"a": (13,), "b": (4, 6), "c": (1,), "zeros": (9,)}
OPTIONS = {"topk": {"ratio": 0.2}, "randomk": {"ratio": 0.2, "seed": 7},
           "threshold": {"threshold": 0.8}}


def rank_tensors(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    out = {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}
    out["zeros"] = torch.zeros(9) if rank == 0 else out["zeros"]  # empty payload on rank 0
    return out


def expected_mean(name, world_size, tensor_name):
    """Mean over ranks of decompress(compress(t_r)), computed locally."""
    total = None
    for r in range(world_size):
        comp = registry.create("compressor", name, **OPTIONS.get(name, {}))
        payload, ctx = comp.compress(rank_tensors(r)[tensor_name], tensor_name)
        out = comp.decompress(payload, ctx)
        total = out if total is None else total + out
    return total / world_size


def check_communicators(rank, world_size):
    for comm in ("allgather", "broadcast", "allreduce"):
        for name in ("none", "fp16", "topk", "randomk", "threshold"):
            cls = registry.get("compressor", name)
            if comm == "allreduce" and not cls.summable:
                continue
            g = gracecomm.build({"name": name, **OPTIONS.get(name, {})}, "none", comm)
            tensors = rank_tensors(rank)
            outs = g.step_many(list(tensors.items()))
            for (tname, _), out in zip(tensors.items(), outs):
                want = expected_mean(name, world_size, tname)
                tol = 2e-3 if name == "fp16" else 1e-6
                assert torch.allclose(out, want, atol=tol), (comm, name, tname)
                # every rank ends with the same bits
                gathered = [torch.empty_like(out) for _ in range(world_size)]
                dist.all_gather(gathered, out)
                assert all(torch.equal(gathered[0], o) for o in gathered), (comm, name, tname)
            stats = g.metrics.pop()
            assert stats["wire_bytes"] >= 0 and stats["comm_s"] >= 0
    # all ranks send nothing: no hang, zeros back
    g = gracecomm.build({"name": "threshold", "threshold": 10.0}, "none", "allgather")
    assert g.step(torch.zeros(5), "z").eq(0).all()
    assert g.metrics.pop()["wire_bytes"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_communicators_return_the_mean(world_size):
    run_ranks(check_communicators, world_size)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def batch(rank):
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(8, 1, 8, 8, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def local_grads(model, rank):
    model = copy.deepcopy(model)
    x, y = batch(rank)
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def check_ddp_hook(rank, world_size):
    torch.manual_seed(0)
    base = Tiny()
    x, y = batch(rank)
    # plain DDP and DDP with the Grace hook and no compression give the same gradients
    plain = DistributedDataParallel(copy.deepcopy(base))
    hooked = DistributedDataParallel(copy.deepcopy(base))
    gracecomm.register_comm_hook(hooked, gracecomm.build("none"))
    for model in (plain, hooked):
        nn.functional.cross_entropy(model(x), y).backward()
    for (n, p), (_, q) in zip(plain.module.named_parameters(), hooked.module.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n
    # with Top-k, every parameter's gradient is the mean of the ranks' sparsified gradients
    topk = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1)
    g = gracecomm.build({"name": "topk", "ratio": 0.1}, "none")
    gracecomm.register_comm_hook(topk, g)
    nn.functional.cross_entropy(topk(x), y).backward()
    per_rank = [local_grads(base, r) for r in range(world_size)]
    for name, param in topk.module.named_parameters():
        want = torch.zeros_like(param)
        for grads in per_rank:
            flat = grads[name].flatten()
            k = max(1, int(0.1 * flat.numel()))
            idx = flat.abs().topk(k).indices
            sparse = torch.zeros_like(flat)
            sparse[idx] = flat[idx]
            want += sparse.view_as(param) / world_size
        assert torch.allclose(param.grad, want, atol=1e-6), name
    stats = g.metrics.pop()
    dense = sum(p.numel() * 4 for p in base.parameters())
    assert stats["dense_bytes"] == dense
    assert stats["wire_bytes"] == sum(8 * max(1, int(0.1 * p.numel())) for p in base.parameters())


@pytest.mark.slow
def test_ddp_hook_matches_hand_computation():
    run_ranks(check_ddp_hook, 2)
