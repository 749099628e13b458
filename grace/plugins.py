"""Importing every module of a method package registers its classes, so adding a method is
one new file (plus its YAML) and no shared list to edit."""

from __future__ import annotations

import importlib
import pkgutil


def import_submodules(package: str) -> None:
    """Import every module and subpackage of `package` (recursively)."""
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
        importlib.import_module(info.name)
