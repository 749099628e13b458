"""Importing every module of a method package registers its classes, so adding a method is
one new file and no shared list to edit (its config group entry is generated,
`gracecomm.configstore`)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Collection


def import_submodules(package: str, exclude: Collection[str] = ()) -> None:
    """Import every module and subpackage of `package` (recursively), except the
    subpackages and modules named in `exclude` (machinery that registers nothing and loads
    when a method uses it)."""
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in exclude:
            continue
        name = f"{package}.{info.name}"
        if info.ispkg:
            import_submodules(name)
        else:
            importlib.import_module(name)
