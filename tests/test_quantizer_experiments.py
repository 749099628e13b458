"""The natural-compression Table 1 reproduction and the PowerSGD comparison with PyTorch's
DDP hook (experiments/checks/natural_table1.py, experiments/checks/powersgd_vs_torch.py)."""

import math

import pytest

from gracecomm.experiments.checks import natural_table1 as t1
from gracecomm.experiments.checks.powersgd_vs_torch import compare

D = 10**6


def literal(approach):
    q = D // 10
    return [t1.best_speedup(approach, D, q, theta, lambda s: t1.paper_bits(approach, D, q, s))
            for theta in (1, 0)]


@pytest.mark.parametrize("approach", ["Baseline", "C_nat", "S_q", "C_nat o S_q"])
def test_rows_one_to_four_reproduce_the_paper_to_one_decimal(approach):
    (low, _), (high, _) = literal(approach)
    assert f"{low:.1f}-{high:.1f}" == {"Baseline": "1.0-1.0"}.get(approach, t1.PAPER[approach])


def test_dithering_rows_match_the_literal_recomputation():
    assert [(round(v, 2), s) for v, s in literal("D_sta")] == [(2.01, 13), (10.67, 1)]
    assert [(round(v, 2), s) for v, s in literal("D_nat")] == [(4.83, 14), (16.0, 1)]


def test_measured_bits_come_from_the_payloads():
    d, q = 8000, 800
    x = t1.torch.randn(d)
    bits = {a: t1.measured_bits(a, x, q, 3) for a in t1.PAPER}
    assert bits["Baseline"] == 32 * d and bits["C_nat"] == 9 * d
    # indices packed in ceil(log2 8000) = 13 bits (bit-packed) or int32
    assert bits["S_q"] == 32 * q + 8 * math.ceil(13 * q / 8)
    assert bits["C_nat o S_q"] == 8 * (q + math.ceil(q / 8)) + 8 * math.ceil(13 * q / 8)
    assert t1.measured_bits("S_q", x, q, 3, packed=False) == 64 * q
    assert t1.measured_bits("C_nat o S_q", x, q, 3, packed=False) == (
        8 * (q + math.ceil(q / 8)) + 32 * q)
    assert bits["D_sta"] == 32 + d * (1 + 3)  # 2^(3-1) = 4 levels: 3-bit codes + sign
    assert bits["D_nat"] == 32 + d * (1 + 2)  # 3 levels: 2-bit codes + sign
    rows = t1.table1(d=d)
    assert [r.approach for r in rows] == list(t1.PAPER)
    text = t1.format_rows(rows, d)
    assert "literal recomputation" in text and "measured from payloads" in text


@pytest.mark.slow
def test_powersgd_sends_what_the_pytorch_hook_sends():
    records = compare(["trainer.max_steps=6"], r=2, modes=("gracecomm", "torch hook"))
    ours, hook = records
    assert ours["bytes_per_compressed_step"] == hook["bytes_per_compressed_step"]
    assert ours["wire_bytes_per_step"] > ours["bytes_per_compressed_step"]  # 2 dense steps
    assert ours["test_acc"] == hook["test_acc"] and ours["test_loss"] == hook["test_loss"]
    assert all(r["steps"] == 6 for r in records)
