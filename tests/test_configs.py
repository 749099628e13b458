"""Every registry entry has a YAML file, every YAML file is registered or instantiable,
and choosing a compressor picks the memory and communicator its class declares."""

import dataclasses
import inspect

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from gracecomm import build, registry
from gracecomm.compressor import Capabilities
from gracecomm.config import instantiate
from gracecomm.experiments.training.config import build_grace, validate
from gracecomm.validation import MissingDependency
from tests.helpers import CONFIG_DIR, compose_train

KINDS = ("compressor", "memory", "communicator")
GROUPS = ("compressor", "memory", "communicator", "model", "data", "trainer", "logger")


def group_files(group):
    """The part configs of `group` (the memory's and communicator's `auto` is not a part)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml") if p.stem != "auto")


@pytest.mark.parametrize("kind", KINDS)
def test_registry_and_yaml_in_step(kind):
    names = registry.available(kind)
    assert names, f"no {kind} registered"
    assert names == group_files(kind), (
        f"configs/{kind}/ and the {kind} registry differ: only in registry "
        f"{sorted(set(names) - set(group_files(kind)))}, only in YAML "
        f"{sorted(set(group_files(kind)) - set(names))}")
    for name in names:
        target = OmegaConf.load(CONFIG_DIR / kind / f"{name}.yaml")["_target_"]
        assert get_class(target) is registry.get(kind, name), f"configs/{kind}/{name}.yaml"


def parts_of(pipeline):
    return type(pipeline.memory), type(pipeline.communicator)


@pytest.mark.parametrize("name", registry.available("compressor"))
def test_compressor_brings_its_memory_and_communicator(name):
    """By name alone, the command line and `gracecomm.build` bring the same parts, those the
    compressor declares."""
    cfg = compose_train(f"compressor={name}")
    required = any(p.default is p.empty for p in registry.options_of(registry.get(
        "compressor", name)).values())  # compose: its stages, given as in its YAML file
    try:
        pipeline = build(OmegaConf.to_container(cfg.compressor, resolve=True) if required
                         else name)
    except MissingDependency as err:
        pytest.skip(str(err))
    caps = pipeline.compressor.capabilities()
    brought = (registry.get("memory", caps.default_memory),
               registry.get("communicator", caps.default_communicator))
    assert parts_of(pipeline) == brought
    assert parts_of(build_grace(cfg)) == brought
    # capabilities have one source: no instance shadows its class's declarations
    declared = {field.name for field in dataclasses.fields(Capabilities)}
    assert declared.isdisjoint(vars(pipeline.compressor)), name


# options that change what a compressor brings: the command line and Python must agree
OPTION_DEPENDENT = [
    ({"name": "natural", "rounding": "deterministic"},
     ["compressor=natural", "compressor.rounding=deterministic"], ("residual", "allgather")),
    ({"name": "natural", "wire": "int_fixed"},
     ["compressor=natural", "compressor.wire=int_fixed"], ("none", "allreduce")),
    ({"name": "deepreduce", "sparsifier": "dgc"},
     ["compressor=deepreduce", "compressor/sparsifier=dgc"], ("dgc", "allgather")),
    ({"name": "compose", "compressors": ["randomk", "fp16"]},
     ["compressor=compose", "compressor.compressors=[{_target_: "
      "gracecomm.compressors.randomk.RandomK}, {_target_: gracecomm.compressors.cast.FP16}]"],
     ("residual", "allreduce")),
]


@pytest.mark.parametrize("spec,overrides,brought", OPTION_DEPENDENT)
def test_command_line_and_python_bring_the_same_parts(spec, overrides, brought):
    memory, communicator = brought
    want = (registry.get("memory", memory), registry.get("communicator", communicator))
    assert parts_of(build(spec)) == want
    assert parts_of(build_grace(compose_train(*overrides))) == want


def test_options_of_a_brought_part_take_a_plus():
    cfg = compose_train("compressor=dgc", "+memory.clip_norm=5.0")
    assert cfg.memory.clip_norm == 5.0 and cfg.memory.momentum == cfg.trainer.momentum
    with pytest.raises(registry.ConfigError, match=r"memory 'residual' \(brought by "
                       r"compressor 'topk' as memory=auto\): unknown option 'betaa'. "
                       r"Did you mean 'beta'\?"):
        compose_train("compressor=topk", "+memory.betaa=0.5")


@pytest.mark.parametrize("group", ("memory", "communicator"))
def test_auto_is_the_part_the_compressor_brings(group):
    """`auto`, the default of both groups, is a flag, and a run with it gets the part the
    compressor declares (which may depend on its options), as `gracecomm.build` does."""
    assert OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / "auto.yaml")) == {
        "auto": True}
    for overrides in (["compressor=topk"], ["compressor=natural"], ["compressor=powersgd"],
                      ["compressor=natural", "compressor.wire=int_fixed"]):
        caps = build_grace(compose_train(*overrides)).compressor.capabilities()
        pipeline = build_grace(compose_train(*overrides, f"{group}=auto"))
        assert type(getattr(pipeline, group)) is registry.get(
            group, getattr(caps, f"default_{group}")), overrides


def test_user_choice_wins_over_compressor_default():
    cfg = compose_train("compressor=topk", "communicator=broadcast", "memory=none")
    assert cfg.communicator._target_.endswith("Broadcast")
    assert cfg.memory._target_.endswith("NoneMemory")


@pytest.mark.parametrize("group,name", [(g, n) for g in GROUPS if g != "logger"
                                        for n in group_files(g)])
def test_every_group_yaml_composes_and_instantiates(group, name):
    cfg = compose_train(f"{group}={name}")
    node = cfg[group]
    if "_target_" not in node:  # plain settings: the trainer's, checked as a run checks them
        assert group == "trainer", f"configs/{group}/{name}.yaml has no _target_"
        validate(cfg)
        return
    try:
        obj = instantiate(node)
    except MissingDependency as err:
        pytest.skip(str(err))
    assert obj is not None


@pytest.mark.parametrize("name", group_files("experiment"))
def test_every_experiment_composes_and_instantiates(name):
    cfg = compose_train(f"+experiment={name}")
    for group in ("compressor", "memory", "communicator", "model", "data"):
        try:
            instantiate(cfg[group])
        except MissingDependency as err:
            pytest.skip(str(err))


def test_loggers_instantiate(tmp_path):
    cfg = compose_train("logger=jsonl")
    logger = instantiate(cfg.logger, run_dir=str(tmp_path), run_config={"a": 1},
                         _recursive_=False, _convert_="all")
    logger.log({"type": "step", "step": 1, "wire_bytes": 10.0})
    logger.finish({"test_acc": 0.5})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and '"wire_bytes": 10.0' in lines[1]


def test_unlisted_target_is_refused():
    with pytest.raises(registry.ConfigError, match="not a registered part"):
        instantiate({"_target_": "os.system", "command": "true"})
    with pytest.raises(registry.ConfigError, match="compressor.inner"):
        instantiate({"compressor": {"inner": {"_target_": "subprocess.run"}}})


def part_files():
    """Every part config with a class: the three groups and DeepReduce's nested ones."""
    for group in KINDS:  # (the memory's and communicator's `auto` is not a part)
        yield from (p for p in (CONFIG_DIR / group).glob("*.yaml") if p.stem != "auto")
    yield from (p for p in (CONFIG_DIR / "compressor").glob("*/*.yaml")
                if "_target_" in OmegaConf.load(p))


@pytest.mark.parametrize("path", sorted(part_files()), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_yaml_options_are_the_python_defaults(path):
    """A part's YAML file states its class's defaults, so that `compressor=x` on the command
    line and ``build("x")`` in Python run the same method. Values that interpolate the run
    (``${seed}``, ``${trainer.lr}``) and options without a default are exempt; an option whose
    Python default is None stands for the class's (or module's) ``<OPTION>_DEFAULTS``."""
    node = OmegaConf.load(path)
    cls = get_class(node._target_)
    params = registry.options_of(cls)
    raw = OmegaConf.to_container(node, resolve=False)
    for entry in raw.pop("defaults", []):  # nested parts chosen by name (DeepReduce's)
        raw.update(entry)
    for key, value in raw.items():
        if key == "_target_" or (isinstance(value, str) and "${" in value):
            continue
        assert key in params, f"{path}: '{key}' is not an option of {cls.__qualname__}"
        default = params[key].default
        if default is params[key].empty:
            continue
        if default is None and isinstance(value, dict):
            name = f"{key.upper()}_DEFAULTS"
            default = getattr(cls, name, getattr(inspect.getmodule(cls), name, None))
            assert default is not None, f"{path}: '{key}' defaults to None in Python and " \
                                        f"{cls.__qualname__} has no {name} to compare with"
        if isinstance(default, tuple):
            default = list(default)
        assert value == default, (f"{path}: option '{key}' is {value!r} in YAML but "
                                  f"{default!r} in {cls.__qualname__}")
