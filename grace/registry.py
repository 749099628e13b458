"""Name -> class registries for compressors, memories and communicators (and any other
pluggable family, e.g. DeepReduce codecs).

Register with a decorator, create by name, list what exists::

    @COMPRESSORS.register("topk")
    class TopK(Compressor): ...

    create("compressor", "topk", ratio=0.01)
    available("compressor")  # ['fp16', 'none', 'randomk', 'threshold', 'topk', ...]

The core imports nothing from the method folders: a registry imports its built-in module by
name the first time it is queried, then any module or class that installed packages
advertise under the entry-point group ``gracecomm.<kind>`` (e.g. ``gracecomm.compressor``).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from grace.validation import ConfigError

T = TypeVar("T", bound=type)


class UnknownNameError(ConfigError, KeyError):
    """A name that is not in a registry; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry:
    """A named family of classes."""

    def __init__(self, kind: str, builtin: str | None = None) -> None:
        self.kind = kind
        self.builtin = builtin
        self._classes: dict[str, type] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator adding the class under `name` (and setting its `registry_name`)."""

        def decorator(cls: T) -> T:
            existing = self._classes.get(name)
            if existing is not None and existing is not cls:
                raise ConfigError(f"{self.kind} '{name}' is already registered by "
                                  f"{existing.__module__}.{existing.__qualname__}")
            self._classes[name] = cls
            if "registry_name" not in cls.__dict__:
                cls.registry_name = name
            return cls

        return decorator

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        if self.builtin:
            importlib.import_module(self.builtin)
        for ep in entry_points(group=f"gracecomm.{self.kind}"):
            obj = ep.load()
            if isinstance(obj, type):
                self.register(ep.name)(obj)

    def available(self) -> list[str]:
        """Sorted names of every registered class."""
        self._load()
        return sorted(self._classes)

    def get(self, name: str) -> type:
        """The class registered under `name`; a typo raises with the valid names."""
        self._load()
        if name not in self._classes:
            close = difflib.get_close_matches(str(name), self._classes, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise UnknownNameError(f"unknown {self.kind} '{name}'.{hint} Available: "
                                   f"{', '.join(sorted(self._classes))}")
        return self._classes[name]

    def create(self, name: str, **kwargs: Any) -> Any:
        """Instantiate the class registered under `name` with `kwargs`."""
        return self.get(name)(**kwargs)

    def name_of(self, cls: type) -> str | None:
        """The name `cls` is registered under, if any."""
        self._load()
        for name, registered in self._classes.items():
            if registered is cls:
                return name
        return None

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._classes


COMPRESSORS = Registry("compressor", builtin="gracecomm.compressors")
MEMORIES = Registry("memory", builtin="gracecomm.memories")
COMMUNICATORS = Registry("communicator", builtin="gracecomm.communicators")

REGISTRIES: dict[str, Registry] = {r.kind: r for r in (COMPRESSORS, MEMORIES, COMMUNICATORS)}


def add_registry(registry: Registry) -> Registry:
    """Make a further family (e.g. ``index_codec``) reachable through `available`/`create`."""
    REGISTRIES[registry.kind] = registry
    return registry


def _registry(kind: str) -> Registry:
    if kind not in REGISTRIES:  # method packages may add families when first imported
        for builtin in (COMPRESSORS, MEMORIES, COMMUNICATORS):
            builtin._load()
    if kind not in REGISTRIES:
        raise UnknownNameError(f"unknown registry '{kind}'. Available: "
                               f"{', '.join(sorted(REGISTRIES))}")
    return REGISTRIES[kind]


def available(kind: str) -> list[str]:
    """Names registered in the family `kind` ('compressor', 'memory', 'communicator', ...)."""
    return _registry(kind).available()


def get(kind: str, name: str) -> type:
    return _registry(kind).get(name)


def create(kind: str, name: str, **kwargs: Any) -> Any:
    """Instantiate `name` from the family `kind`, e.g. ``create('compressor', 'topk', ratio=0.01)``."""
    return _registry(kind).create(name, **kwargs)
