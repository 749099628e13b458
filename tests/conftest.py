"""The fast tier, ``python -m pytest -m "not slow" -n 2 --dist worksteal``, starts no process:
a test that starts ranks or subprocesses (multi-rank Gloo runs, the command-line entry
points, training runs, benchmark scripts) fails unless it is marked ``slow`` (pyproject.toml
describes the marker; CI runs every test).

Caches a fresh machine lacks are built before the first test, outside the guard: matplotlib's
font cache (`matplotlib_font_cache`), whose first build lists the system fonts with
``fc-list``."""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def matplotlib_font_cache() -> None:
    """Build matplotlib's font cache (in MPLCONFIGDIR) once per session, before any test's
    process guard: on a machine without the cache, the first plot would otherwise start
    ``fc-list`` inside a fast test, which the guard fails, leaving no cache behind for the
    next run. With the cache present this only reads it."""
    try:
        import matplotlib
    except ImportError:  # the plots are skipped without it (experiments/report.py)
        return
    matplotlib.use("Agg")  # as every plotting module of experiments/ selects it
    import matplotlib.font_manager

    matplotlib.font_manager.fontManager  # noqa: B018 - loading it builds the cache if absent


@pytest.fixture(autouse=True)
def fast_tests_start_no_process(request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Outside ``slow`` tests, starting a subprocess or a multiprocessing process fails the
    test (`pytest.fail`, which no ``except Exception`` swallows)."""
    if request.node.get_closest_marker("slow") is None:
        def refuse(*args: Any, **kwargs: Any) -> None:
            pytest.fail(f"{request.node.nodeid} starts a process but is not marked slow: "
                        "add @pytest.mark.slow (the fast tier, -m 'not slow', starts none)",
                        pytrace=False)

        monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield
