"""Name -> class registries for compressors, memories and communicators (and any other
pluggable family, e.g. DeepReduce codecs).

Register with a decorator, create by name, list what exists::

    @COMPRESSORS.register("topk")
    class TopK(Compressor): ...

    create("compressor", "topk", ratio=0.01)
    available("compressor")  # ['fp16', 'none', 'randomk', 'threshold', 'topk', ...]
    available("compressor", verbose=True)  # {..., 'topk': 'gracecomm.compressors.topk'}

A typo in a name raises `UnknownNameError` with the valid names; an option the class's
constructor does not take raises `ConfigError` with the options it does take.

The core imports nothing from the method folders: a registry imports its built-in module by
name the first time it is queried, then any module or class that installed packages
advertise under the entry-point group ``gracecomm.<kind>`` (e.g. ``gracecomm.compressor``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any, Literal, TypeVar, overload

from gracecomm.validation import ConfigError

T = TypeVar("T", bound=type)


class UnknownNameError(ConfigError, KeyError):
    """A name that is not in a registry; the message lists the valid names.

    Example:
        >>> import gracecomm
        >>> gracecomm.build("tpok")
        Traceback (most recent call last):
        ...
        gracecomm.registry.UnknownNameError: unknown compressor 'tpok'. Did you mean 'topk'? ...
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """A hint for a misspelt word, for messages.

    Args:
        word: What the user wrote.
        choices: The valid words.

    Returns:
        `` Did you mean 'x'?`` for the closest choice, else ``''``.
    """
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


class Registry:
    """A named family of classes (`COMPRESSORS`, `MEMORIES`, `COMMUNICATORS`, DeepReduce's
    codecs).

    Args:
        kind: The family's name in messages and entry points (``"compressor"``).
        builtin: The package whose import registers the built-in classes, imported the
            first time the registry is queried.

    Example:
        A method package registers its classes in `COMPRESSORS`
        (``@COMPRESSORS.register("name")``); a family of its own works the same way:

        >>> from gracecomm import Compressor
        >>> from gracecomm.registry import Registry
        >>> mine = Registry("compressor")
        >>> @mine.register("identity")
        ... class Identity(Compressor):
        ...     def compress(self, tensor, name):
        ...         return (tensor,), None
        ...     def decompress(self, payload, ctx):
        ...         return payload[0]
        >>> mine.available(), mine.create("identity").label
        (['identity'], "compressor 'identity'")
    """

    def __init__(self, kind: str, builtin: str | None = None) -> None:
        self.kind = kind
        self.builtin = builtin
        self._classes: dict[str, type] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        """A class decorator registering the class under a name.

        Args:
            name: The name users type (``compressor=name``, ``build("name")``).

        Returns:
            The decorator; it sets the class's ``registry_name`` unless the class sets it.

        Raises:
            ConfigError: Another class is registered under `name`.
        """

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

    @overload
    def available(self, verbose: Literal[False] = False) -> list[str]: ...

    @overload
    def available(self, verbose: Literal[True]) -> dict[str, str]: ...

    def available(self, verbose: bool = False) -> list[str] | dict[str, str]:
        """The names of every registered class.

        Args:
            verbose: Map each name to the module that defines the class (where to read the
                method).

        Returns:
            The sorted names, or name -> module.
        """
        self._load()
        names = sorted(self._classes)
        return {n: self._classes[n].__module__ for n in names} if verbose else names

    def get(self, name: str) -> type:
        """The class registered under a name.

        Args:
            name: The name.

        Returns:
            The class.

        Raises:
            UnknownNameError: No class has that name (the message lists the valid names).
        """
        self._load()
        if name not in self._classes:
            raise UnknownNameError(f"unknown {self.kind} '{name}'."
                                   f"{did_you_mean(name, self._classes)} Available: "
                                   f"{', '.join(sorted(self._classes))}")
        return self._classes[name]

    def create(self, name: str, **kwargs: Any) -> Any:
        """An instance of the class registered under a name.

        Args:
            name: The name.
            **kwargs: Its options.

        Returns:
            The instance.

        Raises:
            UnknownNameError: No class has that name.
            ConfigError: An option the class does not take, a required one left out (the
                message lists its options), or a bad value.
        """
        cls = self.get(name)
        check_options(cls, kwargs, f"{self.kind} '{name}'")
        return cls(**kwargs)

    def preset(self, name: str, base: type, module: str, qualname: str, doc: str,
               **defaults: Any) -> type:
        """Register a class with other default options: a preset written as data (the
        options that differ) rather than as a subclass restating the signature. Its
        signature shows the preset's defaults, so option checks and its generated config
        group entry (`gracecomm.configstore`) see them.

        Args:
            name: The preset's registry name.
            base: The class it presets.
            module: The module the new class is named in.
            qualname: Its name there; bind it to that name, so that it pickles.
            doc: Its docstring.
            **defaults: The options that differ from `base`'s defaults.

        Returns:
            The new, registered class.

        Raises:
            ConfigError: A default names an option `base` does not take.
        """
        options = options_of(base) or {}
        for key in defaults:
            if key not in options:
                raise ConfigError(f"preset {self.kind} '{name}': '{key}' is not an option of "
                                  f"{base.__qualname__}.{did_you_mean(key, options)} Options: "
                                  f"{', '.join(options)}")
        signature = inspect.signature(base)
        signature = signature.replace(parameters=[
            p.replace(default=defaults.get(n, p.default)) for n, p in signature.parameters.items()])

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            base.__init__(self, *bound.args, **bound.kwargs)

        cls = type(qualname, (base,), {"__init__": __init__, "__signature__": signature,
                                       "__module__": module, "__qualname__": qualname,
                                       "__doc__": doc, "preset_defaults": dict(defaults)})
        return self.register(name)(cls)

    def name_of(self, cls: type) -> str | None:
        """The name a class is registered under.

        Args:
            cls: The class.

        Returns:
            Its name, or None.
        """
        self._load()
        for name, registered in self._classes.items():
            if registered is cls:
                return name
        return None

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._classes


def options_of(cls: type) -> dict[str, inspect.Parameter] | None:
    """The keyword options a class takes, from its constructor's signature.

    Args:
        cls: The class.

    Returns:
        Option name -> parameter; None when the signature cannot be read or takes
        ``**kwargs`` (any option may be valid).
    """
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {n: p for n, p in params.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def check_known(keys: Iterable[str], allowed: Iterable[str], owner: str) -> None:
    """Refuse a key that is not among the allowed ones.

    Args:
        keys: The options given.
        allowed: The options there are.
        owner: Who takes them, for messages.

    Raises:
        ConfigError: ``owner: unknown option 'x'. Did you mean 'y'? Options: ...``.
    """
    allowed = list(allowed)
    listed = f"Options: {', '.join(allowed)}" if allowed else "It takes no options."
    for key in keys:
        if key not in allowed:
            raise ConfigError(f"{owner}: unknown option '{key}'.{did_you_mean(key, allowed)} "
                              f"{listed}")


def check_options(cls: type, options: Mapping[str, Any], owner: str) -> None:
    """Check options against a class's constructor.

    Args:
        cls: The class.
        options: The options to check.
        owner: The part's label, for messages.

    Raises:
        ConfigError: An option the constructor does not take, or a required one missing
            (the message names it and lists the allowed ones).
    """
    allowed = options_of(cls)
    if allowed is None:
        return
    check_known(options, allowed, owner)
    listed = f"Options: {', '.join(allowed)}" if allowed else "It takes no options."
    for key, param in allowed.items():
        if param.default is inspect.Parameter.empty and key not in options:
            raise ConfigError(f"{owner}: option '{key}' is required. {listed}")


COMPRESSORS = Registry("compressor", builtin="gracecomm.compressors")
MEMORIES = Registry("memory", builtin="gracecomm.memories")
COMMUNICATORS = Registry("communicator", builtin="gracecomm.communicators")

REGISTRIES: dict[str, Registry] = {r.kind: r for r in (COMPRESSORS, MEMORIES, COMMUNICATORS)}


def add_registry(registry: Registry) -> Registry:
    """Make a further family (``index_codec``) reachable through `available` and `create`.

    Args:
        registry: The family's registry.

    Returns:
        `registry`.
    """
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


@overload
def available(kind: str, verbose: Literal[False] = False) -> list[str]: ...


@overload
def available(kind: str, verbose: Literal[True]) -> dict[str, str]: ...


def available(kind: str, verbose: bool = False) -> list[str] | dict[str, str]:
    """The names registered in a family.

    Args:
        kind: ``"compressor"``, ``"memory"``, ``"communicator"``, or a family a method
            package adds (``"index_codec"``).
        verbose: Map each name to the module its class lives in.

    Returns:
        The sorted names, or name -> module (``'gracecomm.compressors.topk'``).

    Raises:
        UnknownNameError: No such family.

    Example:
        >>> import gracecomm
        >>> "topk" in gracecomm.available("compressor")
        True
        >>> gracecomm.available("memory", verbose=True)["residual"]
        'gracecomm.memories.residual'
    """
    return _registry(kind).available(verbose)


def get(kind: str, name: str) -> type:
    """The class registered under a name in a family.

    Args:
        kind: The family (``"compressor"``, ...).
        name: The name.

    Returns:
        The class.

    Raises:
        UnknownNameError: No such family or name (the message lists the valid ones).

    Example:
        >>> from gracecomm import registry
        >>> registry.get("compressor", "topk").__name__
        'TopK'
    """
    return _registry(kind).get(name)


def create(kind: str, name: str, **kwargs: Any) -> Any:
    """An instance of a registered class.

    Args:
        kind: The family (``"compressor"``, ``"memory"``, ``"communicator"``, ...).
        name: The name.
        **kwargs: Its options.

    Returns:
        The instance.

    Raises:
        UnknownNameError: No such family or name (the message lists the valid ones).
        ConfigError: An unknown, missing or invalid option (the message names it).

    Example:
        >>> import gracecomm
        >>> gracecomm.create("compressor", "topk", ratio=0.01).ratio
        0.01
    """
    return _registry(kind).create(name, **kwargs)
