"""LGC on several Gloo ranks (distributed and training checks): exact means
in phase 1, top-k means with stand-in autoencoders, identical aggregates on every rank,
bytes that match the formulas of docs/lgc.md, and 2- and 4-rank runs of the training entry point."""

from statistics import fmean as mean

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gracecomm
from gracecomm.compressors.lgc.autoencoder import padded_length
from gracecomm.compressors.lgc.ps import LGCPS
from gracecomm.compressors.lgc.rar import LGCRar
from gracecomm.experiments.reports.lgc import phase_rows, report
from gracecomm.experiments.reports.tables import read_run
from gracecomm.experiments.workloads.models import ReferenceCNN
from tests.helpers import run_ranks
from tests.test_lgc import model_grads
from tests.test_parameter_server import same_on_every_rank
from tests.test_train import records, train


class Fold(nn.Module):
    """Stand-in encoder: the identity, folded into 4 channels."""

    def forward(self, x):
        return x.reshape(x.shape[0], 4, -1)


class Unfold(nn.Module):
    def forward(self, z):
        return z.reshape(z.shape[0], 1, -1)


def rank_grads(model, rank, step=0):
    return model_grads(model, 1000 * step + rank)


def topk_mean(model, plan, world_size, chooser):
    """Mean over ranks of each rank's values at `chooser(rank)`'s top-k indices (F dense)."""
    tensors = [[t for _, t in rank_grads(model, r)] for r in range(world_size)]
    out = [torch.zeros_like(t) for t in tensors[0]]
    for r in range(world_size):
        indices = plan.topk(tensors[chooser(r)])
        for i in plan.dense:
            out[i] += tensors[r][i] / world_size
        for i, idx in zip(plan.sparse, indices):
            out[i].view(-1)[idx] += tensors[r][i].reshape(-1)[idx] / world_size
    return out


def check_phases(rank, world_size):
    torch.manual_seed(0)
    model = ReferenceCNN()
    grads = rank_grads(model, rank)
    # phase 1 is the exact mean gradient under both communicators
    for name in ("lgc_rar", "lgc_ps"):
        outs = gracecomm.build({"name": name, "ratio": 0.01}).step_many(grads)
        for (n, t), out in zip(grads, outs):
            mean = t.clone()
            dist.all_reduce(mean)
            assert torch.allclose(out, mean / world_size, atol=1e-6), (name, n)
    # RAR with an identity autoencoder and unscaled inputs: the leader-index top-k mean
    rar = LGCRar(ratio=0.01, warmup_iters=0, ae_train_iters=0, ae={"input_scale": "none"})
    g = gracecomm.build(rar)
    rar.ensure_autoencoder(torch.device("cpu"))
    rar.encoder, rar.decoders, rar.synced = Fold(), nn.ModuleList([Unfold()]), True
    outs = g.step_many(grads)
    want = topk_mean(model, rar._plan, world_size, lambda r: rar.leader_at(0))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(outs, want))
    # PS with beta = 1 and decoders that return their innovation channel: the mean of every
    # rank's values at its own top-k indices, or at the leader's (the last rank's)
    for indices, chooser in (("own", lambda r: r), ("leader", lambda r: world_size - 1)):
        ps = LGCPS(ratio=0.01, warmup_iters=0, ae_train_iters=0, innovation={"beta": 1.0},
                   indices=indices)
        g = gracecomm.build(ps)
        ps.ensure_autoencoder(torch.device("cpu"))
        with torch.no_grad():
            for decoder in ps.decoders:
                decoder.out.weight[0, :-1] = 0
        outs = g.step_many(grads)
        want = topk_mean(model, ps._plan, world_size, chooser)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(outs, want)), indices


def run_variant(name, model, rank, steps, **options):
    """Train-free run through the three phases; checks that every rank ends each step with
    the same aggregate and that the bytes match the formulas of docs/lgc.md."""
    g = gracecomm.build({"name": name, "ratio": 0.01, "warmup_iters": 1, "ae_train_iters": 2,
                     **options})
    comp, history = g.compressor, []
    for step in range(steps):
        phase = comp.phase
        outs = g.step_many(rank_grads(model, rank, step))
        assert same_on_every_rank(torch.cat([o.reshape(-1) for o in outs])), (name, step)
        stats = g.metrics.pop()
        parts = sum(v for k, v in stats.items() if k.startswith("lgc_") and k.endswith("_bytes")
                    and k not in ("lgc_leader_bytes", "lgc_others_bytes"))
        assert stats["wire_bytes"] == parts + stats.get("ae_sync_bytes", 0), (name, step)
        history.append((phase, stats))
    return comp, history


def check_variants(rank, world_size):
    torch.manual_seed(0)
    model = ReferenceCNN()
    # LGC_RAR: aggregates and autoencoder weights are bit-identical on every rank
    rar, history = run_variant("lgc_rar", model, rank, 8)
    plan = rar._plan
    mu_pad = padded_length(plan.mu)
    weights = nn.utils.parameters_to_vector([*rar.encoder.parameters(),
                                             *rar.decoders.parameters()])
    assert same_on_every_rank(weights.detach())
    leaders = torch.tensor([rar.leader_at(t) for t in range(50)])
    assert same_on_every_rank(leaders)
    rar_bytes = []
    for phase, stats in history:
        if phase == 3:
            assert stats["lgc_latent_bytes"] == mu_pad  # mu_pad / 4 fp32 values
            expect = 4 * plan.n_dense + mu_pad + 4 * plan.kappa + 4
            expect += stats.get("lgc_index_bytes", 0) if stats["lgc_is_leader"] else 0
            assert stats["wire_bytes"] - stats.get("ae_sync_bytes", 0) == expect
            if "ae_sync_bytes" not in stats:
                rar_bytes.append(stats["wire_bytes"])
    # LGC_PS: the leader (the last rank) sends the latent, the others only innovation; with
    # indices: leader, the leader's index stream is its broadcast and the others send none
    leader = world_size - 1
    for indices in ("leader", "own"):  # the own-index bytes stay for the check below
        ps, history = run_variant("lgc_ps", model, rank, 6, indices=indices)
        topk_bytes, ps_bytes, index_bytes = [], [], []
        for phase, stats in history:
            index = stats["lgc_index_bytes"] if phase > 1 else 0
            index_bytes.append(index)
            if phase == 2:  # the top-k baseline: F dense, top-k values, DEFLATE indices
                assert stats["wire_bytes"] == (4 * plan.n_dense + 4 * (plan.mu + plan.kappa)
                                               + index)
                topk_bytes.append(stats["wire_bytes"])
            if phase == 3:
                expect = (4 * plan.n_dense + 4 * plan.nu + 4 * plan.kappa + 4 + index
                          + (mu_pad if rank == leader else 0))
                assert stats["wire_bytes"] - stats.get("ae_sync_bytes", 0) == expect
                if "ae_sync_bytes" not in stats:
                    ps_bytes.append(stats["wire_bytes"])
                if rank == 0 and world_size > 1:  # the master logs the bytes it received
                    assert stats["lgc_others_bytes"] < stats["lgc_leader_bytes"]
        # the master charges the leader's broadcast to the leader
        wire = torch.tensor([s["wire_bytes"] - s.get("ae_sync_bytes", 0) for _, s in history])
        per_rank = [torch.empty_like(wire) for _ in range(world_size)]
        dist.all_gather(per_rank, wire)
        if rank == 0 and world_size > 1:
            assert [s["lgc_leader_bytes"] for _, s in history] == per_rank[leader].tolist()
        if indices == "leader" and rank != leader:  # phase 2: nothing; phase 3: Idx(P) only
            assert index_bytes[1:3] == [0, 0] and 0 < max(index_bytes[3:]) < 2 * plan.nu
    if world_size == 2:  # reference CNN, alpha 0.01
        means = torch.tensor([sum(rar_bytes) / len(rar_bytes), sum(ps_bytes) / len(ps_bytes),
                              sum(topk_bytes) / len(topk_bytes)], dtype=torch.float64)
        per_rank = [torch.empty_like(means) for _ in range(world_size)]
        dist.all_gather(per_rank, means)
        rar_mean = (per_rank[0][0] + per_rank[1][0]) / 2
        ps_leader, ps_other, topk = per_rank[leader][1], per_rank[0][1], per_rank[0][2]
        assert rar_mean < ps_leader < topk and ps_other < ps_leader
        assert topk >= 1.8 * rar_mean  # RAR cr_total >= 1.8 x top-k cr_total


def check_lgc(rank, world_size):
    check_phases(rank, world_size)
    check_variants(rank, world_size)


def smooth(n, gen):
    """A smooth random vector: i.i.d. normals low-pass filtered by a Gaussian (sigma 8)."""
    kernel = torch.exp(-0.5 * (torch.arange(-32, 33) / 8.0) ** 2)
    w = torch.randn(n + 64, generator=gen)
    return nn.functional.conv1d(w.view(1, 1, -1), kernel.view(1, 1, -1)).view(-1)[:n]


def check_ps_learns_a_common_part(rank, world_size, lr, learns):
    """Every worker's gradient is a common smooth vector, new every step, plus 10% of
    worker-specific noise (memory none, so the vectors stay that way). Gate: in phase 3 the
    master's own vector, decoded from the leader's latent and its innovation, has rho <= 0.6
    rho_innov. Measured: rho 0.28 against rho_innov 0.83 after 120 training steps (0.34x); an
    autoencoder that does not learn (lr 1e-12: its pass-through initialisation) gives 0.832
    against 0.831 (1.00x), so the gate lies between the two with room on both sides."""
    g = gracecomm.build({"name": "lgc_ps", "ratio": 0.05, "warmup_iters": 0, "ae_train_iters": 120,
                     "ae": {"lr": lr}}, "none")
    sizes = {"first.weight": 16, "mid.weight": 8192, "mid2.weight": 8192, "last.weight": 32}
    rho, innov = [], []
    for step in range(130):
        common = torch.Generator().manual_seed(1000 + step)
        own = torch.Generator().manual_seed(10_000 * (rank + 1) + step)
        g.step_many([(name, smooth(n, common) + 0.1 * torch.randn(n, generator=own))
                     for name, n in sizes.items()])
        stats = g.metrics.pop()
        if rank == 0 and stats["lgc_phase"] == 3:
            rho.append(stats["lgc_rho"])
            innov.append(stats["lgc_rho_innov"])
    if rank == 0:
        assert len(rho) == 10 and 0.5 < mean(innov) < 1
        assert (mean(rho) <= 0.6 * mean(innov)) == learns, (mean(rho), mean(innov))


@pytest.mark.slow
@pytest.mark.parametrize("lr,learns", [(1e-3, True), (1e-12, False)])
def test_ps_autoencoder_learns_what_workers_share(lr, learns):
    run_ranks(check_ps_learns_a_common_part, 2, lr, learns, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_lgc_on_several_ranks(world_size):
    run_ranks(check_lgc, world_size, timeout_s=240)


LGC_RUN = ("compressor.ratio=0.01", "compressor.warmup_iters=4", "compressor.ae_train_iters=12",
           "trainer.max_steps=24")


@pytest.mark.slow
@pytest.mark.parametrize("name,world_size,index_format,options", [
    ("lgc_rar", 2, "int32", ()),
    ("lgc_ps", 4, "varint", ("compressor.indices=leader",))])  # default indices: the spec run
def test_lgc_trains_through_its_phases(tmp_path, name, world_size, index_format, options):
    proc = train(tmp_path, f"compressor={name}", f"trainer.world_size={world_size}",
                 f"compressor.index_coding.format={index_format}", *LGC_RUN, *options)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in records(tmp_path / "run" / "metrics.jsonl") if r["type"] == "step"]
    assert [s["lgc_phase"] for s in steps] == [1] * 4 + [2] * 12 + [3] * 8
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
    assert all("lgc_recon_loss" in s for s in steps[4:16])
    if name == "lgc_ps":  # mean slot-wise cosine of the workers' vectors, a diagnostic
        assert all(-1 <= s["lgc_worker_cos"] <= 1 for s in steps[4:16])
    assert sum("ae_sync_bytes" in s for s in steps) == 1  # rank 0 trains and sends the weights
    wire = [s["wire_bytes"] - s.get("ae_sync_bytes", 0) for s in steps]
    assert max(wire[16:]) < min(wire[4:16]) < min(wire[:4]) / 10
    summary = records(tmp_path / "run" / "metrics.jsonl")[-1]
    assert summary["communicator"] == ("allreduce" if name == "lgc_rar" else "parameter_server")
    rows = phase_rows(read_run(tmp_path / "run"))  # the per-phase report
    assert [(r["phase"], r["steps"]) for r in rows] == [(1, 4), (2, 12), (3, 8)]
    assert rows[2]["wire_bytes"] == sum(wire[16:]) / 8 and rows[1]["ae_ms"] > 0
    table = report([read_run(tmp_path / "run")])
    assert "| lgc_" in table and ("format=varint |" in table) == (index_format == "varint")


# LGC training checks: reference CNN, K = 2, alpha = 0.001, the default phases
# (200 dense, 300 top-k + autoencoder training, then compressed), 1000 iterations, lr 0.1,
# prototypes at noise 1.5 (the data config's default).
SPEC_TRAINING = ("model=reference_cnn", "data=prototypes", "compressor.ratio=0.001",
                 "trainer.max_steps=1000", "trainer.epochs=100", "trainer.lr=0.1",
                 "trainer.eval_every=100")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lgc_rar", "lgc_ps"])
def test_lgc_spec_training_run(tmp_path, name):
    """Finite losses; RAR's relative reconstruction error rho falls to <= 0.8x its start over
    phase 2 (measured 0.56x). PS: the phase-3 check, rho < 1 over the last 50 phase-2 steps
    and over phase 3 (the master's own vector, decoded from the leader's latent), which a
    decoder that passes its innovation through meets on its own (rho = rho_innov, about
    0.75): at this scale the PS autoencoder does not learn beyond its innovation (docs/lgc.md),
    and test_ps_autoencoder_learns_what_workers_share is the gate on its learning. The
    training loss of phase 3 falls by 10% (measured 0.79x RAR, 0.68x PS); held-out accuracy
    at least twice chance (measured 0.52 and 0.60). PS at the leader's indices runs through
    its phases in test_lgc_trains_through_its_phases."""
    proc = train(tmp_path, f"compressor={name}", *SPEC_TRAINING, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in recs if r["type"] == "step"]
    assert len(steps) == 1000
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
    phase2 = [s for s in steps if s["lgc_phase"] == 2]
    phase3 = [s for s in steps if s["lgc_phase"] == 3]
    assert (len(phase2), len(phase3)) == (300, 500)
    rho = [s["lgc_rho"] for s in phase2]
    assert all(torch.isfinite(torch.tensor(rho)))
    if name == "lgc_rar":
        assert mean(rho[-50:]) <= 0.8 * mean(rho[:20])
    else:
        assert mean(rho[-50:]) < 1 and mean(s["lgc_rho"] for s in phase3) < 1
    loss = [s["loss"] for s in phase3]
    assert mean(loss[-100:]) <= 0.9 * mean(loss[:100])
    assert recs[-1]["test_acc"] >= 0.2
