"""The public API documents itself in one form (Google style, which the docs site's API
reference renders): everything `gracecomm` exports has a docstring with an example, every
public function and method of it lists each parameter under ``Args:`` and, where it returns
something, has ``Returns:``; and the examples run as written (doctest)."""

from __future__ import annotations

import dataclasses
import doctest
import inspect
import re
import sys

import pytest

import gracecomm
from gracecomm.registry import Registry

SECTION = re.compile(r"^\s*(Args|Returns|Raises|Example|Examples|Attributes):\s*$", re.M)


def sections(doc: str) -> dict[str, str]:
    """The Google-style sections of a docstring, by title (``Examples`` as ``Example``)."""
    doc = inspect.cleandoc(doc)
    found = list(SECTION.finditer(doc))
    out = {}
    for match, after in zip(found, found[1:] + [None]):
        title = match.group(1).removesuffix("s") if match.group(1) == "Examples" else \
            match.group(1)
        out[title] = doc[match.end():after.start() if after else len(doc)]
    return out


def exported() -> dict[str, object]:
    """What `gracecomm` exports, the registries as their class (type aliases have no
    run-time docstring)."""
    out = {}
    for name in gracecomm.__all__:
        obj = getattr(gracecomm, name)
        if isinstance(obj, Registry):
            obj = Registry
        if inspect.isclass(obj) or inspect.isfunction(obj):
            out[obj.__qualname__] = obj
    return out


def own(cls: type) -> dict[str, object]:
    """The public methods and properties of `cls` defined in gracecomm (inherited ones
    included: `Part.bind`, `Stateful.state_dict`)."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("gracecomm"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or not (inspect.isfunction(value)
                                            or isinstance(value, (property, classmethod,
                                                                  staticmethod))):
                continue
            out[name] = value
    return out


def documented() -> list[tuple[str, object]]:
    """(name, function) of every public callable to check: exported functions, the
    constructors (documented in their class's docstring) and the methods of exported
    classes."""
    out = []
    for name, obj in exported().items():
        if inspect.isfunction(obj):
            out.append((name, obj))
            continue
        if issubclass(obj, BaseException):
            continue
        for meth, value in own(obj).items():
            func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            out.append((f"{name}.{meth}", func))
    return sorted(out, key=lambda pair: pair[0])


def problems(name: str, func: object) -> list[str]:
    """What the docstring of one function or property lacks."""
    doc = inspect.getdoc(func) or ""
    if not doc:
        return [f"{name}: no docstring"]
    if isinstance(func, property):
        return []
    found = sections(doc)
    wrong = []
    params = [p for p in inspect.signature(func).parameters.values()
              if p.name not in ("self", "cls")]
    listed = found.get("Args", "")
    for p in params:
        shown = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        entry = shown.get(p.kind, "") + p.name
        if not re.search(rf"^\s*{re.escape(entry)}:", listed, re.M):
            wrong.append(f"{name}: parameter '{entry}' not under Args:")
    returns = inspect.signature(func).return_annotation
    if returns not in ("None", None, inspect.Signature.empty) and "Returns" not in found:
        wrong.append(f"{name}: returns {returns} but has no Returns:")
    return wrong


def test_every_export_has_a_docstring_with_an_example():
    missing = [name for name, obj in exported().items()
               if "Example" not in sections(inspect.getdoc(obj) or "")]
    assert len(exported()) > 15
    assert missing == []


def test_constructors_are_documented_in_their_class():
    """Under Args:, or for a dataclass under Attributes:."""
    wrong = []
    for name, cls in exported().items():
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        init = cls.__dict__.get("__init__")
        if init is None or not cls.__module__.startswith("gracecomm"):
            continue
        params = [p for p in inspect.signature(init).parameters if p != "self"]
        found = sections(inspect.getdoc(cls) or "")
        listed = found.get("Attributes" if dataclasses.is_dataclass(cls) else "Args", "")
        wrong += [f"{name}: '{p}' not under Args:" for p in params
                  if not re.search(rf"^\s*{p}:", listed, re.M)]
    assert wrong == []


def test_public_functions_and_methods_list_args_and_returns():
    checked = documented()
    assert {"build", "Grace.step_many", "Compressor.compress", "Registry.create",
            "Communicator.bind"} <= {name for name, _ in checked}
    wrong = [line for name, func in checked for line in problems(name, func)]
    assert wrong == []


def test_the_checker_finds_a_missing_argument_and_return():
    def half(x: int, *, scale: float = 1.0) -> float:
        """Half of x.

        Args:
            x: A number.
        """
        return x * scale / 2

    assert problems("half", half) == ["half: parameter 'scale' not under Args:",
                                      "half: returns float but has no Returns:"]


@pytest.mark.parametrize("module", sorted({obj.__module__ for obj in exported().values()}
                                          | {"gracecomm.state", "gracecomm.registry"}))
def test_the_examples_run_as_written(module):
    failed, attempted = doctest.testmod(
        sys.modules[module], optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failed == 0
