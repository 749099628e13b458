"""One naming scheme, read from the source of every module (`tests/test_layering.all_sources`):
every exception class the package defines ends in ``Error``, and every module that imports
numba (a kernel module, imported only when numba is used) is named ``*_kernels``."""

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


def misnamed_kernel_modules(sources: Mapping[str, tuple[str, bool]]) -> list[str]:
    """The modules that import numba at their top level but are not named ``*_kernels``."""
    return sorted(module for module, (source, _) in sources.items()
                  if _imports_numba(ast.parse(source))
                  and not module.rpartition(".")[2].endswith("_kernels"))


def _imports_numba(tree: ast.Module) -> bool:
    for node in tree.body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "numba" or n.startswith("numba.") for n in names):
            return True
    return False


def test_every_numba_module_is_named_kernels():
    sources = all_sources()
    assert any(m.endswith("exceedance_kernels") for m in sources), "the sources were not read"
    assert misnamed_kernel_modules(sources) == []


def test_the_check_finds_a_misnamed_kernel_module():
    sources = {"p.fast": ("import numba\n", False), "p.ok_kernels": ("from numba import njit\n",
                                                                    False),
               "p.lazy": ("def f():\n    import numba\n", False)}
    assert misnamed_kernel_modules(sources) == ["p.fast"]
