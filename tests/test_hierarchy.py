"""The two-level exchange (gracecomm.hierarchy, ``hierarchy="node"``) on 4 Gloo ranks told
they are 2 nodes x 2 ranks by torchrun's variables: its means equal the flat mean (dense) or
a reference computed by hand (Top-k with error feedback), asynchronous equals synchronous,
bytes are counted per level, one rank per node is the flat exchange, bad layouts and resumes
are refused, and every registered combination works two-level or is refused."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gracecomm
from gracecomm import ConfigError, register_comm_hook
from gracecomm.hierarchy import assign_owners, check_hierarchy
from tests.helpers import agreed_on_every_rank, buildable, registered_combinations, run_ranks, same

SHAPES = {"w1": (6, 5), "b1": (6,), "w2": (3, 6), "b2": (3,)}
STEPS = 3


def as_nodes(rank: int, per_node: int) -> None:
    """Tell this rank it is local rank ``rank % per_node`` of node ``rank // per_node``, as
    torchrun does."""
    os.environ.update(LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node),
                      LOCAL_RANK=str(rank % per_node))


def grads(rank: int, step: int) -> list[tuple[str, torch.Tensor]]:
    """Rank `rank`'s gradients at `step`, reproducible on any rank."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [(name, torch.randn(shape, generator=gen)) for name, shape in SHAPES.items()]


def test_assign_owners_balanced_and_check() -> None:
    assert assign_owners([10, 3, 3, 4], 2) == [0, 1, 1, 1]
    assert assign_owners([5], 3) == [0]
    assert sorted(assign_owners([1, 1, 1, 1], 4)) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="hierarchy.*'flat', 'node'"):
        check_hierarchy("nodes")
    with pytest.raises(ConfigError, match="hierarchy"):
        gracecomm.build("topk", hierarchy="Node")


def test_one_process_is_flat() -> None:
    grace = gracecomm.build({"name": "topk", "ratio": 0.5}, hierarchy="node")
    assert repr(grace).endswith("hierarchy='node')")
    assert grace.node_layout() is None
    out = grace.step(torch.tensor([1.0, -3.0]), "w")
    assert out.tolist() == [0.0, -3.0]
    assert grace.state_dict()["layout"] == {"hierarchy": "node", "nodes": None,
                                            "ranks_per_node": None}


def _dense_and_topk(rank: int, world: int) -> None:
    as_nodes(rank, 2)
    flat = gracecomm.build("none")
    node = gracecomm.build("none", hierarchy="node")
    layout = node.node_layout()
    assert layout is not None and (layout.nodes, layout.ranks_per_node) == (2, 2)
    assert (layout.node, layout.local_rank) == (rank // 2, rank % 2)
    for step in range(STEPS):
        named = grads(rank, step)
        for a, b in zip(flat.step_many(named), node.step_many(named)):
            torch.testing.assert_close(a, b)
    # Top-k: node means, per-owner top-k with residual, mean over nodes
    ratio = 0.3
    topk = gracecomm.build({"name": "topk", "ratio": ratio}, hierarchy="node")
    owners, load = [], [0, 0]  # each tensor to the local rank with fewer elements so far
    for shape in SHAPES.values():
        owners += assign_owners([torch.Size(shape).numel()], 2, load)
        load[owners[-1]] += torch.Size(shape).numel()
    assert topk.step_many(grads(rank, 0)) and topk.state_dict()["owners"] == dict(
        zip(SHAPES, owners))
    topk = gracecomm.build({"name": "topk", "ratio": ratio}, hierarchy="node")
    residual = {(n, name): torch.zeros(s) for n in range(2) for name, s in SHAPES.items()}
    for step in range(STEPS):
        out = topk.step_many(grads(rank, step))
        every = [dict(grads(r, step)) for r in range(world)]
        for i, name in enumerate(SHAPES):
            kept = []
            for n in range(2):
                t = (every[2 * n][name] + every[2 * n + 1][name]) / 2 + residual[n, name]
                k = max(1, int(t.numel() * ratio))
                idx = t.reshape(-1).abs().topk(k).indices
                sparse = torch.zeros(t.numel())
                sparse[idx] = t.reshape(-1)[idx]
                sparse = sparse.view_as(t)
                residual[n, name] = t - sparse
                kept.append(sparse)
            torch.testing.assert_close(out[i], (kept[0] + kept[1]) / 2)
        mine = topk.state_dict()["memory"]["residuals"]
        owned = {name for name, o in zip(SHAPES, owners) if o == rank % 2}
        assert set(mine) == owned
        for name in owned:
            torch.testing.assert_close(mine[name], residual[rank // 2, name])


@pytest.mark.slow
def test_dense_and_topk_two_level() -> None:
    run_ranks(_dense_and_topk, 4, timeout_s=120)


def _bytes(rank: int, world: int) -> None:
    as_nodes(rank, 2)
    big = [(f"t{i}", torch.randn(200, generator=torch.Generator().manual_seed(rank + i)))
           for i in range(4)]
    stats = {}
    for hierarchy in ("flat", "node"):
        grace = gracecomm.build({"name": "topk", "ratio": 0.1}, hierarchy=hierarchy)
        grace.step_many(big)
        grace.metrics.pop()
        grace.step_many(big)
        stats[hierarchy] = grace.metrics.pop()
    flat, node = stats["flat"], stats["node"]
    assert flat["intra_node_bytes"] == 0 and "node_coll_reduce_calls" not in flat
    assert flat["cross_node_bytes"] == flat["sent_bytes"]
    # each rank compresses half the tensors: half the payload bytes cross the node's link
    assert node["wire_bytes"] == flat["wire_bytes"] / 2
    assert node["cross_node_bytes"] == node["sent_bytes"]
    assert 0.4 < node["cross_node_bytes"] / flat["cross_node_bytes"] < 0.6
    assert node["node_coll_reduce_calls"] == 2 and node["node_coll_broadcast_calls"] == 2
    assert node["node_coll_reduce_bytes"] == 4 * 200 * 4  # the whole gradient, once
    assert node["node_coll_broadcast_bytes"] == 4 * 200 * 4
    # a rank sends its gradient but the half it owns, and broadcasts the means it owns
    assert node["intra_node_bytes"] == 4 * 200 * 4
    assert node["coll_allgather_calls"] == flat["coll_allgather_calls"]


@pytest.mark.slow
def test_bytes_per_level() -> None:
    run_ranks(_bytes, 4, timeout_s=120)


def _one_per_node(rank: int, world: int) -> None:
    as_nodes(rank, 1)
    grace = gracecomm.build({"name": "topk", "ratio": 0.3}, hierarchy="node")
    flat = gracecomm.build({"name": "topk", "ratio": 0.3})
    assert grace.node_layout() is None and grace.communicator.group is None
    for step in range(2):
        for a, b in zip(flat.step_many(grads(rank, step)), grace.step_many(grads(rank, step))):
            torch.testing.assert_close(a, b)
        a, b = flat.metrics.pop(), grace.metrics.pop()
        assert {k: v for k, v in a.items() if "_s" not in k} == {
            k: v for k, v in b.items() if "_s" not in k}
    assert grace.state_dict()["layout"] == {"hierarchy": "node", "nodes": 4,
                                            "ranks_per_node": 1}


@pytest.mark.slow
def test_one_rank_per_node_is_flat() -> None:
    run_ranks(_one_per_node, 4, timeout_s=120)


def _uneven(rank: int, world: int) -> None:
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK="0" if rank < 3 else "1")
    with pytest.raises(ConfigError, match=r"nodes \(by torchrun\) have \[3, 1\] ranks"):
        gracecomm.build("topk", hierarchy="node")


@pytest.mark.slow
def test_uneven_nodes_refused() -> None:
    run_ranks(_uneven, 4, timeout_s=120)


def _resume(rank: int, world: int) -> None:
    as_nodes(rank, 2)
    spec = {"name": "topk", "ratio": 0.3}
    grace = gracecomm.build(spec, hierarchy="node")
    for step in range(2):
        grace.step_many(grads(rank, step))
    state = grace.state_dict()
    after = grace.step_many(grads(rank, 2))
    resumed = gracecomm.build(spec, hierarchy="node")
    resumed.load_state_dict(state)
    for a, b in zip(after, resumed.step_many(grads(rank, 2))):
        assert torch.equal(a, b)
    assert same(grace.state_dict(), resumed.state_dict())
    flat = gracecomm.build(spec)
    with pytest.raises(ConfigError, match="hierarchy 'node' on 2 node.*x 2 rank.*"
                                          "hierarchy 'flat'"):
        flat.load_state_dict(state)
    other = dict(state, layout={"hierarchy": "node", "nodes": 4, "ranks_per_node": 1})
    with pytest.raises(ConfigError, match="4 node.*x 1 rank.*2 node.*x 2 rank"):
        resumed.load_state_dict(other)


@pytest.mark.slow
def test_checkpoint_round_trip_and_refused_shapes() -> None:
    run_ranks(_resume, 4, timeout_s=120)


def _async(rank: int, world: int, spec: dict) -> None:
    as_nodes(rank, 2)
    results = []
    for asynchronous in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
        grace = gracecomm.build(spec, hierarchy="node")
        ddp = DistributedDataParallel(model, bucket_cap_mb=1e-4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        register_comm_hook(ddp, grace, opt, asynchronous=asynchronous)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            opt.zero_grad()
            ddp(torch.randn(8, 12, generator=gen)).square().mean().backward()
            opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        assert grace.metrics.get("node_coll_reduce_calls") > 0
    assert torch.equal(results[0], results[1])
    agreed_on_every_rank(results[0], "async against sync")


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"name": "topk", "ratio": 0.2}, {"name": "powersgd",
                                                                   "rank": 1}, "fp16"])
def test_async_equals_sync(spec: dict) -> None:
    run_ranks(_async, 4, spec, timeout_s=180)


def _walk(rank: int, world: int) -> None:
    """Every registered compressor x memory x communicator that builds flat (defaults),
    and DGC's memory clipping by the model's norm: two-level it is refused with a message
    naming ``hierarchy``, or it runs two steps whose means are finite and the same on every
    rank."""
    as_nodes(rank, 2)
    combos = [*registered_combinations(), ("dgc", {"name": "dgc", "clip_norm": 1.0}, "allgather")]
    refused, worked = [], 0
    for combo in buildable(combos):
        try:
            grace = gracecomm.build(*combo, hierarchy="node")
        except ConfigError as err:
            assert "hierarchy" in str(err), (combo, err)
            refused.append(combo)
            continue
        means = [torch.cat([m.reshape(-1) for m in grace.step_many(grads(rank, step))])
                 for step in range(2)]
        agreed_on_every_rank(torch.cat(means), combo)
        worked += 1
    assert refused == [("dgc", {"name": "dgc", "clip_norm": 1.0}, "allgather")]
    assert worked > 100


@pytest.mark.slow
def test_every_registered_combination_works_or_is_refused() -> None:
    run_ranks(_walk, 4, timeout_s=600)


def test_option_in_hook_frameworks_and_trainer_config() -> None:
    from omegaconf import OmegaConf

    from gracecomm.experiments.training.config import exchange_options
    from gracecomm.frameworks import pipeline

    model = nn.Linear(3, 2)
    grace = gracecomm.build("topk")
    gracecomm.GradientExchange(grace, model, hierarchy="node")
    assert grace.hierarchy == "node"
    assert pipeline("topk", None, None, hierarchy="node").hierarchy == "node"
    assert pipeline(grace, None, None).hierarchy == "node"
    with pytest.raises(ConfigError, match="hierarchy"):
        gracecomm.GradientExchange(gracecomm.build("topk"), model, hierarchy="nodes")
    with pytest.raises(ConfigError, match="memory 'dgc'.*hierarchy=flat"):
        gracecomm.build("dgc", {"name": "dgc", "clip_norm": 1.0}, hierarchy="node")
    assert exchange_options(OmegaConf.create({}))["hierarchy"] == "flat"
    cfg = OmegaConf.create({"exchange": {"hierarchy": "node"}})
    assert exchange_options(cfg) == {"hierarchy": "node", "strategy": "fixed", "step_penalty": None}
    with pytest.raises(ConfigError, match="exchange: unknown option 'hierachy'. "
                                          r"Did you mean 'hierarchy'\?"):
        exchange_options(OmegaConf.create({"exchange": {"hierachy": "node"}}))
    with pytest.raises(ConfigError, match="hierarchy=node.*trainer.exchange=torch.*flat"):
        exchange_options(OmegaConf.create({"exchange": {"hierarchy": "node"},
                                           "trainer": {"exchange": "torch"}}))
    with pytest.raises(ConfigError, match="exchange: option 'hierarchy' must be one of"):
        exchange_options(OmegaConf.create({"exchange": {"hierarchy": "nodes"}}))
    with pytest.raises(ConfigError, match=r"exchange: option 'step_penalty' must be a number "
                                          r"in \[1.0, inf\), got 0.5"):
        exchange_options(OmegaConf.create({"exchange": {"step_penalty": 0.5}}))
