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

A composed Hydra config holds more than the run's parts: `check_composed` checks it as
Hydra and the job will use it (`as_used`: every interpolation resolved, so a callback or a
logging handler built by ``${oc.decode:...}`` is checked like a written one): its
``hydra.*`` targets, the Optuna sweeper's function hook (``custom_search_space``), the
factories, streams and files of its logging configs (`check_logging`: a log file lies in
the run directory), the environment it sets for the job, every config group choice, and
the override lists it forwards to the commands it starts (`check_opt_in`).
`guard_composition` makes Hydra check each config it composes before it uses any of it
(callbacks, logging, launchers) and refuse a defaults entry outside the config tree before
reading it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any

from hydra.errors import CompactHydraException, HydraException

from gracecomm.validation import ConfigError, MissingDependencyError, error_line

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


def _registries_key() -> tuple[tuple[str, int], ...]:
    """Each family and its size, the built-in families loaded first: what the caches of
    `_registered_parts` and `_registered_names` are keyed by (a plugin may add entries)."""
    from gracecomm.registry import REGISTRIES, available
    for kind in ("compressor", "memory", "communicator"):
        available(kind)  # loads the built-in families (and the codec registries they add)
    return tuple((kind, len(available(kind))) for kind in sorted(REGISTRIES))


@functools.cache
def _parts_of_registries(key: tuple[tuple[str, int], ...]
                         ) -> dict[str, tuple[str, str, type]]:
    from gracecomm.registry import available, get
    return {dotted: (kind, name, get(kind, name)) for kind, _ in key
            for name in available(kind) for dotted in names_of(get(kind, name))}


@functools.cache
def _names_of_registries(key: tuple[tuple[str, int], ...]) -> frozenset[str]:
    return frozenset(_parts_of_registries(key))


def _registered_parts() -> dict[str, tuple[str, str, type]]:
    """Dotted name -> (kind, registry name, class) of every registered part."""
    return _parts_of_registries(_registries_key())


def _registered_names() -> frozenset[str]:
    """The dotted names of every registered part."""
    return _names_of_registries(_registries_key())


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
        ConfigError: a ``_target_`` is not allowed (module docstring), or a registered part
            is given an option its class does not take (`check_part_options`).

    Example:
        >>> instantiate({"_target_": "gracecomm.compressors.topk.TopK", "ratio": 0.01})
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    if not allow_any_target:
        check_targets(cfg)
    check_part_options(cfg)
    try:
        return hydra_instantiate(cfg, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ConfigError, MissingDependencyError)):  # ours say it all
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
    (the command line's), as Hydra and the job will use it (`as_used`: every interpolation
    resolved): every ``_target_`` (unless `opted_in`), Hydra's callbacks, launcher and
    sweeper (the Optuna sweeper's function hook ``custom_search_space`` included), the
    factories and files of its logging configs, the variables ``hydra.job.env_set`` sets,
    every config group choice, and that only `overrides` switch ``allow_any_target`` on,
    for this command or for the commands it starts (`check_opt_in`). Raises `ConfigError`
    naming the config path, what is wrong and what is allowed."""
    from omegaconf import DictConfig, OmegaConf
    given = _override_keys(overrides)
    opened = _true(given.get(OPT_IN))
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    used, unresolved = as_used(node)
    check_opt_in(used, given)
    choices = OmegaConf.select(node, "hydra.runtime.choices")
    for group, choice in (_plain(choices, resolve=False) or {}).items():
        if isinstance(choice, str) and _leaves_tree(choice):
            raise _choice_leaves_tree(group, choice)
    env = OmegaConf.select(node, "hydra.job.env_set")
    for name in (_plain(env, resolve=False) or {}):
        if name not in JOB_ENVIRONMENT:
            raise ConfigError(f"config 'hydra.job.env_set' sets the environment variable "
                              f"{name!r}, which a config may not set (it could make the run "
                              "load code from elsewhere); set it in the shell that runs the "
                              f"command. A config may set {', '.join(sorted(JOB_ENVIRONMENT))}")
    if opened:
        return
    for path, raw in unresolved.items():
        if path.endswith("._target_") or path == "_target_" or path.startswith(HYDRA_BUILDS):
            raise ConfigError(f"config '{path}' is {raw!r}, which cannot be resolved before "
                              "the run, so what it builds cannot be checked; give the value "
                              "itself (a registered part or a listed class by name)")
    for path, _, target in _nodes(used, ("_target_",)):
        check_target(target, path, hydra_plugins=path.startswith(("hydra.launcher",
                                                                   "hydra.sweeper")))
    hydra = used.get("hydra") if isinstance(used, Mapping) else None
    hydra = hydra if isinstance(hydra, Mapping) else {}
    output_dir = _output_dir(node)
    for section in ("job_logging", "hydra_logging"):
        check_logging(hydra.get(section), f"hydra.{section}", output_dir,
                      chdir=section == "job_logging" and _true(
                          (hydra.get("job") or {}).get("chdir")))
    subdir = hydra.get("output_subdir")
    if subdir is not None and not _inside(os.path.join(output_dir, str(subdir)), output_dir):
        raise ConfigError(f"config 'hydra.output_subdir' is {subdir!r}, outside the run "
                          f"directory ({output_dir}), where Hydra would write the composed "
                          "config; it must be a folder inside it (Hydra's default: .hydra)")
    sweeper = hydra.get("sweeper") or {}
    if sweeper.get("custom_search_space") is not None:
        raise ConfigError(
            "config 'hydra.sweeper.custom_search_space' names "
            f"{sweeper['custom_search_space']!r}, a function the Optuna sweeper would import "
            "and call with the config and every trial; a config may not name a function: "
            "describe the search space in hydra.sweeper.params, or give "
            f"{OPT_IN}=true on the command line to allow it")
    setup = (hydra.get("launcher") or {}).get("setup")
    if setup:
        raise ConfigError(f"config 'hydra.launcher.setup' holds shell commands ({setup}); "
                          f"give {OPT_IN}=true on the command line to run them")


# -- the config as Hydra will use it --------------------------------------------------------

# The parts of the ``hydra`` node that Hydra itself builds objects from: each must resolve
# before the run, so that the check sees what Hydra will build.
HYDRA_BUILDS = ("hydra.callbacks", "hydra.launcher", "hydra.sweeper", "hydra.job_logging",
                "hydra.hydra_logging")
MAX_CHECKED_NODES = 200_000  # a config that resolves to more is refused, not walked


def _leaves_tree(config_path: str) -> bool:
    """Whether a config group choice or defaults entry names a file outside the config
    tree (a ``..`` part, or a leading ``/``)."""
    return config_path.startswith("/") or ".." in config_path.split("/")


def _choice_leaves_tree(group: str, choice: str) -> ConfigError:
    return ConfigError(f"config group '{group}': choice {choice!r} leaves the config tree; a "
                       "choice is the name of a file in its group's folder (on the search "
                       "path), without '..' or a leading '/'")


def _inside(path: str, folder: str) -> bool:
    """Whether `path` (made absolute, ``..`` resolved) lies inside the absolute `folder`."""
    path = os.path.normpath(os.path.abspath(path))
    return path != folder and os.path.commonpath([path, folder]) == folder


def _output_dir(node: Any) -> str:
    """The job's output directory, as Hydra will set ``hydra.runtime.output_dir`` (an
    absolute path): ``hydra.run.dir``, or ``hydra.sweep.dir``/``hydra.sweep.subdir`` for a
    multirun's job."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf
    given = OmegaConf.select(node, "hydra.runtime.output_dir", default=None,
                             throw_on_missing=False)
    if isinstance(given, str):
        return os.path.abspath(given)
    try:
        if OmegaConf.select(node, "hydra.mode") == RunMode.MULTIRUN:
            out = os.path.join(str(OmegaConf.select(node, "hydra.sweep.dir")),
                               str(OmegaConf.select(node, "hydra.sweep.subdir")))
        else:
            out = str(OmegaConf.select(node, "hydra.run.dir"))
    except Exception:  # noqa: BLE001 - Hydra fails on it itself; judge against the cwd
        out = "."
    return os.path.abspath(out)


@contextlib.contextmanager
def _hydra_config_of(node: Any) -> Iterator[Any]:
    """A copy of the composed config `node` whose ``hydra`` node is what the job sees
    (``hydra.runtime.output_dir`` and, for a multirun, the job's number set), made
    `HydraConfig`'s while the block runs, so that ``${hydra:...}`` resolves as in the job."""
    import copy

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write
    node = copy.deepcopy(node)
    instance = HydraConfig.instance()
    saved = instance.cfg
    try:
        if OmegaConf.select(node, "hydra.runtime") is not None:
            output_dir = _output_dir(node)
            with read_write(node.hydra), open_dict(node.hydra):
                for key, value in (("job.num", 0), ("job.id", "0"),
                                   ("runtime.output_dir", output_dir)):
                    parent, _, leaf = key.rpartition(".")
                    if OmegaConf.is_missing(node.hydra[parent], leaf):
                        node.hydra[parent][leaf] = value
            with contextlib.suppress(Exception):  # not a Hydra-composed config
                instance.set_config(node)
        yield node
    finally:
        instance.cfg = saved


def as_used(cfg: Any) -> tuple[Any, dict[str, str]]:
    """A composed config as Hydra and the job will use it: a plain copy with every
    interpolation resolved (an interpolation may build a whole node: ``${oc.create:...}``,
    ``${oc.decode:...}``, a node reference, a callback of ``hydra.callbacks``), and the
    path and text of each interpolation that cannot be resolved before the run.

    Args:
        cfg: The composed config (a DictConfig, ``hydra`` node included, or a mapping).

    Returns:
        (the resolved plain config, {config path: interpolation text}).

    Raises:
        ConfigError: the config resolves to more than `MAX_CHECKED_NODES` nodes.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf
    unresolved: dict[str, str] = {}
    count = [0]

    def walk(node: Any, path: str) -> Any:
        count[0] += 1
        if count[0] > MAX_CHECKED_NODES:
            raise ConfigError(f"the config resolves to more than {MAX_CHECKED_NODES} "
                              "values; it is refused rather than checked")
        if isinstance(node, (dict, list, tuple)):  # a resolver's plain result: Hydra makes
            try:                                   # a config of it, resolving it again
                node = OmegaConf.create(node if isinstance(node, dict) else list(node))
            except Exception:  # noqa: BLE001 - not a config: kept as it is
                return node
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            items: Iterable[Any] = node.keys()
        elif isinstance(node, ListConfig) and not node._is_none() and not node._is_missing():
            items = range(len(node))
        else:
            return node
        out: Any = {} if isinstance(node, DictConfig) else []
        for key in items:
            where = (f"{path}[{key}]" if isinstance(node, ListConfig) else
                     f"{path}.{key}" if path else str(key))
            child = node._get_node(key)
            if child is not None and child._is_missing():
                value: Any = "???"
            else:
                try:
                    value = walk(node[key], where)
                except ConfigError:
                    raise
                except Exception:  # noqa: BLE001 - any failure: unresolvable before the run
                    unresolved[where] = str(child._value() if child is not None else "")
                    continue
            if isinstance(out, dict):
                out[key] = value
            else:
                out.append(value)
        return out

    with _hydra_config_of(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)) \
            as node:
        return walk(node, ""), unresolved


def _forwarded(value: str) -> bool:
    """Whether `value`, given as an override to another command, could switch
    ``allow_any_target`` on there (anything naming it but ``allow_any_target=false``)."""
    if OPT_IN not in value:
        return False
    try:
        keys = _override_keys([value])
    except Exception:  # noqa: BLE001 - not an override we can read: it may be one there
        return True
    return not (set(keys) == {OPT_IN} and keys[OPT_IN] in (False, "false"))


def check_opt_in(used: Any, given: Mapping[str, Any]) -> None:
    """Raise `ConfigError` unless ``allow_any_target`` comes only from the command line
    (`given`, its overrides by key): not from a config file's ``allow_any_target: true``, a
    sweeper's parameters, nor an override list the config forwards to the commands it
    starts (netbench's ``overrides``, gracecomm-bench's ``hook.overrides``), each resolved
    (`used`). A forwarded list may carry it where the command line gave that list."""
    opened = _true(given.get(OPT_IN))
    used = used if isinstance(used, Mapping) else {}
    if _true(used.get(OPT_IN, False)) and not opened:
        raise ConfigError(f"a config file sets {OPT_IN}: true; only the person running the "
                          f"command can allow any target: give {OPT_IN}=true on the command "
                          "line (or allow_any_target=True in Python)")
    params = ((used.get("hydra") or {}).get("sweeper") or {}).get("params")
    for key, value in (params or {}).items() if isinstance(params, Mapping) else ():
        name = f"hydra.sweeper.params.{key}"
        if (str(key).lstrip("+~") == OPT_IN or (isinstance(value, str) and OPT_IN in value)) \
                and OPT_IN not in given and name not in given:
            raise ConfigError(f"config '{name}' sweeps {OPT_IN}; only the person running "
                              f"the command can allow any target: give {OPT_IN}=true on "
                              "the command line")
    if opened:
        return
    job = {key: value for key, value in used.items() if key != "hydra"}
    for path, value in _strings(job, ""):
        if not _forwarded(value):
            continue
        where = path.lstrip(".")
        key = where[:where.rfind("[")] if where.endswith("]") else where
        from_command_line = given.get(key)
        if isinstance(from_command_line, list) and value in map(str, from_command_line):
            continue
        raise ConfigError(f"config '{where}' forwards {value!r} to the command it starts; "
                          "only the person running the command can allow any target: give "
                          f"the list on the command line ('{key}=[...,{OPT_IN}=true]')")


def check_logging(section: Any, path: str, output_dir: str, *, chdir: bool) -> None:
    """Raise `ConfigError` unless a resolved logging configuration (``hydra.job_logging``,
    ``hydra.hydra_logging`` at `path`) constructs only `LOGGING_TARGETS`, refers only to
    `LOGGING_EXTERNALS` and writes only files under the job's output directory
    `output_dir` (a relative file name is relative to it where the job changes into it,
    `chdir`, and to the working directory otherwise)."""
    if not isinstance(section, Mapping):
        return
    for where, _, value in _nodes(section, ("()", "class"), path):
        if not isinstance(value, str) or value not in LOGGING_TARGETS:
            raise ConfigError(f"config '{where}' names {value!r}, which the logging "
                              f"configuration may not construct; allowed: "
                              f"{', '.join(sorted(LOGGING_TARGETS))}")
    for where, value in _strings(section, path):
        if value.startswith("ext://") and value not in LOGGING_EXTERNALS:
            raise ConfigError(f"config '{where}' refers to {value!r}; the logging "
                              f"configuration may refer to {', '.join(LOGGING_EXTERNALS)}")
    for where, key, value in _nodes(section, ("filename",), path):
        if not _inside(os.path.join(output_dir if chdir else os.getcwd(), str(value)),
                       output_dir):
            raise ConfigError(
                f"config '{where}.{key}' is {value!r}, outside the run directory "
                f"({output_dir}); a log file of a config must be in the run directory: "
                "${hydra.runtime.output_dir}/NAME.log")


def _strings(node: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _strings(value, f"{path}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


class RefusedConfigError(ConfigError, CompactHydraException):
    """A composed config that `check_composed` refused (Hydra prints only its message)."""


def guarded(entry: Callable[[], Any]) -> Callable[[], Any]:
    """A command's Hydra entry point (a ``@hydra.main`` function), run inside
    `guard_composition`: what the console scripts call. A refused config ends the command
    with its one-line message on stderr and exit code 1, before any part of it is used.

    Args:
        entry: The ``@hydra.main`` function.

    Returns:
        The function to run as the command.
    """

    @functools.wraps(entry)
    def command() -> Any:
        with guard_composition(exit_on_refusal=True):
            return entry()

    return command


@contextlib.contextmanager
def guard_composition(*, exit_on_refusal: bool = False) -> Iterator[None]:
    """While the block runs, every config Hydra composes is checked (`check_composed`, with
    the overrides it was composed with, and no defaults entry may leave the config tree)
    before Hydra uses any part of it: its callbacks, logging configuration, launcher and
    sweeper, and the job. The commands run their Hydra entry point inside it
    (`guarded`), with `exit_on_refusal`: a refusal prints its one line and exits with code 1
    (rather than raise `RefusedConfigError`, which Hydra prints with a hint below it). It first
    offers the registered parts as config groups (`gracecomm.configstore.register_configs`)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from gracecomm.configstore import register_configs
    register_configs()
    original = ConfigLoaderImpl.load_configuration
    if getattr(original, "guarded", False):  # already inside a guard
        yield
        return

    def load_configuration(self: Any, config_name: Any, overrides: list[str], *args: Any,
                           **kwargs: Any) -> Any:
        def compose(given: list[str]) -> Any:
            with _defaults_in_tree():
                return original(self, config_name, given, *args, **kwargs)

        try:
            try:
                cfg = compose(overrides)
            except HydraException as err:
                raise explain_override_error(err, overrides, compose) from None
            check_composed(cfg, overrides)
            check_part_options(cfg)
        except ConfigError as err:
            if exit_on_refusal:
                print(error_line(err), file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            raise RefusedConfigError(str(err)) from None
        return cfg

    load_configuration.guarded = True  # type: ignore[attr-defined]
    ConfigLoaderImpl.load_configuration = load_configuration  # type: ignore[method-assign]
    try:
        with _store_shared_in_copies():
            yield
    finally:
        ConfigLoaderImpl.load_configuration = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _store_shared_in_copies() -> Iterator[None]:
    """While the block runs, a deep copy of Hydra's ConfigStore (where the registered parts'
    groups are) is the store itself, the one instance Hydra reads (``ConfigStore.instance``).
    Hydra deep-copies its config repository, store included, for every composition and for
    every config group ``--help`` lists (about 120 here), to keep the sources it sets up
    from the original; reading the store hands out copies of its nodes
    (``ConfigStore.load``), so one store serves every copy. Copying it each time made
    ``gracecomm-train --help`` take 3.7 s of CPU instead of 1.9 s."""
    from hydra.core.config_store import ConfigStore

    if "__deepcopy__" in vars(ConfigStore):  # a Hydra that decides its copies itself
        yield
        return
    ConfigStore.__deepcopy__ = lambda self, memo: self  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del ConfigStore.__deepcopy__  # type: ignore[attr-defined]


@contextlib.contextmanager
def _defaults_in_tree() -> Iterator[None]:
    """While the block runs, Hydra refuses to load a config that a defaults list names
    outside the config tree (``- ../../outside/file``: a ``..`` part or a leading ``/``),
    before reading it."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    original = ConfigLoaderImpl._load_single_config

    def load_single_config(self: Any, default: Any, repo: Any) -> Any:
        path = str(default.config_path)
        if _leaves_tree(path):
            parent = getattr(default, "parent", None) or "the primary config"
            raise ConfigError(f"config '{parent}': defaults entry {path!r} leaves the config "
                              "tree; a defaults entry names a file on the search path (a "
                              "group's folder and file name), without '..' or a leading '/'")
        return original(self, default, repo)

    ConfigLoaderImpl._load_single_config = load_single_config  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl._load_single_config = original  # type: ignore[method-assign]


# -- misspelt command lines -----------------------------------------------------------------

HYDRA_KEYS = frozenset({"_target_", "_args_", "_recursive_", "_convert_", "_partial_"})


def check_part_options(cfg: Any) -> None:
    """Raise `ConfigError` if a node of `cfg` (outside ``hydra``) that instantiates a
    registered part gives an option its class's constructor does not take
    (``+compressor.ratoi=0.1``), with `gracecomm.build`'s message
    (`gracecomm.registry.check_options`: the option, the close name, the class's options).
    A required option may be missing: it may be given when the node is instantiated."""
    import inspect

    from gracecomm.registry import check_options, options_of
    plain = _plain(cfg, resolve=False)
    if isinstance(plain, Mapping):
        plain = {key: value for key, value in plain.items() if key != "hydra"}
    parts: dict[str, tuple[str, str, type]] | None = None
    for node in _mappings(plain):
        target = node.get("_target_")
        if not isinstance(target, str):
            continue
        parts = _registered_parts() if parts is None else parts
        if target not in parts:
            continue
        kind, name, cls = parts[target]
        required = {option: None for option, param in (options_of(cls) or {}).items()
                    if param.default is inspect.Parameter.empty}
        given = {key: value for key, value in node.items() if key not in HYDRA_KEYS}
        check_options(cls, {**required, **given}, f"{kind} '{name}'")


def _mappings(node: Any) -> Iterator[Mapping[str, Any]]:
    """Every mapping in `node`, at any depth, `node` included."""
    if isinstance(node, Mapping):
        yield node
        for value in node.values():
            yield from _mappings(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _mappings(value)


def _listed(names: Iterable[str], limit: int = 30) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def explain_override_error(err: Exception, overrides: Sequence[str],
                           compose: Callable[[list[str]], Any]) -> ConfigError:
    """The one-line `ConfigError` for a command line Hydra could not compose (`err`): an
    unknown option (``compressor.ratoi=0.1``: the option, the close name and the options of
    its node, learnt by composing without it), an unknown config group choice
    (``compressor=topkk``: the close choice and the group's choices, ConfigStore-generated
    ones included), or Hydra's own message on one line.

    Args:
        err: What Hydra raised.
        overrides: The command line's overrides.
        compose: Composes the config with a list of overrides (the same config and mode).

    Returns:
        The error to raise.
    """
    import re

    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf import DictConfig, OmegaConf

    from gracecomm.registry import did_you_mean
    text = str(err)
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, choice = str(err.missing_cfg_file).rpartition("/")
        for override in overrides:  # the choice as given: ``compressor=/elsewhere/file``
            key, _, value = override.lstrip("+~").partition("=")
            if str(err.missing_cfg_file) == f"{key}/{value}":
                group, choice = key, value
        if _leaves_tree(choice):
            return _choice_leaves_tree(group, choice)
        options = sorted(err.options or [])
        if group and options:
            return ConfigError(f"unknown {group} {choice!r}."
                               f"{did_you_mean(choice, options)} Available: "
                               f"{_listed(options)}")
    if isinstance(err, OverrideParseException):
        return ConfigError(f"cannot read the override {err.override!r}: "
                           f"{' '.join(err.message.split())}")
    found = re.match(r"Could not override '([^']+)'", text) or \
        re.search(r"'([^']+)' does not exist", text)
    key = next((g for g in found.groups() if g), None) if found else None
    if key is not None:
        wrong = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == key]
        try:
            cfg = compose([o for o in overrides if o not in wrong])
        except HydraException as other:  # another misspelling: name that one
            return explain_override_error(other, [o for o in overrides if o not in wrong],
                                          compose)
        except ConfigError as other:
            return other
        node: Any = cfg
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(node, DictConfig):
                break
            names = [str(k) for k in node.keys() if k != "hydra" and str(k) not in HYDRA_KEYS]
            if part in node:
                node = node._get_node(part)
                continue
            where = ".".join(parts[:depth])
            unknown = ".".join(parts[:depth + 1])
            hint = did_you_mean(part, names)
            if hint and where:
                hint = hint.replace("'", f"'{where}.", 1)
            owner = f"Options of {where}" if where else "Options"
            if not where:
                groups = OmegaConf.select(cfg, "hydra.runtime.choices") or {}
                names += [g for g in groups if "/" not in str(g) and
                          not str(g).startswith("hydra") and g not in names]
                hint = did_you_mean(part, names)
            return ConfigError(f"unknown option {unknown!r}.{hint} {owner}: "
                               f"{_listed(names)}")
    first = " ".join(text.replace("Set the environment variable HYDRA_FULL_ERROR=1 for a "
                                  "complete stack trace.", "").split())
    return ConfigError(first or type(err).__name__)
