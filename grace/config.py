"""A config is data, not code: what a Hydra config may instantiate.

A ``_target_`` may name only, by its exact dotted name:

- a class registered in one of the registries of `gracecomm.registry` (compressors,
  memories, communicators, DeepReduce's codecs, any family a plugin adds), under the module
  that defines it or a package that re-exports it under the same name;
- a target that the package's own configs name (`offered_targets`: the models, data sets,
  loggers and Hydra callback the experiments offer);
- one of `OUTSIDE_TARGETS` (torch's optimizers and schedulers, a few torch.nn layers,
  Optuna's samplers) and, inside ``hydra.launcher`` and ``hydra.sweeper``, an installed
  Hydra launcher or sweeper.

Nothing a config names is imported or resolved to judge it, so a refused target runs no
import-time code, and no function of this package (a helper, a loader, `instantiate`
itself) is a target. ``allow_any_target`` lifts the check: it is an argument of the Python
calls and, for the commands, an override on the command line (`opted_in`); a config file,
a config directory or a sweeper's parameters cannot switch it on (`check_composed`).

A composed Hydra config holds more than the run's parts: `check_composed` also checks its
``hydra.*`` targets, the factories of its logging configs, the environment it sets for the
job and every config group choice, and `guard_composition` makes Hydra check each config it
composes before it uses any of it (callbacks, logging, launchers).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any

from hydra.errors import CompactHydraException

from gracecomm.validation import ConfigError, MissingDependency

OLD_ROOT = "grace."  # the core's import root before 0.2: everything is under gracecomm now
OFFERING_PACKAGE = "gracecomm.configs"  # the package whose YAML files offer targets
OPT_IN = "allow_any_target"

# Classes from outside this package that a config may name, each by its exact name.
OUTSIDE_TARGETS: frozenset[str] = frozenset(
    [f"torch.optim.{name}" for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop",
        "Rprop", "ASGD", "SparseAdam", "LBFGS")]
    + [f"torch.optim.lr_scheduler.{name}" for name in (
        "StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "LinearLR",
        "ConstantLR", "OneCycleLR", "ReduceLROnPlateau")]
    + [f"torch.nn.{name}" for name in (
        "Linear", "Conv1d", "Conv2d", "BatchNorm1d", "BatchNorm2d", "LayerNorm", "GroupNorm",
        "Dropout", "ReLU", "GELU", "Tanh", "Sigmoid", "Flatten", "Identity", "Sequential",
        "Embedding", "LSTM", "GRU", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d",
        "CrossEntropyLoss", "MSELoss")]
    + [f"optuna.samplers.{name}" for name in (
        "TPESampler", "RandomSampler", "CmaEsSampler", "NSGAIISampler", "NSGAIIISampler",
        "GridSampler", "QMCSampler", "MOTPESampler", "BruteForceSampler", "GPSampler")])

# What Python's logging configuration (``hydra.job_logging``, ``hydra.hydra_logging``) may
# construct (its ``()`` and ``class`` keys) and the external objects it may refer to.
LOGGING_TARGETS: frozenset[str] = frozenset({
    "logging.StreamHandler", "logging.FileHandler", "logging.NullHandler", "logging.Formatter",
    "logging.Filter", "logging.handlers.RotatingFileHandler",
    "logging.handlers.TimedRotatingFileHandler", "logging.handlers.WatchedFileHandler",
    "colorlog.ColoredFormatter"})
LOGGING_EXTERNALS: frozenset[str] = frozenset({"ext://sys.stdout", "ext://sys.stderr"})

# Environment variables a config may set for the job (``hydra.job.env_set``): thread counts,
# devices, logging and collective options. Any other (PYTHONPATH, LD_PRELOAD, cache
# directories a library loads code from) is set in the shell by whoever runs the command.
JOB_ENVIRONMENT: frozenset[str] = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "NUMBA_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "GLOO_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "TOKENIZERS_PARALLELISM",
    "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_SILENT", "WANDB_RUN_GROUP",
    "WANDB_TAGS", "WANDB_NOTES", "WANDB_NAME", "TQDM_DISABLE"})


def _nodes(node: Any, keys: Iterable[str], path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(path of the mapping, key, value) of every entry whose key is one of `keys`, at any
    depth."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key in keys:
                yield path or "<root>", key, value
            else:
                yield from _nodes(value, keys, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _nodes(value, keys, f"{path}[{i}]")


def names_of(obj: Any) -> set[str]:
    """The dotted names a class or function goes by: ``module.qualname`` of where it is
    defined, and ``package.name`` for every package above that module that re-exports it
    under the same name (``gracecomm.compressors.deepreduce.BloomIndex``)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)):
        return set()
    names = {f"{module}.{qualname}"}
    parts = module.split(".")
    for i in range(1, len(parts)):
        package = sys.modules.get(".".join(parts[:i]))
        if "." not in qualname and getattr(package, qualname, None) is obj:
            names.add(f"{'.'.join(parts[:i])}.{qualname}")
    return names


def _registered_names() -> frozenset[str]:
    from gracecomm.registry import REGISTRIES, available
    for kind in ("compressor", "memory", "communicator"):
        available(kind)  # loads the built-in families (and the codec registries they add)
    key = tuple((kind, len(available(kind))) for kind in sorted(REGISTRIES))
    return _names_of_registries(key)


@functools.cache
def _names_of_registries(key: tuple[tuple[str, int], ...]) -> frozenset[str]:
    from gracecomm.registry import available, get
    return frozenset(name for kind, _ in key for entry in available(kind)
                     for name in names_of(get(kind, entry)))


@functools.cache
def offered_targets() -> frozenset[str]:
    """Every ``_target_`` the YAML files of the package's own configs name (read, never
    resolved): the models, data sets, loggers and callbacks the experiments offer."""
    import yaml
    found: set[str] = set()

    def walk(folder: Any) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry)
            elif entry.name.endswith(".yaml"):
                data = yaml.safe_load(entry.read_text(encoding="utf-8"))
                found.update(v for _, _, v in _nodes(data, ("_target_",)) if isinstance(v, str))

    walk(resources.files(OFFERING_PACKAGE))
    return frozenset(found)


@functools.cache
def _hydra_plugin_names() -> frozenset[str]:
    """The installed Hydra launchers and sweepers (`hydra.core.plugins.Plugins`)."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher
    from hydra.plugins.sweeper import Sweeper
    return frozenset(name for kind in (Launcher, Sweeper)
                     for cls in Plugins.instance().discover(kind) for name in names_of(cls))


def allowed_targets(*, hydra_plugins: bool = False) -> frozenset[str]:
    """Every name a ``_target_`` may have (module docstring); with `hydra_plugins`, the
    installed Hydra launchers and sweepers too."""
    names = _registered_names() | offered_targets() | OUTSIDE_TARGETS
    return names | _hydra_plugin_names() if hydra_plugins else names


def check_target(target: Any, path: str = "<root>", *, hydra_plugins: bool = False) -> None:
    """Raise `ConfigError` naming the config path and the target unless `target` (a dotted
    name, or a class or function given from Python) is an allowed target."""
    if isinstance(target, str) and target.startswith(OLD_ROOT):
        raise ConfigError(f"config '{path}' has _target_ {target!r}: the core moved to the "
                          f"import root gracecomm, use 'gracecomm.{target[len(OLD_ROOT):]}'")
    allowed = allowed_targets(hydra_plugins=hydra_plugins)
    names = {target} if isinstance(target, str) else names_of(target)
    if names & allowed:
        return
    shown = target if isinstance(target, str) else (min(names) if names else repr(target))
    close = difflib.get_close_matches(str(shown), sorted(allowed), n=1, cutoff=0.8)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"config '{path}' has _target_ {shown!r}, which is not a registered part or a class "
        "the configs offer: only registered compressors, memories, communicators and codecs "
        "(gracecomm.available), the models, data sets, loggers and callbacks of the "
        "package's configs and the listed outside classes (torch.optim.SGD, torch.nn.Linear, "
        "...: gracecomm.config.OUTSIDE_TARGETS) may be instantiated, each by its exact "
        f"name.{hint} To allow any target, give {OPT_IN}=true on the command line "
        f"({OPT_IN}=True in Python).")


def check_targets(cfg: Any, *, hydra_plugins: bool = False) -> None:
    """Raise `ConfigError` if any ``_target_`` in `cfg`, at any depth, is not allowed."""
    for path, _, target in _nodes(_plain(cfg), ("_target_",)):
        check_target(target, path, hydra_plugins=hydra_plugins)


def _plain(cfg: Any, resolve: bool = True) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=resolve)
    return cfg


def instantiate(cfg: Any, *, allow_any_target: bool = False, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate` after checking every ``_target_`` (recursively).

    Args:
        cfg: a config (mapping or DictConfig) with ``_target_``.
        allow_any_target: skip the check (the caller's own decision, never a config's).
        **kwargs: passed on to Hydra (overrides, ``_recursive_``, ...).

    Returns:
        The instantiated object.

    Raises:
        ConfigError: a ``_target_`` is not allowed (module docstring).

    Example:
        >>> instantiate({"_target_": "gracecomm.compressors.topk.TopK", "ratio": 0.01})
    """
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


# -- composed Hydra configs -----------------------------------------------------------------

def _override_keys(overrides: Sequence[str]) -> dict[str, Any]:
    """key -> value of `overrides` (command-line syntax), parsed as Hydra parses them; a
    sweep's value is its list of choices."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    out: dict[str, Any] = {}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.is_delete():
            continue
        value = override.value()
        out[override.get_key_element().lstrip("+~")] = (
            list(value.list) if hasattr(value, "list") else value)
    return out


def _true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def opted_in(overrides: Sequence[str]) -> bool:
    """Whether `overrides` (the command line's, or those given to a Python call) set
    ``allow_any_target`` to true."""
    return _true(_override_keys(overrides).get(OPT_IN))


def check_composed(cfg: Any, overrides: Sequence[str]) -> None:
    """Check a composed Hydra config, ``hydra`` node included, composed with `overrides`
    (the command line's): every ``_target_`` (unless `opted_in`), the factories of its
    logging configs, the variables ``hydra.job.env_set`` sets, every config group choice,
    and that only `overrides` switch ``allow_any_target`` on. Raises `ConfigError` naming
    the config path, what is wrong and what is allowed."""
    from omegaconf import DictConfig, OmegaConf
    given = _override_keys(overrides)
    opened = _true(given.get(OPT_IN))
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    if _true(node.get(OPT_IN, False)) and not opened:
        raise ConfigError(f"a config file sets {OPT_IN}: true; only the person running the "
                          f"command can allow any target: give {OPT_IN}=true on the command "
                          "line (or allow_any_target=True in Python)")
    params = OmegaConf.select(node, "hydra.sweeper.params")
    if isinstance(params, Mapping) and any(str(k).lstrip("+~") == OPT_IN for k in params) \
            and OPT_IN not in given and f"hydra.sweeper.params.{OPT_IN}" not in given:
        raise ConfigError(f"config 'hydra.sweeper.params' sweeps {OPT_IN}; only the person "
                          f"running the command can allow any target: give {OPT_IN}=true on "
                          "the command line")
    choices = OmegaConf.select(node, "hydra.runtime.choices")
    for group, choice in (_plain(choices, resolve=False) or {}).items():
        if isinstance(choice, str) and (choice.startswith("/") or ".." in choice.split("/")):
            raise ConfigError(f"config group '{group}': choice {choice!r} leaves the config "
                              "tree; a choice is the name of a file in its group's folder "
                              "(on the search path), without '..' or a leading '/'")
    env = OmegaConf.select(node, "hydra.job.env_set")
    for name in (_plain(env, resolve=False) or {}):
        if name not in JOB_ENVIRONMENT:
            raise ConfigError(f"config 'hydra.job.env_set' sets the environment variable "
                              f"{name!r}, which a config may not set (it could make the run "
                              "load code from elsewhere); set it in the shell that runs the "
                              f"command. A config may set {', '.join(sorted(JOB_ENVIRONMENT))}")
    if opened:
        return
    for path, target in _resolved(node, ("_target_",)):
        check_target(target, path, hydra_plugins=path.startswith(("hydra.launcher",
                                                                   "hydra.sweeper")))
    for section in ("hydra.job_logging", "hydra.hydra_logging"):
        for path, value in _resolved(OmegaConf.select(node, section), ("()", "class"), section):
            if value not in LOGGING_TARGETS:
                raise ConfigError(f"config '{path}' names {value!r}, which the logging "
                                  f"configuration may not construct; allowed: "
                                  f"{', '.join(sorted(LOGGING_TARGETS))}")
        for path, value in _strings(_plain(OmegaConf.select(node, section), resolve=False),
                                    section):
            if value.startswith("ext://") and value not in LOGGING_EXTERNALS:
                raise ConfigError(f"config '{path}' refers to {value!r}; the logging "
                                  f"configuration may refer to {', '.join(LOGGING_EXTERNALS)}")
    setup = OmegaConf.select(node, "hydra.launcher.setup")
    if setup:
        raise ConfigError(f"config 'hydra.launcher.setup' holds shell commands ({setup}); "
                          f"give {OPT_IN}=true on the command line to run them")


def _resolved(node: Any, keys: Sequence[str], base: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every entry of `node` under one of `keys`, at any depth, its value
    resolved; an interpolation that cannot be resolved before the run is refused."""
    from omegaconf import OmegaConf
    if node is None:
        return
    for path, key, value in _nodes(_plain(node, resolve=False), keys):
        where = f"{base}.{path}" if base else path
        if isinstance(value, str) and "${" in value:
            try:
                parent = node if path == "<root>" else OmegaConf.select(
                    node, path, throw_on_resolution_failure=True)
                value = parent[key]
            except Exception as err:  # noqa: BLE001 - any failure: not a literal name
                raise ConfigError(f"config '{where}' names {value!r}, which cannot be "
                                  f"resolved before the run ({err}); name the class") from None
        yield where, value


def _strings(node: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _strings(value, f"{path}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


class RefusedConfig(ConfigError, CompactHydraException):
    """A composed config that `check_composed` refused (Hydra prints only its message)."""


def guarded(entry: Callable[[], Any]) -> Callable[[], Any]:
    """A command's Hydra entry point (a ``@hydra.main`` function), run inside
    `guard_composition`: what the console scripts call.

    Args:
        entry: The ``@hydra.main`` function.

    Returns:
        The function to run as the command.
    """

    @functools.wraps(entry)
    def command() -> Any:
        with guard_composition():
            return entry()

    return command


@contextlib.contextmanager
def guard_composition() -> Iterator[None]:
    """While the block runs, every config Hydra composes is checked (`check_composed`, with
    the overrides it was composed with) before Hydra uses any part of it: its callbacks,
    logging configuration, launcher and sweeper, and the job. The commands run their Hydra
    entry point inside it; it first offers the registered parts as config groups
    (`gracecomm.configstore.register_configs`)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from gracecomm.configstore import register_configs
    register_configs()
    original = ConfigLoaderImpl.load_configuration
    if getattr(original, "guarded", False):  # already inside a guard
        yield
        return

    def load_configuration(self: Any, config_name: Any, overrides: list[str], *args: Any,
                           **kwargs: Any) -> Any:
        cfg = original(self, config_name, overrides, *args, **kwargs)
        try:
            check_composed(cfg, overrides)
        except ConfigError as err:  # Hydra prints this kind as its message alone
            raise RefusedConfig(str(err)) from None
        return cfg

    load_configuration.guarded = True  # type: ignore[attr-defined]
    ConfigLoaderImpl.load_configuration = load_configuration  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl.load_configuration = original  # type: ignore[method-assign]
