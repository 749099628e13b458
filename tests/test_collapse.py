"""Collapse detection: chance levels of every task, the verdict at the end of a run, and
divergence reported with its step, in units and end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.data import TensorDataset

from gracecomm.experiments.training.collapse import CollapseWatch, DivergenceError
from gracecomm.experiments.workloads.tasks import make_task
from gracecomm.validation import NonFiniteError
from tests.test_train import train


def test_chance_is_the_best_input_blind_score():
    labels = torch.tensor([0, 1, 1, 2, 1, 0, 1, 1])
    classes = TensorDataset(torch.zeros(8, 3), labels)
    assert make_task("classification").chance(classes) == 5 / 8
    tokens = torch.tensor([[0, 1], [1, 3]])  # unigram 1/4, 1/2, 1/4: perplexity 2^1.5
    text = TensorDataset(tokens, tokens)
    assert make_task("language_modelling").chance(text) == pytest.approx(2 ** 1.5)
    candidates = TensorDataset(torch.zeros(3, 50), torch.zeros(3, 50))
    assert make_task("recommendation", {"k": 10}).chance(candidates) == 10 / 50


def watch(task: str = "classification", chance: float = 0.1) -> CollapseWatch:
    return CollapseWatch(make_task(task), chance, "compressor 'x'",
                         ["trainer.lr: too large a step", "ratio: too few elements"])


def test_metric_back_at_chance_after_learning_is_a_collapse():
    w = watch()
    for epoch, acc in enumerate([0.12, 0.6, 0.9, 0.4, 0.1, 0.08]):
        w.evaluated(10 * (epoch + 1), epoch, acc)
    verdict = w.verdict()
    assert verdict["kind"] == "chance" and (verdict["epoch"], verdict["step"]) == (4, 50)
    assert "fell to 0.1, at or below chance (0.1), at epoch 4 (step 50)" in verdict["message"]
    assert "after reaching 0.9 at epoch 2" in verdict["message"]
    assert "trainer.lr: too large a step; ratio: too few elements" in verdict["message"]
    assert verdict["sensitivities"] == ["trainer.lr: too large a step", "ratio: too few elements"]


def test_a_run_that_never_learned_is_a_collapse_after_three_evaluations():
    w = watch()
    for epoch, acc in enumerate([0.11, 0.12, 0.1, 0.09]):
        w.evaluated(epoch + 1, epoch, acc)
    verdict = w.verdict()
    assert verdict["kind"] == "chance" and verdict["epoch"] == 2
    assert ("test accuracy was at or below chance (0.1) from epoch 2 (step 3) to the end, and "
            "never above 0.19 in 4 evaluations") in verdict["message"]


@pytest.mark.parametrize("accuracies", [
    [0.09, 0.12, 0.11],        # never learned but above chance at the end
    [0.11, 0.09],              # two evaluations at chance (a short run): not a collapse
    [0.15, 0.08, 0.5, 0.9],    # near chance early, then learned
    [0.6, 0.1, 0.7],           # recovered by the end
])
def test_no_collapse(accuracies):
    w = watch()
    for epoch, acc in enumerate(accuracies):
        w.evaluated(epoch, epoch, acc)
    assert w.verdict() is None


def test_lower_is_better_metrics_and_nan():
    w = watch("language_modelling", chance=50.0)
    for epoch, ppl in enumerate([60.0, 30.0, 55.0]):
        w.evaluated(epoch, epoch, ppl)
    assert w.verdict()["kind"] == "chance"
    w = watch()
    w.evaluated(1, 0, 0.8)
    w.evaluated(2, 1, math.nan)
    assert w.verdict()["kind"] == "chance"


def test_nonfinite_loss_is_a_collapse_at_its_step():
    w = watch()
    for step, loss in enumerate([2.3, 0.5, 0.2, 3e30, math.inf, math.nan], start=1):
        w.loss(step, 0, loss)
    verdict = w.verdict()
    assert verdict["kind"] == "nonfinite_loss" and verdict["step"] == 5
    assert "became inf at step 5 (epoch 0) (lowest 0.2 at step 3)" in verdict["message"]


def test_divergence_names_the_step_the_loss_and_the_tensor():
    w = watch()
    w.loss(1, 0, 0.3)
    err = w.diverged(7, 2, 4e12, NonFiniteError("tensor 'fc.bias' holds 3 NaN"))
    assert isinstance(err, DivergenceError) and isinstance(err, NonFiniteError)
    assert str(err).startswith("training diverged at step 7 (epoch 2): the loss was 4e+12; "
                               "the lowest loss was 0.3 at step 1, and then tensor 'fc.bias' "
                               "holds 3 NaN. compressor 'x' is known to be sensitive to")


@pytest.mark.slow
def test_diverging_run_reports_the_step(tmp_path):
    proc = train(tmp_path, "compressor=topk", "trainer.lr=1000", "trainer.max_steps=40",
                 timeout=120)
    assert proc.returncode != 0
    assert "DivergenceError: training diverged at step" in proc.stderr
    assert "holds" in proc.stderr and "NaN" in proc.stderr


@pytest.mark.slow
def test_nonfinite_loss_run_ends_with_its_verdict(tmp_path):
    proc = train(tmp_path, "compressor=topk", "trainer.lr=1000", "trainer.max_steps=40",
                 "check_finite=false", timeout=120)
    assert proc.returncode != 0 and "collapsed: the training loss became" in proc.stderr
    assert "!! collapsed: the training loss became" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["collapse"]["kind"] == "nonfinite_loss"
    assert summary["collapse"]["step"] <= 40 and summary["chance"] == pytest.approx(0.117, abs=1e-3)
