"""PowerSGD (single process; the two-rank rounds are in test_quantizers_distributed)."""

import pytest
import torch

import gracecomm
from gracecomm.compressors.powersgd import PowerSGD, next_value, orthonormalize
from gracecomm.experiments.training.config import build_grace
from gracecomm.memories.dgc import DGCMemory
from gracecomm.validation import IncompatibleError, PayloadError
from tests.helpers import compose_train


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_bytes_per_step_are_r_times_n_plus_m_floats_per_matrix():
    g = gracecomm.build({"name": "powersgd", "rank": 2})
    shapes = {"conv": (16, 8, 3, 3), "fc": (64, 512), "bias": (64,), "tiny": (2, 3)}
    g.step_many([(name, gaussian(*shape)) for name, shape in shapes.items()])
    stats = g.metrics.pop()
    compressed = 2 * ((16 + 72) + (64 + 512))  # P (n r) through comm.all_reduce + Q (m r)
    dense = 64 + 6  # biases and matrices where r (n + m) >= n m go uncompressed
    assert stats["wire_bytes"] == 4 * (compressed + dense)


def test_a_matrix_of_rank_at_most_r_is_recovered_in_one_step():
    u, v = gaussian(40, 2, seed=1), gaussian(2, 30, seed=2)
    m = u @ v
    g = gracecomm.build({"name": "powersgd", "rank": 2}, "none")
    assert torch.allclose(g.step(m, "w"), m, atol=1e-4)


def test_error_feedback_and_warm_start(tmp_path):
    m = gaussian(30, 20, seed=3)
    g = gracecomm.build({"name": "powersgd", "rank": 1})
    out = g.step(m, "w")
    assert torch.allclose(g.memory.residuals["w"], m - out, atol=1e-6)
    q = g.compressor.q["w"]
    assert q.shape == (20, 1)
    # warm start: repeated steps on the same matrix converge to its best rank-1 part
    for _ in range(30):
        g.memory.residuals.clear()
        out = g.step(m, "w")
    u, s, vh = torch.linalg.svd(m)
    assert torch.allclose(out, s[0] * torch.outer(u[:, 0], vh[0]), atol=1e-3)
    torch.save(g.compressor.state_dict(), tmp_path / "q.pt")
    resumed = PowerSGD(rank=1)
    resumed.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    assert torch.equal(resumed.q["w"], g.compressor.q["w"])


def test_orthonormalize_handles_zero_and_dependent_columns():
    p = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [1.0, 2.0, 0.0]])
    q = orthonormalize(p)
    assert torch.allclose(q[:, 0].norm(), torch.tensor(1.0))
    assert torch.allclose(q[:, 1:], torch.zeros(3, 2), atol=1e-6)
    g = gracecomm.build("powersgd")
    assert torch.equal(g.step(torch.zeros(10, 10), "z"), torch.zeros(10, 10))


def test_other_dtypes_and_refused_pairings():
    g = gracecomm.build("powersgd")
    for x in (gaussian(8, 9).half(), gaussian(8, 9).double(), torch.tensor(1.0), torch.empty(0)):
        out = g.step(x, f"t{x.dtype}{x.dim()}")
        assert out.shape == x.shape and out.dtype == x.dtype
    with pytest.raises(IncompatibleError, match="allreduce"):
        gracecomm.build("powersgd", communicator="allgather")


def test_dgc_memory_is_refused_with_the_reason():
    """DGC's momentum factor masking clears what a compressor sent; PowerSGD's low-rank
    payload approximates every element, so the memory would clear its whole accumulation
    each step and PowerSGD would lose its error feedback: refused when built, which is
    before any worker starts on the command line (``compressor=powersgd memory=dgc``)."""
    with pytest.raises(IncompatibleError, match="low-rank approximation of every element.*"
                       "use memory=residual"):
        gracecomm.build("powersgd", "dgc")
    with pytest.raises(IncompatibleError, match="memory 'dgc'"):
        build_grace(compose_train("compressor=powersgd", "memory=dgc"))

    class Unchecked(DGCMemory):  # the pairing as it ran before the check
        def check(self, compressor):
            pass

    pipe = gracecomm.Grace(PowerSGD(), Unchecked(), gracecomm.create("communicator",
                                                                      "allreduce"))
    pipe.step(gaussian(8, 9), "w")
    assert torch.count_nonzero(pipe.memory.u["w"]) == 72  # the momentum, kept
    assert torch.count_nonzero(pipe.memory.v["w"]) == 0   # the error M - P Q^T: cleared


def test_malformed_payloads_raise():
    c = PowerSGD()
    payload, ctx = c.compress(gaussian(10, 10), "w")
    with pytest.raises(PayloadError, match="shape"):
        c.decompress((payload[0][:-1],), ctx)
    with pytest.raises(PayloadError, match="tensors"):
        c.decompress(payload * 2, ctx)


def layout_rounds(rank, world_size):
    pipe = gracecomm.build({"name": "powersgd", "rank": 2, "start_iter": 2})
    tensors = [("w", torch.randn(16, 8) * (rank + 1)), ("b", torch.randn(8))]
    rounds = []
    for _ in range(5):
        pipe.step_many(tensors)
        rounds.append(pipe.metrics.pop().get("coll_allgather_calls", 0))
    # the layout is agreed once in the dense warm-up and once when compression starts
    assert rounds == [1, 0, 1, 0, 0], rounds


@pytest.mark.slow
def test_layout_is_agreed_once_per_phase():
    from tests.helpers import run_ranks
    run_ranks(layout_rounds, 2)


def test_local_error_is_the_difference_with_the_decompressed_payload():
    """`subtract_decompressed` (residual memory's update with reference own) gives the bits
    of t - decompress(payload) without keeping the local Q as the warm start."""
    from gracecomm.buffers import difference
    comp = PowerSGD(rank=2)
    torch.manual_seed(0)
    named = [("w", torch.randn(16, 3, 3, 3)), ("b", torch.randn(16))]
    for (_, t), (payload, ctx) in zip(named, next_value(comp.compress_rounds(named, None))):
        kept = dict(comp.q)
        local = comp.subtract_decompressed(t, payload, ctx)
        assert comp.q == kept  # the warm start is the aggregate's, set by decompress
        assert torch.equal(local, difference(t, comp.decompress(payload, ctx)))


def test_batched_memory_calls_give_the_per_tensor_results():
    """Residual memory's `compensate_many` / `update_mean_many` (one foreach call for the
    small tensors) equal `compensate` / `update_mean` tensor by tensor."""
    from gracecomm.memories.residual import ResidualMemory
    torch.manual_seed(0)
    named = [(f"t{i}", torch.randn(s)) for i, s in enumerate([(8, 4), (8,), (3, 3, 2)])]
    means = [torch.randn_like(t) for _, t in named]
    comp = PowerSGD(rank=1)
    ctxs = [ctx for _, ctx in next_value(comp.compress_rounds(named, None))]
    one, many = ResidualMemory(beta=0.5, reference="mean"), ResidualMemory(beta=0.5,
                                                                            reference="mean")
    for _ in range(2):  # the first call has no residual, the second adds it
        single = [(n, one.compensate(t, n)) for n, t in named]
        joint = many.compensate_many(named)
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(single, joint))
        for (n, t), ctx, mean in zip(single, ctxs, means):
            one.update_mean(t, n, comp, ctx, mean)
        many.update_mean_many(joint, comp, ctxs, means)
        assert all(torch.equal(one.residuals[n], many.residuals[n]) for n, _ in named)
