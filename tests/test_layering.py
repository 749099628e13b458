"""The layering, read from the source (every import statement, those inside functions and
``if TYPE_CHECKING:`` blocks included): no import circle among the modules of any package
(the core, the method folders, the experiments and their sub-packages), no import of the
method folders or the experiments from the core, and none of the experiments from a method
folder (DESIGN.md, "Layout"). The experiments' modules stay small enough to read: none over
`MAX_MODULE_LINES` lines, no function over `MAX_FUNCTION_LINES`.

The registries load their built-in method packages by name when first queried
(`gracecomm.registry.Registry`), as they load entry points: that is not an import statement
and not counted here."""

from __future__ import annotations

import ast
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from types import ModuleType

import pytest

import gracecomm
import gracecomm.communicators
import gracecomm.compressors
import gracecomm.experiments
import gracecomm.memories

CORE = "gracecomm"
FORBIDDEN = tuple(f"{CORE}.{sub}" for sub in ("compressors", "memories", "communicators",
                                              "experiments"))


def module_name(path: Path) -> str:
    return CORE if path.stem == "__init__" else f"{CORE}.{path.stem}"


def imported(tree: ast.Module, module: str, is_package: bool, known: Collection[str]
             ) -> Iterator[tuple[str, int]]:
    """Every module an import statement anywhere in `tree` names, with its line.
    ``from X import a`` names ``X.a`` where that is a module (`known`, or a forbidden
    folder imported from its package), else ``X``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                submodule = full in known or (forbidden(full) and not forbidden(base))
                yield (full if submodule else base), node.lineno


def forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def import_graph(sources: Mapping[str, tuple[str, bool]],
                 refused: Callable[[str], bool] = forbidden
                 ) -> tuple[dict[str, set[str]], list[str]]:
    """The imports among the modules of `sources` (name -> (source, is_package)), and every
    import of a `refused` module (by default the core's `forbidden` ones), as
    ``'module:line imports name'``."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    found = []
    for name, (source, is_package) in sources.items():
        for target, line in imported(ast.parse(source), name, is_package, sources):
            if refused(target):
                found.append(f"{name}:{line} imports {target}")
            elif target in sources and target != name:
                graph[name].add(target)
    return graph, found


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def core_sources() -> dict[str, tuple[str, bool]]:
    root = Path(gracecomm.__file__).parent
    return {module_name(p): (p.read_text(), p.stem == "__init__")
            for p in sorted(root.glob("*.py"))}


PACKAGES = (gracecomm.compressors, gracecomm.memories, gracecomm.communicators,
            gracecomm.experiments)
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def package_sources(package: ModuleType) -> dict[str, tuple[str, bool]]:
    """Every module of `package` and of its sub-packages, by dotted name (name -> (source,
    is_package))."""
    root = Path(package.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package.__name__, *path.relative_to(root).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path.read_text(), is_package)
    return found


def all_sources() -> dict[str, tuple[str, bool]]:
    sources = core_sources()
    for package in PACKAGES:
        sources.update(package_sources(package))
    return sources


def too_long(sources: Mapping[str, tuple[str, bool]], max_module: int, max_function: int
             ) -> list[str]:
    """Every module of `sources` over `max_module` lines and every function (or method) over
    `max_function` lines, decorators excluded, as ``'name: N lines'``."""
    found = []
    for name, (source, _) in sources.items():
        lines = len(source.splitlines())
        if lines > max_module:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > max_function:
                    found.append(f"{name}.{node.name} (line {node.lineno}): {length} lines")
    return found


def test_the_core_has_no_import_circle():
    graph, _ = import_graph(core_sources())
    assert len(graph) > 15 and graph["gracecomm.pipeline"], "the core's modules were not read"
    assert cycles(graph) == []


def test_the_core_imports_no_method_folder_nor_experiment():
    _, forbidden = import_graph(core_sources())
    assert forbidden == []


# Circles between a method's Python module and the numba kernel module it imports lazily, the
# kernels importing a constant or the pure functions they compile back from it; listed so
# that no new one appears and a removed one is struck from here.
KERNEL_CIRCLES = [
    ["gracecomm.compressors.deepreduce.bloom_kernels", "gracecomm.compressors.deepreduce.policies"],
    ["gracecomm.compressors.shared.exceedance", "gracecomm.compressors.shared.exceedance_kernels"],
    ["gracecomm.compressors.shared.quantizer_kernels", "gracecomm.compressors.shared.stochastic"],
]


def test_no_package_has_an_import_circle():
    """Among all modules of the core, the method folders and the experiments' packages
    (`KERNEL_CIRCLES` aside)."""
    sources = all_sources()
    graph, _ = import_graph(sources, refused=lambda name: False)
    for name in ("gracecomm.compressors.deepreduce", "gracecomm.experiments.training.worker",
                 "gracecomm.experiments.bench.hook", "gracecomm.experiments.cluster.netbench",
                 "gracecomm.memories", "gracecomm.communicators"):
        assert name in graph, f"{name} was not read"
    assert graph["gracecomm.experiments.training.train"] >= {
        "gracecomm.experiments.training.worker", "gracecomm.experiments.training.config"}
    assert sorted(cycles(graph)) == KERNEL_CIRCLES


def test_no_method_folder_imports_an_experiment():
    for package in PACKAGES[:-1]:
        for name, (source, is_package) in package_sources(package).items():
            for target, line in imported(ast.parse(source), name, is_package, ()):
                assert not target.startswith("gracecomm.experiments"), f"{name}:{line}"


def test_the_experiments_packages_import_nothing_of_the_experiments_at_package_import():
    """A package's ``__init__`` stays light: importing one module loads no sibling."""
    sources = package_sources(gracecomm.experiments)
    inits = [name for name, (_, is_package) in sources.items() if is_package]
    assert {"gracecomm.experiments.training", "gracecomm.experiments.reports"} <= set(inits)
    for name in inits:
        source, _ = sources[name]
        assert [t for t, _ in imported(ast.parse(source), name, True, sources)
                if t.startswith("gracecomm.experiments")] == [], name


def test_no_experiments_module_over_the_line_limits():
    sources = package_sources(gracecomm.experiments)
    assert len(sources) > 40, "the experiments' modules were not read"
    assert too_long(sources, MAX_MODULE_LINES, MAX_FUNCTION_LINES) == []


def test_the_line_limits_find_a_long_module_and_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    sources = {"gracecomm.experiments.a": (f"class C:\n  def f(self):\n{body}\n", False),
               "gracecomm.experiments.b": ("y = 1\n" * 8, False)}
    assert too_long(sources, 7, 5) == ["gracecomm.experiments.a.f (line 2): 6 lines",
                                       "gracecomm.experiments.b: 8 lines"]
    assert too_long(sources, 8, 6) == []


@pytest.mark.parametrize("sources,expected", [
    ({"gracecomm.a": ("from gracecomm.b import X", False),
      "gracecomm.b": ("def f():\n    from gracecomm import a", False)},
     [["gracecomm.a", "gracecomm.b"]]),
    ({"gracecomm.a": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from gracecomm.b import X", False),
      "gracecomm.b": ("from . import c", False),
      "gracecomm.c": ("import gracecomm.a", False)},
     [["gracecomm.a", "gracecomm.b", "gracecomm.c"]]),
    ({"gracecomm.a": ("from gracecomm.b import X", False),
      "gracecomm.b": ("import torch", False)}, []),
])
def test_the_checker_finds_circles_through_functions_and_type_checking(sources, expected):
    graph, _ = import_graph(sources)
    assert cycles(graph) == expected


def test_the_checker_finds_a_method_folder_imported_inside_a_function():
    _, forbidden = import_graph({
        "gracecomm.a": ("def f():\n    from gracecomm.compressors.topk import TopK", False),
        "gracecomm.b": ("from gracecomm import experiments", False)})
    assert forbidden == ["gracecomm.a:2 imports gracecomm.compressors.topk",
                         "gracecomm.b:1 imports gracecomm.experiments"]
