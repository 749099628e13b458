"""``strategy="auto"`` (gracecomm.strategy): the choice of each tensor's form from the cost
model, error feedback across a change of form, the state, the refusals, the decision being
the same on every rank whatever each rank measured, and every registered combination
working per tensor (or refused) flat and two-level on Gloo ranks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gracecomm
import gracecomm.pipeline
from gracecomm import ConfigError, register_comm_hook
from gracecomm.compressors.cast import Cast
from gracecomm.registry import COMPRESSORS
from gracecomm.strategy import (
    COMPRESSED,
    DENSE,
    FORMS,
    FP16,
    LOSSLESS,
    METHOD,
    MIXED,
    PLANS,
    Model,
    Strategy,
    TensorCost,
    choose,
)
from tests.helpers import agreed_on_every_rank, buildable, registered_combinations, run_ranks
from tests.test_hierarchy import as_nodes, grads

SLOW_LINK = Model(latency_s=1e-3, bandwidth_bps=1.25e6, world=4, decompressions=5)  # 10 Mbit/s
FAST_LINK = Model(latency_s=50e-6, bandwidth_bps=1.25e9, world=4, decompressions=5)  # 10 Gbit/s


def cost(numel: int, ratio: float = 0.01, compute_s: float = 1e-3) -> TensorCost:
    """A float32 tensor whose Top-k payload keeps `ratio` (value and index, 8 bytes each)."""
    return TensorCost(numel, 4, max(1, int(numel * ratio)) * 8.0, compute_s, compute_s / 4,
                      compute_s / 10)


def allgather_of(costs: list[TensorCost]) -> dict[str, list[float]]:
    """What an allgather of the costs' payloads records: world x the payload, one call."""
    return {"allgather": [1, SLOW_LINK.world * sum(c.payload_bytes for c in costs)]}


def test_a_slow_link_compresses_large_tensors_and_sends_small_ones_with_them():
    costs = [cost(1_000_000), cost(64, compute_s=1e-4)]
    forms, compressed_s, chosen_s = choose(costs, allgather_of(costs), SLOW_LINK)
    # the bias costs less compressed than in an allreduce of its own, whose latency it pays
    assert forms == [COMPRESSED, COMPRESSED]
    assert chosen_s == pytest.approx(compressed_s)


def test_a_fast_link_sends_dense_and_small_tensors_never_pay_a_round_of_their_own():
    costs = [replace(cost(1_000_000, compute_s=20e-3), fp16_s=5e-3), cost(64, compute_s=1e-4)]
    forms, compressed_s, chosen_s = choose(costs, allgather_of(costs), FAST_LINK)
    assert forms == [DENSE, DENSE]
    assert chosen_s < compressed_s
    # fp16 where the cast is cheap and the bytes still count
    cheap = [replace(cost(1_000_000, compute_s=20e-3), fp16_s=1e-5)]
    assert choose(cheap, allgather_of(cheap), FAST_LINK)[0] == [FP16]
    # fp16 and dense alone, one form for the whole bucket: the cheaper in total
    both = [*cheap, replace(cost(64), fp16_s=1e-3)]  # a dear cast, worth a second round
    assert choose(both, allgather_of(both), FAST_LINK, (FP16, DENSE))[0] == [FP16, DENSE]
    assert choose(both, allgather_of(both), FAST_LINK, (FP16, DENSE), mix=False)[0] == [FP16] * 2


def test_mixed_forms_where_the_latency_of_a_second_collective_pays():
    costs = [cost(4_000_000, compute_s=5e-3), cost(2_000_000, ratio=0.5, compute_s=80e-3)]
    forms, compressed_s, chosen_s = choose(costs, allgather_of(costs), SLOW_LINK)
    assert forms[0] == COMPRESSED and forms[1] != COMPRESSED
    assert chosen_s < compressed_s


def test_each_plan_where_it_saves_enough_of_a_step():
    """A 10 Mbit/s link, a tensor Top-k sends cheaply and one that costs less in fp16: the
    method throughout saves most over fp16 and dense, mixing saves a little more. Whether
    each gain is worth `min_saving` (0.2) of a step picks the plan."""
    costs = {"w": cost(4_000_000, compute_s=5e-3),
             "v": cost(100_000, ratio=0.5, compute_s=10e-3)}
    recorded = allgather_of(list(costs.values()))
    _, method_s, mixed_s = choose(list(costs.values()), recorded, SLOW_LINK)
    lossless_s = choose(list(costs.values()), recorded, SLOW_LINK, (FP16, DENSE))[2]
    assert lossless_s - method_s > 10 * (method_s - mixed_s) > 0
    link = [SLOW_LINK.latency_s, SLOW_LINK.bandwidth_bps]
    for step_s, plan, w, v in (((method_s - mixed_s) / 0.4, MIXED, COMPRESSED, FP16),
                               ((lossless_s - method_s) / 0.4, METHOD, COMPRESSED, COMPRESSED),
                               ((lossless_s - mixed_s) / 0.1, LOSSLESS, FP16, FP16)):
        strategy = Strategy()
        strategy.recorded = [(["w", "v"], recorded)]
        strategy.decide(link, costs, SLOW_LINK.world, SLOW_LINK.decompressions, step_s)
        assert (strategy.plan, strategy.forms) == (plan, {"w": w, "v": v})
        assert PLANS[plan] in strategy.table()


def test_the_step_penalty_weighs_the_plans_that_compress():
    """The method saves far more than `min_saving` of a step over fp16 and dense, so step
    time alone (a penalty of 1) takes it; a penalty that makes its step times the penalty
    longer than the lossless plan's step takes fp16 and dense, and so does one of inf (a
    method that missed the target)."""
    costs = {"w": cost(4_000_000, compute_s=5e-3)}
    recorded = allgather_of(list(costs.values()))
    _, method_s, _ = choose(list(costs.values()), recorded, SLOW_LINK)
    lossless_s = choose(list(costs.values()), recorded, SLOW_LINK, (FP16, DENSE))[2]
    step_s = 2 * method_s  # compute as long as the method's exchange
    lossless_step = step_s - method_s + lossless_s
    worth = (lossless_step - 0.2 * step_s) / step_s  # the largest penalty the method survives
    assert worth > 2
    link = [SLOW_LINK.latency_s, SLOW_LINK.bandwidth_bps]
    for penalty, plan in ((1.0, METHOD), (0.99 * worth, METHOD), (1.01 * worth, LOSSLESS),
                          (math.inf, LOSSLESS)):
        strategy = Strategy(step_penalty=penalty)
        strategy.recorded = [(["w"], recorded)]
        strategy.decide(link, costs, SLOW_LINK.world, SLOW_LINK.decompressions, step_s)
        assert strategy.plan == plan, penalty
        assert f"step_penalty {penalty:.3g}" in strategy.table()
    with pytest.raises(ConfigError, match=r"'step_penalty' must be a number in \[1.0, inf\)"):
        Strategy(step_penalty=0.5)


def test_one_process_sends_everything_dense_and_records_the_decision():
    grace = gracecomm.build({"name": "topk", "ratio": 0.1}, strategy="auto")
    assert repr(grace).endswith("strategy='auto')")
    named = [("w", torch.randn(50, 20)), ("b", torch.randn(50))]
    for _ in range(4):  # the decision at the start of the fourth
        grace.step_many(named)
    assert grace.strategy.forms == {"w": DENSE, "b": DENSE}  # no link: nothing to save
    assert grace.metrics.pop()["decisions"] == 1
    assert "bucket" in grace.strategy.table() and grace.strategy.decision[0]["dense"] == 2


def test_the_probe_sends_no_more_than_the_largest_bucket(monkeypatch):
    """The link's probe stops at the largest bucket's dense bytes (the sizes the choice
    prices), or at 64 KiB for smaller models; on a link this fast it never takes 30 ms."""
    strategy = Strategy(warmup_steps=1)
    link = None  # kept beside the bucket, not read until the decision
    strategy.keep([("w", torch.zeros(50_000)), ("b", torch.zeros(100))], link)
    strategy.keep([("v", torch.zeros(10))], link)
    strategy.end_step()
    assert strategy.largest_bucket_nbytes() == 4 * 50_100
    sent: list[int] = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "all_reduce", lambda buf, group=None: sent.append(4 * buf.numel()))
    latency, bandwidth = gracecomm.strategy.probe(None, torch.device("cpu"),
                                                  strategy.largest_bucket_nbytes())
    assert max(sent) == 4 * 50_100 and sorted(set(sent)) == [4, 8, 65536, 200400]
    assert latency >= 0 and bandwidth > 0
    sent.clear()
    gracecomm.strategy.probe(None, torch.device("cpu"), 1000)
    assert max(sent) == 65536


def test_error_feedback_follows_a_change_of_form(monkeypatch):
    """A tensor sent whole (dense or fp16) carries its residual once and leaves none; two
    tensors of one form go as one (joined): one fp16 cast of both."""
    grace = gracecomm.build({"name": "topk", "ratio": 0.25}, strategy=Strategy(warmup_steps=5))
    g1, g2 = torch.arange(8.0) - 3.5, torch.linspace(-1, 1, 8)
    names = ("w", "u", "v", "x")  # w and u go dense, v and x in fp16
    grace.step_many([(name, g1 * (i + 1)) for i, name in enumerate(names)])
    residuals = {name: grace.memory.residuals[name].clone() for name in names}
    assert all(r.abs().sum() > 0 for r in residuals.values())
    grace.strategy.forms.update(w=DENSE, u=DENSE, v=FP16, x=FP16)
    cast = []  # the elements of each fp16 compression
    compress = Cast.compress
    monkeypatch.setattr(Cast, "compress", lambda self, t, name: (cast.append(t.numel()),
                                                                 compress(self, t, name))[1])
    means = grace.step_many([(name, g2 * (i + 1)) for i, name in enumerate(names)])
    for i, (name, mean) in enumerate(zip(names, means)):
        sent = g2 * (i + 1) + residuals[name]
        assert torch.equal(mean, sent if name in "wu" else sent.half().float())
    assert cast == [16] and not grace.memory.residuals
    means = grace.step_many([(name, g2 * (i + 1)) for i, name in enumerate(names)])
    for i, (name, mean) in enumerate(zip(names, means)):  # nothing left to carry
        sent = g2 * (i + 1)
        assert torch.equal(mean, sent if name in "wu" else sent.half().float())


def test_momentum_correction_follows_a_change_of_form():
    """DGC's memory (`Memory.update_sent_whole`'s default): a tensor sent whole clears its
    accumulation and keeps its momentum, as a step that sends every element does."""
    grace = gracecomm.build({"name": "topk", "ratio": 0.25}, "dgc",
                            strategy=Strategy(warmup_steps=5))
    grad = torch.arange(8.0) - 3.5
    grace.step_many([("w", grad), ("b", grad)])
    grace.strategy.forms.update(w=DENSE, b=FP16)
    momentum = {name: grace.memory.u[name] * 0.9 + grad for name in "wb"}
    grace.step_many([("w", grad), ("b", grad)])
    for name in "wb":
        assert not grace.memory.v[name].any()
        torch.testing.assert_close(grace.memory.u[name], momentum[name])


def test_state_round_trip_keeps_the_decision():
    def run(grace: gracecomm.Grace, steps: range) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        out = []
        for step in range(steps.stop):
            named = [("w", torch.randn(40, 10, generator=gen)),
                     ("b", torch.randn(40, generator=gen))]
            if step in steps:
                out += grace.step_many(named)
        return out

    spec = {"name": "topk", "ratio": 0.1}
    first = gracecomm.build(spec, strategy=Strategy(warmup_steps=1))
    run(first, range(3))
    saved = first.state_dict()
    assert saved["strategy"]["forms"] == first.strategy.forms and saved["strategy"]["decisions"]
    again = gracecomm.build(spec, strategy="auto")
    again.load_state_dict(saved)
    assert again.strategy.forms == first.strategy.forms
    for a, b in zip(run(first, range(3, 5)), run(again, range(3, 5))):
        assert torch.equal(a, b)


def test_refusals_and_options():
    with pytest.raises(ConfigError, match="strategy 'auto'.*whole model.*strategy=fixed"):
        gracecomm.build("lgc_rar", strategy="auto")
    with pytest.raises(ConfigError, match="memory 'efsignsgd' cannot follow.*strategy=fixed"):
        gracecomm.build("efsignsgd", strategy="auto")
    with pytest.raises(ConfigError, match="option 'strategy' must be one of 'fixed', 'auto'"):
        gracecomm.build("topk", strategy="best")
    with pytest.raises(ConfigError, match="'warmup_steps'"):
        Strategy(warmup_steps=0)


def _agree(rank: int, world: int) -> None:
    """Rank 1 measures a link 100x slower and compression 1000x dearer: the decision is
    still the same on both ranks."""
    if rank == 1:
        probe, measure = gracecomm.pipeline.probe, gracecomm.pipeline.measure_costs
        gracecomm.pipeline.probe = lambda *a: [x * y for x, y in zip(probe(*a), (100, 0.01))]
        gracecomm.pipeline.measure_costs = lambda *a: {
            name: [*c[:3], *(1000 * x for x in c[3:])] for name, c in measure(*a).items()}
    grace = gracecomm.build({"name": "topk", "ratio": 0.05},
                            strategy=Strategy(warmup_steps=1, min_saving=0.0))
    for step in range(3):
        means = grace.step_many(grads(rank, step))
    decided = [None] * world
    dist.all_gather_object(decided, (grace.strategy.forms, grace.strategy.decision,
                                     grace.strategy.link))
    assert decided[0] == decided[1] and decided[0][0]
    agreed_on_every_rank(torch.cat([m.reshape(-1) for m in means]), "the step's means")


@pytest.mark.slow
def test_the_decision_is_the_same_on_every_rank_whatever_each_measured():
    run_ranks(_agree, 2, timeout_s=120)


def _ddp_async(rank: int, world: int) -> None:
    """The same decision (its measurements pinned: under load, timings differ from run to
    run) and the same parameters, asynchronous or not."""
    measure = gracecomm.pipeline.measure_costs
    gracecomm.pipeline.probe = lambda *a: [2e-4, 5e4]
    gracecomm.pipeline.measure_costs = lambda *a: {
        name: [*c[:3], 1e-3, 1e-4, 1e-4] for name, c in measure(*a).items()}
    results = []
    for asynchronous in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
        grace = gracecomm.build({"name": "topk", "ratio": 0.2},
                                strategy=Strategy(warmup_steps=2, min_saving=0.0))
        ddp = DistributedDataParallel(model, bucket_cap_mb=1e-4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        register_comm_hook(ddp, grace, opt, asynchronous=asynchronous)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(5):
            opt.zero_grad()
            ddp(torch.randn(8, 12, generator=gen)).square().mean().backward()
            opt.step()
        assert grace.strategy.decisions == 1 and len(grace.strategy.decision) > 1  # buckets
        results.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                        grace.strategy.forms))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]


@pytest.mark.slow
def test_ddp_hook_asynchronous_equals_synchronous():
    run_ranks(_ddp_async, 2, timeout_s=120)


def _ddp_whole(rank: int, world: int) -> None:
    results = []
    for whole in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
        grace = gracecomm.build({"name": "topk", "ratio": 0.2},
                                strategy=Strategy(warmup_steps=10))
        if not whole:
            grace.sends_whole = lambda names: False
        ddp = DistributedDataParallel(model)  # one bucket
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        register_comm_hook(ddp, grace, opt)
        cast: list[str] = []  # the name of each fp16 compression
        compress = Cast.compress
        Cast.compress = lambda self, t, name: (cast.append(name), compress(self, t, name))[1]
        gen = torch.Generator().manual_seed(rank)
        try:
            for step in range(5):
                if step == 2:  # residuals left from two compressed steps
                    grace.strategy.forms.update((n, FP16) for n in grace.memory.residuals)
                opt.zero_grad()
                ddp(torch.randn(8, 12, generator=gen)).square().mean().backward()
                opt.step()
        finally:
            Cast.compress = compress
        assert not grace.memory.residuals and len(cast) == 3
        assert ["+" in name for name in cast] == [True, not whole, not whole], cast
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(*results)


@pytest.mark.slow
def test_ddp_hook_sends_a_bucket_whole_once_it_has_no_residual_left():
    """Once every gradient of a bucket goes in one whole form (fp16 here) and the memory
    keeps nothing for them, the hook sends the bucket's buffer as one tensor, as fixed fp16
    does: the same parameters as gradient by gradient (joined)."""
    run_ranks(_ddp_whole, 2, timeout_s=120)


def _walk(rank: int, world: int, hierarchy: str) -> None:
    """Every registered compressor x memory x communicator that builds (defaults; two-level,
    each compressor with its default memory and communicator):
    with ``strategy="auto"`` it is refused with a message naming the strategy, or it runs
    five steps (a decision after the second) whose means are finite and the same on every
    rank, the forms then set to each of the three in turn (the probed link: 400 kbit/s)."""
    as_nodes(rank, 2)
    gracecomm.pipeline.probe = lambda *a: [2e-4, 5e4]
    combos = (registered_combinations() if hierarchy == "flat" else
              [(c, None, None) for c in COMPRESSORS.available()])  # each makes node groups
    refused, worked, forms = set(), 0, set()
    for combo in buildable(combos):
        try:
            grace = gracecomm.build(*combo, hierarchy=hierarchy,
                                    strategy=Strategy(warmup_steps=2, min_saving=0.0))
        except ConfigError as err:
            assert "strategy" in str(err), (combo, err)
            refused.add(combo[0] if combo[0].startswith("lgc") else combo[1] or combo[0])
            continue
        means = []
        for step in range(5):
            means.append(torch.cat([m.reshape(-1) for m in grace.step_many(grads(rank, step))]))
            if step == 2:  # then every form in turn, whatever was decided
                decided = grace.strategy.forms
                forms.update(decided.values())
                decided.update((n, FORMS[i % 3]) for i, n in enumerate(sorted(decided)))
        agreed_on_every_rank(torch.cat(means), combo)
        assert grace.strategy.decisions == 1, combo
        worked += 1
    assert refused == {"lgc_ps", "lgc_rar", "efsignsgd"}
    assert worked > (100 if hierarchy == "flat" else 20) and COMPRESSED in forms, (worked, forms)


@pytest.mark.slow
@pytest.mark.parametrize("hierarchy", ["flat", "node"])
def test_every_registered_combination_works_per_tensor_or_is_refused(hierarchy: str) -> None:
    run_ranks(_walk, 4, hierarchy, timeout_s=600)
