"""The reliability suite's cases (`tests.reliability`) as tests: every case
that starts no training run, and the timed faults of local workers (spawned functions, not
training runs). The whole suite, training runs included, is one command:
``python -m tests.reliability``."""

from __future__ import annotations

import pytest

from tests.reliability import CASES, Case

TIMED = {"failing_rank_is_named_within_seconds", "killed_rank_is_named_within_seconds",
         "hung_rank_is_named_after_the_collective_timeout", "rank_exiting_with_code_0_is_named"}
SLOW = TIMED | {"curve_fits_are_repeatable"}  # they start workers, or take seconds
CHOSEN = [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in SLOW else [])
          for c in CASES if not c.slow or c.name in TIMED]


def test_the_timed_faults_exist():
    assert TIMED <= {c.name for c in CASES}


@pytest.mark.parametrize("case", CHOSEN)
def test_case(case: Case, tmp_path):
    assert case.fn(tmp_path)
