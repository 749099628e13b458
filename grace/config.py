"""Safe instantiation of Hydra configs.

Hydra's ``_target_`` can name any importable callable, and its dotted path may pass through
module globals (``gracecomm.experiments.train.os.system`` is ``os.system``). Configs here may
only instantiate classes and functions *defined* in this project's packages and a short list
of allowed torch modules, unless the user opts out with ``allow_any_target=True``
(``allow_any_target=true`` on the command line). Every ``_target_`` of a config is checked,
nested ones included, by resolving it the way Hydra does and looking at where the object it
resolves to was defined (``obj.__module__``), never at the spelling of the path.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

from gracecomm.validation import ConfigError, MissingDependency

ALLOWED_MODULES: tuple[str, ...] = ("gracecomm", "torch.optim", "torch.nn")
OLD_ROOT = "grace."  # the core's import root before 0.2: everything is under gracecomm now


def _targets(node: Any, path: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key == "_target_":
                yield path or "<root>", value
            else:
                yield from _targets(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _targets(value, f"{path}[{i}]")


def _inside(module: Any, allowed: tuple[str, ...]) -> bool:
    """`module` (a dotted name) is one of `allowed` or a submodule of one."""
    return isinstance(module, str) and any(module == a or module.startswith(f"{a}.")
                                           for a in allowed)


def resolve_target(target: str) -> Any:
    """The object a dotted ``_target_`` names, found as Hydra finds it: import the first
    part, then for each further part take the attribute, or else import the submodule of
    that name; `LookupError` if there is none. Call it only on a path inside the allowed
    modules (it imports modules)."""
    parts = target.split(".")
    try:
        if not all(parts):
            raise ImportError("empty part in the dotted path")
        obj: Any = importlib.import_module(parts[0])
        for i, part in enumerate(parts[1:], start=1):
            if hasattr(obj, part):
                obj = getattr(obj, part)
            elif isinstance(obj, ModuleType):
                obj = importlib.import_module(".".join(parts[: i + 1]))
            else:
                raise AttributeError(f"{'.'.join(parts[:i])!r} has no attribute {part!r}")
    except (ImportError, AttributeError) as err:
        raise LookupError(f"_target_ {target!r} cannot be found: {err}") from None
    return obj


def check_target(target: Any, path: str = "<root>",
                 allowed: tuple[str, ...] = ALLOWED_MODULES) -> Any:
    """The class or function `target` (a dotted path or the object itself) names, if it is
    defined in a module inside `allowed`; otherwise `ConfigError` naming the config path,
    the target and what it really is. A path outside `allowed` is refused before anything
    is imported, so a refused target runs no import-time code either."""
    if isinstance(target, str) and target.startswith(OLD_ROOT):
        raise ConfigError(f"config '{path}' has _target_ {target!r}: the core moved to the "
                          f"import root gracecomm, use 'gracecomm.{target[len(OLD_ROOT):]}'")
    if isinstance(target, str) and not _inside(target, allowed):
        why = "outside the allowed modules"
    else:
        try:
            obj = resolve_target(target) if isinstance(target, str) else target
        except LookupError as err:
            raise ConfigError(f"config '{path}': {err}") from None
        defined = inspect.isclass(obj) or inspect.isfunction(obj)
        module = getattr(obj, "__module__", None) if defined else None
        if _inside(module, allowed):
            return obj
        why = (f"which is {module}.{obj.__qualname__}" if defined
               else f"which is a {type(obj).__name__}, not a class or function")
    raise ConfigError(f"config '{path}' has _target_ {target!r}, {why}: only classes and "
                      f"functions defined in {', '.join(allowed)} may be instantiated (set "
                      "allow_any_target=true to allow any target)")


def check_targets(cfg: Any, allowed: tuple[str, ...] = ALLOWED_MODULES) -> None:
    """Raise `ConfigError` if any ``_target_`` in `cfg`, at any depth, is not a class or
    function defined inside the allowed modules."""
    for path, target in _targets(_plain(cfg)):
        check_target(target, path, allowed)


def _plain(cfg: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return cfg
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def instantiate(cfg: Any, *, allow_any_target: bool = False, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate` after checking every ``_target_`` (recursively)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    if not allow_any_target:
        check_targets(cfg)
    try:
        return hydra_instantiate(cfg, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ConfigError, MissingDependency)):  # our message says it all
            raise err.__cause__ from None
        raise
