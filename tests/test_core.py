"""Single-process tests of the core compressors, memories and the pipeline."""

import copy
import importlib
import math
import threading

import pytest
import torch

import gracecomm
from gracecomm import buffers, registry
from gracecomm.buffers import dense_empty, dense_zeros
from gracecomm.compressor import TensorInfo
from gracecomm.rng import SharedStreams, stable_hash
from gracecomm.sparse import desparsify, sparse_mean
from gracecomm.validation import ConfigError, NonFiniteError, PayloadError, num_kept
from tests.helpers import same, slow_dtypes, state_tensors

CORE = ["none", "fp16", "bf16", "topk", "randomk", "threshold"]


def payload_bytes(grace_obj):
    return grace_obj.metrics.pop()["wire_bytes"]


@pytest.mark.parametrize("name", CORE)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, *slow_dtypes(torch.float64, torch.float16,
                                                              torch.bfloat16)])
def test_shape_and_dtype_preserved(name, shape, dtype):
    g = gracecomm.build(name, "none")
    t = torch.randn(shape).to(dtype)
    out = g.step(t, "w")
    assert out.shape == t.shape and out.dtype == t.dtype


@pytest.mark.parametrize("name", CORE)
def test_empty_tensor_passes_through(name):
    g = gracecomm.build(name)
    out = g.step(torch.empty(0, 3), "empty")
    assert out.shape == (0, 3)


def test_wire_bytes_are_counted_from_payloads():
    t = torch.randn(1000)
    expected = {"none": 4000, "fp16": 2000, "bf16": 2000, "topk": 10 * (4 + 4),
                "randomk": 10 * 4}
    for name, nbytes in expected.items():
        g = gracecomm.build({"name": name, "ratio": 0.01} if name in ("topk", "randomk") else name)
        g.step(t, "w")
        stats = g.metrics.pop()
        assert stats["wire_bytes"] == nbytes, name
        assert stats["dense_bytes"] == 4000
        assert stats["compression_factor"] == pytest.approx(4000 / nbytes)


def test_topk_keeps_largest_magnitudes():
    t = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0])
    g = gracecomm.build({"name": "topk", "ratio": 0.34}, "none")
    assert g.step(t, "w").tolist() == [0, -5.0, 0, 3.0, 0, 0]
    stats = g.metrics.pop()
    assert stats["k"] == 2 and stats["quality"] == 1.0


def test_threshold_selects_by_magnitude_and_may_select_nothing():
    g = gracecomm.build({"name": "threshold", "threshold": 1.0}, "none")
    assert g.step(torch.tensor([0.5, -1.0, 2.0]), "w").tolist() == [0, -1.0, 2.0]
    assert g.metrics.pop()["k_hat"] == 2
    assert g.step(torch.zeros(4), "w").tolist() == [0.0] * 4
    assert g.metrics.pop()["wire_bytes"] == 0


def test_randomk_shared_seed_and_unbiased_scale():
    a = registry.create("compressor", "randomk", ratio=0.1, seed=3)
    b = registry.create("compressor", "randomk", ratio=0.1, seed=3)
    t = torch.randn(500)
    (pa,), ca = a.compress(t, "x")
    (pb,), cb = b.compress(t, "x")
    assert torch.equal(ca.indices, cb.indices) and torch.equal(pa, pb)
    (pc,), cc = a.compress(t, "x")  # next call: new indices
    assert not torch.equal(ca.indices, cc.indices)
    assert ca.indices.unique().numel() == num_kept(500, 0.1)
    unbiased = registry.create("compressor", "randomk", ratio=0.1, scale="unbiased")
    mean = torch.zeros(500)
    for _ in range(2000):
        payload, ctx = unbiased.compress(t, "x")
        mean += unbiased.decompress(payload, ctx)
    mean /= 2000
    # each element is kept with probability 0.1 and scaled by 10:
    # sd of the mean = |t| * 3 / sqrt(2000)
    z = (mean - t) / (t.abs() * 3 / math.sqrt(2000))
    assert z.abs().max() < 5


@pytest.mark.parametrize("d", [1, 2, 7, 64, 65, 1000, 2**24 + 8])
def test_randomk_draws_exactly_k_distinct_ascending_indices_on_every_path(d, monkeypatch):
    from gracecomm.compressors import randomk

    for ratio in (0.001, 0.3, 0.5, 0.7, 1.0):
        k = num_kept(d, ratio)
        kernel = randomk.random_subset(d, k, 99, torch.device("cpu"))
        assert kernel.numel() == k and bool((kernel[1:] > kernel[:-1]).all())
        assert int(kernel[0]) >= 0 and int(kernel[-1]) < d
        if d < 10**5:  # the torch draws (other devices) give the same positions
            with monkeypatch.context() as m:
                m.setattr(randomk, "kernels_enabled", lambda device: False)
                assert torch.equal(randomk.random_subset(d, k, 99, torch.device("cpu")), kernel)


def test_residual_memory_error_feedback():
    g = gracecomm.build({"name": "topk", "ratio": 0.25}, "residual")
    t1 = torch.tensor([4.0, 1.0, 0.5, 0.25])
    assert g.step(t1, "w").tolist() == [4.0, 0, 0, 0]
    assert g.memory.residuals["w"].tolist() == [0, 1.0, 0.5, 0.25]
    t2 = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert g.step(t2, "w").tolist() == [0, 2.0, 0, 0]  # the residual came back
    state = g.state_dict()
    h = gracecomm.build({"name": "topk", "ratio": 0.25}, "residual")
    h.load_state_dict(state)
    assert torch.equal(h.memory.residuals["w"], g.memory.residuals["w"])


def test_residual_beta_gamma():
    mem = registry.create("memory", "residual", beta=0.5, gamma=2.0)
    comp = registry.create("compressor", "topk", ratio=0.5)
    t = torch.tensor([1.0, 3.0])
    c = mem.compensate(t, "w")
    assert c.tolist() == [2.0, 6.0]
    payload, ctx = comp.compress(c, "w")
    mem.update(c, "w", comp, payload, ctx)
    assert mem.compensate(t, "w").tolist() == [2.0 + 0.5 * 2.0, 6.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", ["topk", {"name": "randomk", "scale": "unbiased"},
                                  {"name": "threshold", "threshold": 0.5}, "dgc", "sidco",
                                  "onebit", "efsignsgd", "signsgd", "qsgd"])
def test_residual_is_the_decompressed_difference(spec, dtype):
    """Error feedback's update (`Compressor.subtract_decompressed`): a sparse selection
    subtracts the kept values where they were taken, the sign methods decode and subtract
    in one pass, in place on the memory's own buffer (or on a copy of a tensor it did not
    make), other methods as t - decompress: bit for bit t - decompress(payload), signed
    zeros and huge values included, and the caller's gradient never written."""
    mem = registry.create("memory", "residual", beta=0.75)
    comp = gracecomm.build(spec, "residual").compressor
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        g = torch.randn(4096, generator=gen).to(dtype)
        g[::97] = -0.0
        if step == 3:
            g[[5, 6]] = min(torch.finfo(dtype).max / 4, 1e30)  # float32 scales hold them
        before = g.clone()
        t = mem.compensate(g, "w")
        assert (t is g) == (step == 0)  # the first step lends no buffer: the update copies
        payload, ctx = comp.compress(t, "w")
        expected = t - comp.decompress(payload, ctx)
        mem.update(t, "w", comp, payload, ctx)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
        assert torch.equal(mem.residuals["w"].view(bits), expected.view(bits))
        assert torch.equal(g.view(bits), before.view(bits))  # the gradient untouched


def test_checkpoint_state_is_weights_only_loadable(tmp_path):
    g = gracecomm.build({"name": "randomk", "ratio": 0.5})
    for _ in range(3):
        g.step(torch.randn(10), "a")
    torch.save(g.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    h = gracecomm.build({"name": "randomk", "ratio": 0.5})
    h.load_state_dict(state)
    t = torch.randn(10)
    assert torch.equal(g.step(t, "a"), h.step(t, "a"))


@pytest.mark.parametrize("numel", [3, 1 << 17])  # torch's min and max; numba's count
def test_fp16_saturates_instead_of_overflowing(numel):
    g = gracecomm.build("fp16")
    t = torch.ones(numel)
    t[0], t[-1] = 1e6, -1e6
    out = g.step(t, "w")
    assert torch.isfinite(out).all() and out[0] == 65504 and out[-1] == -65504
    assert g.metrics.pop()["saturated"] == 2
    g.step(t.clamp(-1, 1), "w")  # nothing to clamp: the count is not reported
    assert "saturated" not in g.metrics.pop()


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, float("nan"), "a", None, True])
def test_bad_ratio_is_refused(ratio):
    with pytest.raises(ConfigError, match="ratio"):
        gracecomm.build({"name": "topk", "ratio": ratio})


def test_unknown_names_list_valid_ones():
    with pytest.raises(registry.UnknownNameError,
                       match="Did you mean 'topk'.*Available: .*randomk"):
        gracecomm.build("tpok")
    with pytest.raises(registry.UnknownNameError, match="unknown memory"):
        gracecomm.build("topk", "residul")
    with pytest.raises(registry.UnknownNameError, match="unknown communicator"):
        gracecomm.build("topk", "none", "allgater")


@pytest.mark.parametrize("spec,where,new", [
    ({"_target_": "grace.compressors.topk.TopK", "ratio": 0.01}, "<root>",
     "gracecomm.compressors.topk.TopK"),
    ({"_target_": "gracecomm.compressors.compose.Compose",
      "compressors": ["randomk", {"_target_": "grace.compressors.cast.FP16"}]},
     "compressors[1]", "gracecomm.compressors.cast.FP16"),
])
def test_an_old_grace_target_names_its_new_path(spec, where, new):
    """A config saved before the one import root: its ``grace.*`` _target_ is refused with
    the ``gracecomm.*`` path to use, at any depth, before anything is imported."""
    old = new.replace("gracecomm.", "grace.", 1)
    with pytest.raises(ConfigError) as err:
        gracecomm.build(spec)
    assert str(err.value) == (f"config '{where}' has _target_ '{old}': the core moved to the "
                              f"import root gracecomm, use '{new}'")
    with pytest.raises(ConfigError, match="use 'gracecomm.memories.residual.Residual'"):
        gracecomm.build("topk", {"_target_": "grace.memories.residual.Residual"})


def test_incompatible_pairing_is_refused_at_build_time():
    for name in ("topk", "threshold"):
        with pytest.raises(gracecomm.IncompatibleError, match="not summable"):
            gracecomm.build(name, "none", "allreduce")
    gracecomm.build("randomk", "none", "allreduce")  # summable: fine


def test_bad_tensors_raise_clear_errors():
    g = gracecomm.build("topk")
    with pytest.raises(TypeError, match="tensor 'ints' has dtype torch.int64"):
        g.step(torch.arange(4), "ints")
    with pytest.raises(NonFiniteError, match="tensor 'bad' holds 1 NaN and 1 Inf"):
        g.step(torch.tensor([1.0, float("nan"), float("inf")]), "bad")
    unchecked = gracecomm.build("none", check_finite=False)
    assert unchecked.step(torch.tensor([float("nan")]), "x").isnan().all()


def test_sparse_payload_validation():
    info = TensorInfo(torch.Size([4]), torch.float32)
    with pytest.raises(PayloadError, match=r"span \[0, 9\]"):
        desparsify(torch.ones(2), torch.tensor([0, 9], dtype=torch.int32), info)
    with pytest.raises(PayloadError, match="equal in number"):
        sparse_mean([(torch.ones(2), torch.tensor([0], dtype=torch.int32))], info)
    with pytest.raises(PayloadError, match="int32 or int64"):
        desparsify(torch.ones(1), torch.tensor([0.0]), info)


def test_output_buffers_are_lent_again_only_once_every_tensor_on_them_is_gone(monkeypatch):
    monkeypatch.setattr(buffers, "_RECYCLER", buffers._Recycler())
    n = buffers.HUGE_PAGE_MIN // 4
    out = dense_zeros(n, torch.float32, "cpu")
    tail = out[n // 2:]  # a view keeps the buffer lent after `out` is dropped
    address = out.data_ptr()
    del out
    tail.fill_(7.0)
    again = dense_zeros(n, torch.float32, "cpu")
    assert again.data_ptr() != address and not again.any() and (tail == 7.0).all()
    del tail
    recycled = dense_zeros(n, torch.float32, "cpu")
    assert recycled.data_ptr() == address and not recycled.any()  # zeroed again
    recycled.fill_(3.0)
    del recycled
    raw = dense_empty(n, torch.float32, "cpu")
    assert raw.data_ptr() == address and (raw == 3.0).all()  # dense_empty does not clear


def test_recycled_buffers_are_kept_up_to_the_cap(monkeypatch):
    recycler = buffers._Recycler()
    monkeypatch.setattr(buffers, "_RECYCLER", recycler)
    monkeypatch.setattr(buffers, "RECYCLED_KEPT", 3 * buffers.HUGE_PAGE_MIN)
    n = buffers.HUGE_PAGE_MIN // 4
    outs = [dense_empty(n, torch.float32, "cpu") for _ in range(4)]
    small = dense_empty(10, torch.float32, "cpu")  # below HUGE_PAGE_MIN: torch's own
    del outs, small
    again = dense_empty(n, torch.float32, "cpu")
    assert recycler.kept == 2 * buffers.HUGE_PAGE_MIN and not recycler.returned
    assert again.numel() == n
    del again
    buffers.release_recycled()  # what the bench's memory measurement starts from
    assert recycler.kept == 0 and not recycler.free and not recycler.returned


def test_recycled_buffers_over_the_cap_give_back_the_least_recently_dropped(monkeypatch):
    """The sizes a run keeps dropping stay recycled: a buffer dropped long ago is given back
    to the system to make room for newer ones, not the newer ones refused."""
    recycler = buffers._Recycler()
    monkeypatch.setattr(buffers, "_RECYCLER", recycler)
    monkeypatch.setattr(buffers, "RECYCLED_KEPT", 2 * buffers.HUGE_PAGE_MIN)
    n = buffers.HUGE_PAGE_MIN // 4
    old = dense_empty(2 * n, torch.float32, "cpu")
    del old
    new = [dense_empty(n, torch.float32, "cpu") for _ in range(2)]
    addresses = {t.data_ptr() for t in new}
    del new
    again = [dense_empty(n, torch.float32, "cpu") for _ in range(2)]
    assert {t.data_ptr() for t in again} == addresses and recycler.kept == 0


def test_shared_streams_are_stable():
    assert stable_hash(0, "w", 0) == stable_hash(0, "w", 0) != stable_hash(0, "w", 1)
    s = SharedStreams(5)
    first = [s.next_seed("a") for _ in range(3)]
    s2 = SharedStreams(5)
    s2.load_state_dict({"seed": 5, "counters": {"a": 1}})
    assert s2.next_seed("a") == first[1]


def test_registry_create_and_available():
    assert set(CORE) <= set(gracecomm.available("compressor"))
    assert {"none", "residual"} <= set(gracecomm.available("memory"))
    assert {"allreduce", "allgather", "broadcast"} <= set(gracecomm.available("communicator"))
    assert gracecomm.create("compressor", "topk", ratio=0.5).ratio == 0.5
    with pytest.raises(registry.UnknownNameError, match="unknown registry"):
        gracecomm.available("codec")


@pytest.mark.parametrize("kind", ["compressor", "memory", "communicator", "index_codec"])
def test_available_verbose_names_the_defining_module(kind):
    index = gracecomm.available(kind, verbose=True)
    assert list(index) == gracecomm.available(kind)
    for name, module in index.items():
        cls = registry.get(kind, name)
        assert getattr(importlib.import_module(module), cls.__name__) is cls, name
    if kind == "compressor":
        assert index["topk"] == "gracecomm.compressors.topk"
        assert index["lgc_rar"] == "gracecomm.compressors.lgc.rar"


@pytest.mark.parametrize("spec,memory", [({"name": "topk", "ratio": 0.01}, "residual"),
                                         ({"name": "dgc", "ratio": 0.01}, "dgc"),
                                         ("signum", "none")])
def test_state_replaced_on_recycled_buffers_keeps_earlier_snapshots(spec, memory):
    """Residuals and momentum large enough to live on recycled buffers: every step replaces
    them with new tensors, so a snapshot taken earlier stays as it was while the buffers of
    the tensors it does not hold are lent again."""
    pipe = gracecomm.build(spec, memory)
    gen = torch.Generator().manual_seed(0)
    n = 2 * buffers.HUGE_PAGE_MIN // 4
    for _ in range(2):
        pipe.step(torch.randn(n, generator=gen), "w")
    kept = pipe.state_dict()
    before = copy.deepcopy(kept)
    assert any(t.numel() == n for t in state_tensors(before))
    for _ in range(3):
        pipe.step(torch.randn(n, generator=gen), "w")
    assert same(kept, before)


@pytest.mark.parametrize("spec,memory", [("topk", "residual"), ("dgc", "dgc"),
                                         ({"name": "topk"}, {"name": "residual", "gamma": 0.5})])
def test_tensors_that_require_grad_are_exchanged_as_their_values(spec, memory):
    """A tensor still attached to an autograd graph is exchanged as its detached values: the
    memories' state (written with out= into recycled buffers) never holds a graph."""
    x = torch.randn(300, requires_grad=True)
    a, b = gracecomm.build(spec, memory), gracecomm.build(spec, memory)
    for _ in range(3):
        assert torch.equal(a.step(x * 2, "w"), b.step((x * 2).detach(), "w"))
    assert not any(t.requires_grad for t in state_tensors(a.state_dict()))


def test_recycled_buffers_are_never_lent_twice_across_threads(monkeypatch):
    """Outputs made and dropped on two threads at once (the exchange thread beside the
    training thread): no buffer is lent while a tensor on it lives, and every one comes
    zeroed."""
    monkeypatch.setattr(buffers, "_RECYCLER", buffers._Recycler())
    n = buffers.HUGE_PAGE_MIN // 4
    failures = []

    def work(mark: float) -> None:
        held = []
        for _ in range(40):
            out = dense_zeros(n, torch.float32, "cpu")
            if out.any():
                failures.append("not zeroed")
            out[::4096] = mark
            held.append(out)
            if len(held) > 2:
                old = held.pop(0)
                if not (old[::4096] == mark).all():
                    failures.append("overwritten while lent")
    threads = [threading.Thread(target=work, args=(float(t + 1),)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not failures
