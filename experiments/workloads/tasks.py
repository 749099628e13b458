"""Tasks: the loss a model trains on and the metric its test set reports. A data set names
its task (`DataBundle.task`); models name the task whose batches they take (`Model.task`).

| task | training loss | test metric (summary key) |
|---|---|---|
| ``classification`` | cross-entropy | accuracy (``test_acc``) |
| ``recommendation`` | binary cross-entropy (1) | hit rate @ K (2) (``test_hr@K``) |
| ``language_modelling`` | cross-entropy per token | perplexity (3) (``test_ppl``) |

(1) on the interactions and sampled negatives; (2) among the candidates, as in He et al.
2017; (3) exp(mean cross-entropy per token).

Evaluation works on sums (loss, loss count, metric, metric count) so each rank evaluates a
shard of the test set and the sums are added over ranks. `Task.chance` is the metric of a
model that ignores its input (collapse detection, `gracecomm.experiments.training.collapse`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from gracecomm.validation import ConfigError, check_range


class Task(ABC):
    """Loss and metric of one kind of data set."""

    name: ClassVar[str]
    higher_is_better: ClassVar[bool] = True

    @property
    @abstractmethod
    def metric(self) -> str:
        """Key of the test metric in eval records and the summary."""

    @property
    @abstractmethod
    def label(self) -> str:
        """The metric in words, for the printed summary."""

    @abstractmethod
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean training loss of one batch."""

    @abstractmethod
    def eval_sums(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        """[loss sum, loss count, metric sum, metric count] of one test batch."""

    def finish(self, sums: list[float]) -> dict[str, float]:
        """``test_loss`` and the metric from sums added over batches and ranks."""
        return {"test_loss": sums[0] / sums[1], self.metric: sums[2] / sums[3]}

    @abstractmethod
    def chance(self, test: Dataset) -> float:
        """The metric on `test` of the best prediction that ignores the input."""


def target_counts(test: Dataset) -> torch.Tensor:
    """How often each integer target occurs in `test` (every target of every example)."""
    return torch.bincount(torch.cat([y.reshape(-1) for _, y in DataLoader(test, batch_size=1024)]))


class Classification(Task):
    name = "classification"
    metric = "test_acc"
    label = "test accuracy"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def eval_sums(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        logits = model(x)
        return [F.cross_entropy(logits, y, reduction="sum").item(), len(y),
                (logits.argmax(1) == y).sum().item(), len(y)]

    def chance(self, test: Dataset) -> float:
        """Always the most frequent class: its share of the test set."""
        counts = target_counts(test)
        return float(counts.max() / counts.sum())


class Recommendation(Task):
    """Implicit feedback: training batches are (user, item) pairs with 0/1 labels; test
    batches rank each user's candidates (one held-out interaction among sampled negatives,
    marked by label 1): a hit when fewer than `k` negatives score at least as high as the
    held-out item (ties count against the model)."""

    name = "recommendation"

    def __init__(self, k: int = 10) -> None:
        self.k = check_range(k, "task 'recommendation'", "k", 1, integer=True)

    @property
    def metric(self) -> str:
        return f"test_hr@{self.k}"

    @property
    def label(self) -> str:
        return f"test hit rate @ {self.k}"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(output, target)

    def eval_sums(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        scores = model(x)  # (users, candidates)
        positive = scores.gather(1, y.argmax(1, keepdim=True))
        rank = (scores >= positive).sum(1) - 1  # other candidates at least as high
        return [F.binary_cross_entropy_with_logits(scores, y, reduction="sum").item(),
                y.numel(), (rank < self.k).sum().item(), len(y)]

    def chance(self, test: Dataset) -> float:
        """Candidates in random order (a model that ignores its input cannot tell them
        apart): K over the number of candidates."""
        candidates = test[0][1].numel()
        return min(1.0, self.k / candidates)


class LanguageModelling(Task):
    """Next-token prediction: batches are (tokens, next tokens) of shape (batch, time)."""

    name = "language_modelling"
    metric = "test_ppl"
    label = "test perplexity"
    higher_is_better = False

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, -2), target.flatten())

    def eval_sums(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        total = F.cross_entropy(model(x).flatten(0, -2), y.flatten(), reduction="sum").item()
        return [total, y.numel(), total, y.numel()]

    def finish(self, sums: list[float]) -> dict[str, float]:
        loss = sums[0] / sums[1]
        return {"test_loss": loss, self.metric: math.exp(min(loss, 700.0))}

    def chance(self, test: Dataset) -> float:
        """The test tokens' own frequencies at every position: their unigram perplexity."""
        counts = target_counts(test).double()
        p = counts[counts > 0] / counts.sum()
        return float(torch.exp(-(p * p.log()).sum()))


TASKS: dict[str, type[Task]] = {t.name: t for t in (Classification, Recommendation,
                                                    LanguageModelling)}


def make_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """The task called `name` with `options` (a data set's `task` and `task_options`)."""
    if name not in TASKS:
        raise ConfigError(f"data: task {name!r} is unknown; tasks are {', '.join(TASKS)}")
    return TASKS[name](**(options or {}))
