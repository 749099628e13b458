"""Safe instantiation of Hydra configs.

Hydra's ``_target_`` can name any importable callable. Configs here may only instantiate
classes from this project's packages and a short list of allowed modules, unless the user
opts out with ``allow_any_target=True`` (``trainer.allow_any_target=true`` on the command line).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from grace.validation import ConfigError, MissingDependency

ALLOWED_PREFIXES: tuple[str, ...] = (
    "grace.", "gracecomm.",
    "torch.optim.", "torch.nn.",
)


def _targets(node: Any, path: str = "") -> Iterable[tuple[str, str]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key == "_target_":
                yield path or "<root>", str(value)
            else:
                yield from _targets(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _targets(value, f"{path}[{i}]")


def check_targets(cfg: Any, allowed: tuple[str, ...] = ALLOWED_PREFIXES) -> None:
    """Raise `ConfigError` if any ``_target_`` in `cfg` lies outside the allowed modules."""
    for path, target in _targets(_plain(cfg)):
        if not target.startswith(allowed):
            raise ConfigError(f"config '{path}' has _target_ {target!r}, outside the allowed "
                              f"modules ({', '.join(p.rstrip('.') for p in allowed)}); set "
                              "allow_any_target=true to instantiate arbitrary classes")


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
