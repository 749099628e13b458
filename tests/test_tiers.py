"""The fast tier (``python -m pytest -m "not slow"``) starts no process: every test that
starts ranks or subprocesses (multi-rank Gloo runs, the command-line entry points, training
runs, benchmark scripts) is marked ``slow``, read from the test sources: a test starts
processes when it, a module function it calls or a fixture it takes (transitively) names one
of the process starters below."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
STARTERS = frozenset({
    "run_ranks",      # tests.helpers: Gloo ranks over loopback
    "spawn",          # gracecomm.experiments.launch.spawn, multiprocessing's spawn
    "subprocess",     # the entry points and scripts as a user runs them
    "Popen",
    "multiprocessing",
    "mp",
    "torchrun",
})


def names_in(node: ast.AST) -> set[str]:
    """Every name `node` refers to (``a`` and ``b`` of ``a.b``), and the names of the
    parameters of the functions it defines (pytest fixtures)."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
        elif isinstance(sub, ast.arg):
            out.add(sub.arg)
    return out


def marked_slow(decorators: Iterable[ast.expr]) -> bool:
    return any("slow" in names_in(d) for d in decorators)


def unmarked_starters(source: str) -> list[str]:
    """The tests of one module that start processes but are not marked slow."""
    tree = ast.parse(source)
    if any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                for t in node.targets)
           and "slow" in names_in(node.value) for node in tree.body):
        return []
    functions = {node.name: node for node in tree.body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    starts = {name for name, node in functions.items() if names_in(node) & STARTERS}
    grown = True
    while grown:  # through module functions and fixtures that start processes
        more = {name for name, node in functions.items()
                if name not in starts and names_in(node) & starts}
        starts |= more
        grown = bool(more)
    tests: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, bool]] = [
        (name, node, False) for name, node in functions.items() if name.startswith("test")]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test")):
        tests += [(f"{cls.name}.{n.name}", n, marked_slow(cls.decorator_list))
                  for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.name.startswith("test")]
    return sorted(name for name, node, class_slow in tests
                  if names_in(node) & (starts | STARTERS)
                  and not (class_slow or marked_slow(node.decorator_list)))


def test_every_test_that_starts_processes_is_marked_slow():
    modules = sorted(TESTS.glob("test_*.py"))
    assert len(modules) > 40
    wrong = [f"{path.name}::{name}" for path in modules
             for name in unmarked_starters(path.read_text())]
    assert wrong == []


@pytest.mark.parametrize("source,expected", [
    ("import subprocess\ndef test_a():\n    subprocess.run(['true'])\n", ["test_a"]),
    ("from tests.helpers import run_ranks\ndef work(rank, world):\n    pass\n"
     "def go():\n    run_ranks(work, 2)\ndef test_b():\n    go()\n", ["test_b"]),
    ("import pytest, subprocess\n@pytest.fixture\ndef proc():\n"
     "    return subprocess.Popen(['true'])\ndef test_c(proc):\n    assert proc\n", ["test_c"]),
    ("import pytest, subprocess\n@pytest.mark.slow\ndef test_d():\n    subprocess.run(['true'])\n",
     []),
    ("import pytest, subprocess\npytestmark = pytest.mark.slow\n"
     "def test_e():\n    subprocess.run(['true'])\n", []),
    ("def helper():\n    return 1\ndef test_f():\n    assert helper()\n", []),
])
def test_the_checker_follows_helpers_and_fixtures(source, expected):
    assert unmarked_starters(source) == expected
