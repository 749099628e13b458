"""Every registry entry is a config group choice generated from its class
(`gracecomm.configstore`), every YAML file a part group keeps adds something to it, and
choosing a compressor picks the memory and communicator its class declares."""

import dataclasses

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from gracecomm import build, registry
from gracecomm.compressor import Capabilities
from gracecomm.config import instantiate
from gracecomm.configstore import entries, node_of, run_keys, yaml_names
from gracecomm.experiments.training.config import build_grace, validate
from gracecomm.validation import MissingDependencyError
from tests.helpers import CONFIG_DIR, compose_train

KINDS = ("compressor", "memory", "communicator")
GROUPS = ("compressor", "memory", "communicator", "model", "data", "trainer", "logger")


def group_files(group):
    """The choices of `group`: its YAML files and, for the parts' groups, the entries
    generated from the registry (the memory's and communicator's `auto` is not a part)."""
    generated = {name for g, name, _ in entries() if g == group}
    return sorted((set(yaml_names(group)) | generated) - {"auto"})


@pytest.mark.parametrize("kind", KINDS)
def test_every_registered_part_is_a_choice(kind):
    """A registered class is a choice of its group by name with no YAML file: the
    composed config instantiates that class."""
    names = registry.available(kind)
    assert names, f"no {kind} registered"
    assert names == group_files(kind)
    for name in names:
        cfg = compose_train(f"{kind}={name}")
        assert get_class(cfg[kind]._target_) is registry.get(kind, name), f"{kind}={name}"


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
    except MissingDependencyError as err:
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
    except MissingDependencyError as err:
        pytest.skip(str(err))
    assert obj is not None


@pytest.mark.parametrize("name", group_files("experiment"))
def test_every_experiment_composes_and_instantiates(name):
    cfg = compose_train(f"+experiment={name}")
    for group in ("compressor", "memory", "communicator", "model", "data"):
        try:
            instantiate(cfg[group])
        except MissingDependencyError as err:
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


@pytest.mark.parametrize("group,name,cls", sorted(
    (e for e in entries() if e[1] not in yaml_names(e[0])), key=lambda e: e[:2]),
    ids=lambda e: e if isinstance(e, str) else "")
def test_generated_entry_is_the_python_default(group, name, cls):
    """``compressor=x`` on the command line and ``build("x")`` in Python run the same method:
    the generated entry, composed with the default training config, holds the class's
    defaults. Options that follow the trainer (``trainer.lr``) are exempt; one whose Python
    default is None and that is given as a mapping is the class's ``<OPTION>_DEFAULTS``."""
    nested = ["compressor=deepreduce"] if group not in KINDS else []  # DeepReduce's groups
    cfg = compose_train(*nested, f"{group}={name}")
    node = OmegaConf.select(cfg, group.replace("/", "."))
    assert get_class(node._target_) is cls
    resolved = OmegaConf.to_container(node, resolve=True)
    links = run_keys(cls)
    for option, param in registry.options_of(cls).items():
        if links.get(option, "").startswith("trainer."):
            continue
        value, default = resolved[option], param.default
        if default is None and isinstance(value, dict):
            continue
        assert value == (list(default) if isinstance(default, tuple) else default), (
            f"{group}={name}: option '{option}' composes to {value!r}, the class's default "
            f"is {default!r}")


def kept_part_files():
    """Every YAML file the parts' groups keep (the generated entries replace the rest)."""
    for group in (*KINDS, "compressor/sparsifier", "compressor/index", "compressor/value"):
        for name in yaml_names(group):
            yield group, name


@pytest.mark.parametrize("group,name", sorted(kept_part_files()))
def test_a_kept_part_file_adds_something(group, name):
    """A YAML file in a part group is worth keeping only if it says what the class cannot:
    a choice that is no registered class (``auto``, DeepReduce's ``none``), a nested
    defaults list, or an option whose value is not the generated one."""
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{name}.yaml"),
                                 resolve=False)
    offered = {n: cls for g, n, cls in entries() if g == group}
    if name not in offered or "defaults" in raw:
        return
    generated = node_of(offered[name])
    assert {k: v for k, v in raw.items() if k != "_target_"} != {
        k: generated.get(k) for k in raw if k != "_target_"}, (
        f"configs/{group}/{name}.yaml restates the defaults its class gives; delete it")


def test_dgc_samples_one_percent_of_the_gradient_as_the_paper():
    """Lin et al., "Deep Gradient Compression" (ICLR 2018), Sec. 3: the threshold is found by
    top-k selection on a sample of 0.1% to 1% of the gradient; DGC and its reference preset
    sample the upper end, 1%, from the command line as from Python."""
    for name in ("dgc", "dgc_reference"):
        assert registry.create("compressor", name).sample_ratio == 0.01
        assert instantiate(compose_train(f"compressor={name}").compressor).sample_ratio == 0.01
