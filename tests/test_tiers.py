"""The fast tier starts no process (tests/conftest.py): a test that does must be marked
``slow``."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest


def test_a_fast_test_may_not_start_a_subprocess():
    with pytest.raises(pytest.fail.Exception, match="starts a process but is not marked slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_fast_test_may_not_start_ranks():
    process = multiprocessing.get_context("spawn").Process(target=print)
    with pytest.raises(pytest.fail.Exception, match="add @pytest.mark.slow"):
        process.start()


@pytest.mark.slow
def test_a_slow_test_may():
    assert subprocess.run([sys.executable, "-c", "pass"], timeout=60).returncode == 0
