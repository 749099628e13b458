"""Collapse detection: a run whose training loss became non-finite, or whose test metric fell
back to chance after it had learned, says so at its end and in its summary, naming what its
compressor is known to be sensitive to (`Compressor.sensitivities`); a run stopped by a
non-finite gradient is reported as a divergence at its step (`DivergenceError`).

Chance is the test metric of a model that ignores its input (`Task.chance`: the majority
class's share of the test set, the test tokens' unigram perplexity, K over the number of
candidates). A run has learned once an evaluation closed `LEARNED_FRACTION` of the gap
between chance and a perfect score (1 for every task's metric). A run collapsed when its
last evaluation is at or below chance after it had learned, or after `MIN_EVALUATIONS`
evaluations without ever learning (signSGD at SGD's step size); the near-chance evaluations
at the start of a run, and short smoke runs, are not collapses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gracecomm.experiments.workloads.tasks import Task
from gracecomm.validation import NonFiniteError

LEARNED_FRACTION = 0.1
MIN_EVALUATIONS = 3


class DivergenceError(NonFiniteError):
    """Training diverged: a gradient became non-finite at a known step."""


class CollapseError(RuntimeError):
    """A single run collapsed (its summary says how); a sweep records it and goes on."""


@dataclass(frozen=True)
class Point:
    """One observation of a run: step, epoch and the value seen."""

    step: int
    epoch: int
    value: float


class CollapseWatch:
    """Follows one rank's training losses and evaluations (a few comparisons per step)."""

    def __init__(self, task: Task, chance: float | None, method: str,
                 sensitivities: Sequence[str]) -> None:
        self.task = task
        self.chance = chance
        self.method = method
        self.sensitivities = tuple(sensitivities)
        self.lowest: Point | None = None     # lowest finite training loss
        self.nonfinite: Point | None = None  # first non-finite training loss
        self.best: Point | None = None       # best evaluation that counts as learned
        self.at_chance: Point | None = None  # first evaluation of the final run at chance
        self.evaluations = 0

    @property
    def learned(self) -> float:
        """The metric a run must beat to count as having learned."""
        assert self.chance is not None
        return self.chance + LEARNED_FRACTION * (1.0 - self.chance)

    def better(self, a: float, b: float) -> bool:
        """Whether metric value `a` is strictly better than `b` (NaN never is)."""
        return a > b if self.task.higher_is_better else a < b

    def loss(self, step: int, epoch: int, value: float) -> None:
        if not math.isfinite(value):
            if self.nonfinite is None:
                self.nonfinite = Point(step, epoch, value)
        elif self.lowest is None or value < self.lowest.value:
            self.lowest = Point(step, epoch, value)

    def evaluated(self, step: int, epoch: int, value: float) -> None:
        if self.chance is None:
            return
        self.evaluations += 1
        if self.better(value, self.learned) and (self.best is None
                                                 or self.better(value, self.best.value)):
            self.best = Point(step, epoch, value)
        if self.better(value, self.chance):
            self.at_chance = None
        elif self.at_chance is None:
            self.at_chance = Point(step, epoch, value)

    def _known(self) -> str:
        if not self.sensitivities:
            return f"{self.method} declares no known sensitivities"
        return f"{self.method} is known to be sensitive to: " + "; ".join(self.sensitivities)

    def verdict(self) -> dict[str, Any] | None:
        """At the end of the run: None, or what collapsed, where, in words
        (``kind`` ``nonfinite_loss`` or ``chance``), for the summary."""
        if self.nonfinite is not None:
            at = self.nonfinite
            lowest = (f" (lowest {self.lowest.value:.4g} at step {self.lowest.step})"
                      if self.lowest else "")
            what = (f"the training loss became {at.value} at step {at.step} (epoch "
                    f"{at.epoch}){lowest}")
            kind = "nonfinite_loss"
        elif self.at_chance is not None and self.best is not None:
            at, best, label = self.at_chance, self.best, self.task.label
            what = (f"{label} fell to {at.value:.4g}, at or below chance ({self.chance:.4g}), "
                    f"at epoch {at.epoch} (step {at.step}) after reaching {best.value:.4g} at "
                    f"epoch {best.epoch}, and stayed there")
            kind = "chance"
        elif self.at_chance is not None and self.evaluations >= MIN_EVALUATIONS:
            at, label = self.at_chance, self.task.label
            what = (f"{label} was at or below chance ({self.chance:.4g}) from epoch {at.epoch} "
                    f"(step {at.step}) to the end, and never above {self.learned:.4g} in "
                    f"{self.evaluations} evaluations")
            kind = "chance"
        else:
            return None
        return {"kind": kind, **asdict(at), "chance": self.chance,
                "message": f"collapsed: {what}. {self._known()}",
                "sensitivities": list(self.sensitivities)}

    def diverged(self, step: int, epoch: int, loss: float, err: NonFiniteError) -> DivergenceError:
        """The error to raise when a gradient of step `step` is non-finite (`err`)."""
        lowest = (f"; the lowest loss was {self.lowest.value:.4g} at step {self.lowest.step}"
                  if self.lowest else "")
        return DivergenceError(f"training diverged at step {step} (epoch {epoch}): the loss was "
                          f"{loss:.4g}{lowest}, and then {err}. {self._known()}")
