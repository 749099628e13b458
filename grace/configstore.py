"""The config groups of the registered parts, generated from the registries (Hydra's
`ConfigStore`): a registered class with its defaults is selectable by name with no YAML.

``compressor=sidco compressor.ratio=0.001`` composes the entry `node_of` makes from
`gracecomm.compressors.sidco.SIDCo`'s signature: its ``_target_`` and every option with its
default. An option the run's config supplies is an interpolation instead (`RUN_KEYS`, a
class's ``run_keys``): Random-k's ``seed`` is the run's ``${seed}``, a sparsifier's
``ratio`` is the experiment's ``experiment.ratio`` when an experiment sets one, else the
class's default. What Hydra offers beyond that stays YAML in the package's configs: a
choice that is not a class (``memory=auto``), defaults that are not the class's
(``configs/compressor/compose.yaml``'s stages), nested groups (DeepReduce's).

Groups (`GROUPS`): ``compressor``, ``memory`` and ``communicator`` hold their registries;
a method package adds its own with `add_group` (DeepReduce: ``compressor/sparsifier``,
``compressor/index``, ``compressor/value``). The ``method`` group gets one preset per
compressor, ``+method=NAME``, the compressor with what it brings (`method_node`), where
``configs/method/`` has no file of that name.

Lists of every method are derived, not written out: an experiment sweeps
``compressor: ${gracecomm.every:compressor}`` (`every`), and a YAML file that nests a
registered class names its default, ``${gracecomm.default:topk,ratio}`` (`default`).

`register_configs` fills the store and registers the resolver; every command composes inside
`gracecomm.config.guard_composition`, which calls it first, so installed packages'
classes (entry points ``gracecomm.<kind>``) are offered too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

PROVIDER = "gracecomm"
METHOD_GROUP = "method"
CONFIG_PACKAGE = "gracecomm.configs"
RUN_KEYS = "run_keys"  # the class attribute: option -> the key of the run's config it follows
EVERY = "gracecomm.every"  # the resolver of `every`
DEFAULT = "gracecomm.default"  # the resolver of `default`


@dataclass(frozen=True)
class Group:
    """A config group generated from a registry.

    Attributes:
        kind: The registry (``"compressor"``, ``"index_codec"``).
        select: Which of its classes the group offers (all when None).
    """

    kind: str
    select: Callable[[type], bool] | None = None


GROUPS: dict[str, Group] = {kind: Group(kind) for kind in ("compressor", "memory",
                                                             "communicator")}


def add_group(group: str, kind: str, select: Callable[[type], bool] | None = None) -> None:
    """Offer the classes of registry `kind` (those `select` accepts) as config group
    `group`, e.g. ``add_group("compressor/index", "index_codec")``.

    Args:
        group: The config group's path (``compressor/sparsifier``).
        kind: The registry.
        select: A filter on the classes; None offers all.
    """
    GROUPS[group] = Group(kind, select)


def run_keys(cls: type) -> dict[str, str]:
    """Option -> run config key of `cls` and its bases (their ``run_keys``), for the
    options it takes."""
    from gracecomm.registry import options_of
    options = options_of(cls) or {}
    keys: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        keys.update(vars(base).get(RUN_KEYS, {}))
    return {option: key for option, key in keys.items() if option in options}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _default(cls: type, option: str, default: Any) -> Any:
    """A YAML value for `default`; None stands for the class's (or its module's)
    ``<OPTION>_DEFAULTS`` mapping when there is one, spelt out so that
    ``compressor.adapt.escape=true`` can set one of its keys."""
    if default is None:
        name = f"{option.upper()}_DEFAULTS"
        table = getattr(cls, name, getattr(inspect.getmodule(cls), name, None))
        if isinstance(table, Mapping):
            return _plain(table)
    return _plain(default)


def node_of(cls: type) -> dict[str, Any]:
    """The config group entry of a registered class: its ``_target_`` and every option with
    its default; a required option is ``???`` (Hydra's missing value); an option in its
    ``run_keys`` interpolates the run's config (``${oc.select:experiment.ratio,0.01}``).

    Example:
        >>> from gracecomm.registry import get
        >>> node_of(get("compressor", "topk"))  # doctest: +NORMALIZE_WHITESPACE
        {'_target_': 'gracecomm.compressors.topk.TopK',
         'ratio': '${oc.select:experiment.ratio,0.01}', 'backend': 'auto'}
    """
    from gracecomm.registry import options_of
    node: dict[str, Any] = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
    links = run_keys(cls)
    for option, param in (options_of(cls) or {}).items():
        required = param.default is inspect.Parameter.empty
        if option in links:
            key = links[option]
            node[option] = ("${" + key + "}" if required else
                            "${oc.select:" + f"{key},{param.default}" + "}")
        else:
            node[option] = "???" if required else _default(cls, option, param.default)
    return node


def method_node(compressor: str) -> dict[str, Any]:
    """The ``method`` preset of a compressor by its name alone (``+method=topk``): the
    compressor with its defaults and the memory and communicator it brings."""
    return {"defaults": [{"override /compressor": compressor}, "_self_"]}


def entries() -> Iterator[tuple[str, str, type]]:
    """(group, name, class) of every generated group entry."""
    from gracecomm.registry import available, get
    for kind in ("compressor", "memory", "communicator"):
        available(kind)  # loads the method packages, which add their groups
    for group, spec in list(GROUPS.items()):
        for name in available(spec.kind):
            cls = get(spec.kind, name)
            if spec.select is None or spec.select(cls):
                yield group, name, cls


def yaml_names(group: str) -> list[str]:
    """The names of the YAML files the package's configs hold in `group`."""
    folder = resources.files(CONFIG_PACKAGE).joinpath(*group.split("/"))
    if not folder.is_dir():
        return []
    return sorted(e.name[:-5] for e in folder.iterdir() if e.name.endswith(".yaml"))


def method_names() -> list[str]:
    """Every ``method`` preset: the files of ``configs/method/`` and one per compressor."""
    from gracecomm.registry import available
    return sorted(set(yaml_names(METHOD_GROUP)) | set(available("compressor")))


def every(kind: str, instead: Mapping[str, str] | None = None) -> str:
    """Every name registered in `kind`, comma-separated, as a sweep lists them: the
    resolver ``${gracecomm.every:compressor}`` of the experiments' sweeps.

    Args:
        kind: The registry (``"compressor"``).
        instead: name -> what stands for it in the list (``{none: dense}``: a method preset
            of another name for that compressor).

    Returns:
        ``"bf16,compose,..."``.
    """
    from gracecomm.registry import available
    instead = dict(instead or {})
    return ",".join(str(instead.get(name, name)) for name in available(kind))


def default(name: str, option: str) -> Any:
    """The default of option `option` of compressor `name`: the resolver
    ``${gracecomm.default:topk,ratio}``, for a YAML file that gives a registered class as a
    nested part (``configs/compressor/compose.yaml``'s stages) without restating its default.
    """
    from gracecomm.registry import get, options_of
    return _plain((options_of(get("compressor", name)) or {})[option].default)


def register_configs() -> None:
    """Store every generated entry in Hydra's `ConfigStore` (again after a registry grew).

    A YAML file of the same group and name in the package's configs takes precedence (it
    adds what the class cannot say: ``configs/compressor/compose.yaml``'s stages), so no
    entry is generated for it.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf
    for resolver, fn in ((EVERY, every), (DEFAULT, default)):
        if not OmegaConf.has_resolver(resolver):
            OmegaConf.register_new_resolver(resolver, fn)
    store = ConfigStore.instance()
    files: dict[str, set[str]] = {}

    def put(group: str, name: str, node: dict[str, Any], package: str | None = None) -> None:
        if group not in files:
            files[group] = set(yaml_names(group))
        if name in files[group]:
            return
        store.store(name=name, node=node, group=group, package=package, provider=PROVIDER)

    compressors = []
    for group, name, cls in entries():
        put(group, name, node_of(cls))
        if group == "compressor":
            compressors.append(name)
    for name in compressors:
        put(METHOD_GROUP, name, method_node(name), package="_global_")


def generated(group: str, name: str) -> dict[str, Any] | None:
    """The generated entry `name` of `group` (plain data), or None when `group` offers no
    such class or a YAML file of the package's configs provides it."""
    if name in yaml_names(group):
        return None
    if group == METHOD_GROUP:
        from gracecomm.registry import available
        return method_node(name) if name in available("compressor") else None
    for g, n, cls in entries():
        if (g, n) == (group, name):
            return node_of(cls)
    return None
