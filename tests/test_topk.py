"""Exact Top-k (`gracecomm.compressors.shared.exceedance.top_k`) and the key-based selection
pass: the same kept magnitudes as ``torch.topk``, ties to the lowest index, on both backends,
every float dtype and the hostile inputs (ties, all-equal, zeros, NaN/Inf, tiny and full
k)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gracecomm.compressors.dgc import DGC
from gracecomm.compressors.shared import exceedance
from gracecomm.compressors.sidco import SIDCo
from gracecomm.compressors.threshold import Threshold
from gracecomm.compressors.topk import TopK
from gracecomm.metrics import Metrics
from gracecomm.validation import numba_available

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
BACKENDS = ["torch"] + (["numba"] if numba_available() else [])
KINDS = ["normal", "ties", "allequal", "zeros", "nonfinite", "denormal", "huge", "clustered"]


def tensor(kind: str, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=gen, dtype=torch.float64)
    if kind == "ties":  # few distinct magnitudes, both signs
        x = torch.randint(-4, 5, (d,), generator=gen).double()
    elif kind == "clustered":  # the largest in one stretch, as in a model's gradients:
        x[: max(1, d // 8)] *= 1000  # the selection's per-chunk slots overflow there
    elif kind == "allequal":
        x = torch.full((d,), -2.5, dtype=torch.float64)
    elif kind == "zeros":
        x[torch.rand(d, generator=gen) < 0.995] = 0.0
        x[::3] = -0.0
    elif kind == "nonfinite":
        x[torch.randint(0, d, (max(1, d // 40),), generator=gen)] = float("nan")
        x[torch.randint(0, d, (max(1, d // 80),), generator=gen)] = float("inf")
        x[-1] = -float("inf")
    elif kind == "denormal":
        x = x * torch.finfo(dtype).smallest_normal / 4
    elif kind == "huge":
        x = x.clamp(-1, 1) * torch.finfo(dtype).max
    return x.to(dtype)


def ranking(x: torch.Tensor) -> torch.Tensor:
    """Positions by decreasing magnitude (NaN above Inf), ties by index: a stable sort."""
    return torch.sort(-exceedance.magnitude_keys(x).long(), stable=True).indices


def reference(x: torch.Tensor, k: int) -> torch.Tensor:
    return ranking(x)[:k].sort().values


def check(x: torch.Tensor, ks: list[int], backend: str) -> None:
    order = ranking(x)
    mags = x.abs().double()
    for k in ks:
        got, values = exceedance.top_k(x, k, backend)
        assert got.dtype == torch.int64 and values.dtype == x.dtype
        assert torch.equal(values.view(exceedance.KEYS[x.dtype].int_dtype),
                           x[got].view(exceedance.KEYS[x.dtype].int_dtype))  # NaN bits too
        assert torch.equal(got, order[:k].sort().values), (x.dtype, x.numel(), k, backend)
        # the kept magnitudes are torch.topk's (NaN compared equal to NaN)
        want = torch.topk(mags, k).values.nan_to_num(nan=float("inf"), posinf=1e308)
        have = mags[got].sort(descending=True).values.nan_to_num(nan=float("inf"), posinf=1e308)
        assert torch.equal(have, want)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(d=st.integers(1, 3000), kind=st.sampled_from(KINDS), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), share=st.floats(0.0, 1.0))
def test_top_k_is_exact_with_lowest_index_ties(backend, d, kind, dtype, seed, share):
    x = tensor(kind, d, dtype, seed)
    check(x, [k for k in {1, 2, max(1, int(share * d)), d - 1, d} if 1 <= k <= d], backend)


@pytest.mark.parametrize("backend,threads", [(b, 1) for b in BACKENDS] + [("numba", 2)]
                         if "numba" in BACKENDS else [("torch", 1)])
@pytest.mark.parametrize("kind", KINDS)
def test_top_k_exact_on_multi_chunk_tensors(backend, threads, kind):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # 2: the numba kernels split the chunks over threads
    try:
        for d, dtype in ((300_007, torch.float32), (140_000, torch.float16),
                         (140_000, torch.float64)):
            check(tensor(kind, d, dtype, d), [1, 7, d // 1000, d // 100, d // 3, d - 1],
                  backend)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_of_picks_among_candidates(backend):
    x = tensor("ties", 200_000, torch.float32, 3)
    candidates = torch.nonzero(x.abs() >= 2).view(-1)
    for k in (1, 100, candidates.numel() // 2, candidates.numel()):
        got = exceedance.top_k_of(x, candidates, k, backend)
        sub = reference(x.index_select(0, candidates), k)
        assert torch.equal(got, candidates[sub])


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba not installed")
@pytest.mark.parametrize("dtype", DTYPES)
def test_select_backends_agree_in_every_dtype(dtype):
    x = tensor("nonfinite", 200_003, dtype, 5)
    x[:1000] = 0.0
    for thr in (0.0, 1e-30, 0.3, 1.0, 2.5, 65504.0, 1e30, float("inf"), float("nan")):
        for expected in (None, 0, 10**6):  # too small buffers are rescanned
            numba_idx = exceedance.select(x, thr, "numba", expected)
            torch_idx = exceedance.select(x, thr, "torch")
            assert torch.equal(numba_idx, torch_idx), (dtype, thr, expected)


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba not installed")
def test_selections_from_two_threads_at_once():
    """Two threads selecting at once, split over torch's threads (parallel launches take
    turns; numba's workqueue layer aborts the process otherwise) and each on its own staging
    buffers reused from call to call: every selection, of any size and dtype, is what the
    torch backend gives, and stays intact after later calls."""
    from concurrent.futures import ThreadPoolExecutor

    def run(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        out = []
        for i, (d, dtype) in enumerate([(300_001, torch.float32), (70_000, torch.float64),
                                        (500_000, torch.float32), (1_000, torch.float16)]):
            x = tensor("normal", d, dtype, seed + i)
            out.append((x, *exceedance._collect(x, 1.0 + seed / 10, 10)))
        return out

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # parallel launches (tensors over one chunk)
    try:
        with ThreadPoolExecutor(2) as pool:
            results = [r for part in pool.map(run, range(4)) for r in part]
    finally:
        torch.set_num_threads(before)
    for (x, positions, values), seed in zip(results, [s for s in range(4) for _ in range(4)]):
        expected = exceedance.select(x, 1.0 + seed / 10, "torch")
        assert torch.equal(positions, expected)
        assert torch.equal(values, x.index_select(0, expected))


def test_compressors_inherit_the_exact_pick():
    x = tensor("normal", 300_000, torch.float32, 9)
    k = 300
    want = reference(x, k)
    top = TopK(k / x.numel())
    top.bind(None, Metrics())
    (values, indices), _ = top.compress(x, "w")
    assert indices.dtype == torch.int32 and torch.equal(indices.long(), want)
    assert torch.equal(values, x[want])
    dgc = DGC(k / x.numel(), reselect_above=1.0)  # the exact re-selection keeps k at most
    dgc.bind(None, Metrics())
    (_, idx), _ = dgc.compress(x, "w")
    assert idx.numel() <= k and set(idx.tolist()) <= set(reference(x, idx.numel()).tolist())
    sidco = SIDCo(k / x.numel(), max_overshoot=1.0)
    sidco.bind(None, Metrics())
    (_, idx), _ = sidco.compress(x, "w")
    assert set(idx.tolist()) <= set(reference(x, max(idx.numel(), 1)).tolist())
    thr = Threshold(1.5)
    thr.bind(None, Metrics())
    (_, idx), _ = thr.compress(x.half(), "w")
    assert torch.equal(idx.long(), torch.nonzero(x.half().abs() >= 1.5).view(-1))


def test_integer_tensors_are_refused_by_name():
    with pytest.raises(TypeError, match="tensor 'w'.*int64"):
        TopK(0.5).compress(torch.arange(10), "w")
