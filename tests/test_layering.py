"""The core's layering, read from the source (every import statement, those inside functions
and ``if TYPE_CHECKING:`` blocks included): no import circle among the core's modules, and no
import of the method folders or the experiments from the core (DESIGN.md, "Layout").

The registries load their built-in method packages by name when first queried
(`gracecomm.registry.Registry`), as they load entry points: that is not an import statement
and not counted here."""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import pytest

import gracecomm

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


def import_graph(sources: Mapping[str, tuple[str, bool]]
                 ) -> tuple[dict[str, set[str]], list[str]]:
    """The imports among the modules of `sources` (name -> (source, is_package)), and every
    import of a forbidden module, as ``'module:line imports name'``."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    found = []
    for name, (source, is_package) in sources.items():
        for target, line in imported(ast.parse(source), name, is_package, sources):
            if forbidden(target):
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


def test_the_core_has_no_import_circle():
    graph, _ = import_graph(core_sources())
    assert len(graph) > 15 and graph["gracecomm.pipeline"], "the core's modules were not read"
    assert cycles(graph) == []


def test_the_core_imports_no_method_folder_nor_experiment():
    _, forbidden = import_graph(core_sources())
    assert forbidden == []


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
