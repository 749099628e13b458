"""One naming scheme (issue 40): every exception class the package defines ends in ``Error``,
read from the source of every module (`tests/test_layering.all_sources`)."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Mapping

from tests.test_layering import all_sources

# Bases that make a class an exception: the builtins' and any class of the package that is one.
ROOTS = {name for name, obj in vars(builtins).items()
         if isinstance(obj, type) and issubclass(obj, BaseException)}


def misnamed_exceptions(sources: Mapping[str, tuple[str, bool]]) -> list[str]:
    """``module.Class`` for each exception class (a subclass of a builtin exception or of
    another exception class in `sources`, by base name) whose name does not end in Error."""
    classes = [(module, node) for module, (source, _) in sources.items()
               for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)]
    exceptions = set(ROOTS)
    grew = True
    while grew:  # a subclass of a subclass of an exception, in any order of definition
        before = len(exceptions)
        exceptions |= {node.name for _, node in classes
                       if any(_base_name(b) in exceptions for b in node.bases)}
        grew = len(exceptions) > before
    return sorted(f"{module}.{node.name}" for module, node in classes
                  if node.name in exceptions and node.name not in ROOTS
                  and not node.name.endswith("Error"))


def _base_name(base: ast.expr) -> str:
    return base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")


def test_every_exception_class_ends_in_error():
    assert misnamed_exceptions(all_sources()) == []


def test_the_check_finds_a_misnamed_exception_through_a_subclass():
    sources = {"m": ("class Base(ValueError): ...\nclass Refused(Base): ...\n"
                     "class Fine(Base): ...\nclass FineError(Base): ...\n"
                     "class NotAnError: ...\n", False)}
    assert misnamed_exceptions(sources) == ["m.Base", "m.Fine", "m.Refused"]
