"""Every registry entry has a YAML file, every YAML file is registered or instantiable,
and choosing a compressor picks the memory and communicator its class declares."""

from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from grace import registry
from grace.config import instantiate
from grace.validation import MissingDependency
from tests.helpers import CONFIG_DIR, compose_train

KINDS = ("compressor", "memory", "communicator")
GROUPS = ("compressor", "memory", "communicator", "model", "data", "trainer", "logger")


def group_files(group):
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


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


@pytest.mark.parametrize("name", registry.available("compressor"))
def test_compressor_brings_its_memory_and_communicator(name):
    cfg = compose_train(f"compressor={name}")
    cls = registry.get("compressor", name)
    assert get_class(cfg.communicator._target_) is registry.get("communicator", cls.default_communicator)
    assert get_class(cfg.memory._target_) is registry.get("memory", cls.default_memory)


def test_user_choice_wins_over_compressor_default():
    cfg = compose_train("compressor=topk", "communicator=broadcast", "memory=none")
    assert cfg.communicator._target_.endswith("Broadcast")
    assert cfg.memory._target_.endswith("NoneMemory")


@pytest.mark.parametrize("group,name", [(g, n) for g in GROUPS if g != "logger"
                                        for n in group_files(g)])
def test_every_group_yaml_composes_and_instantiates(group, name):
    cfg = compose_train(f"{group}={name}")
    node = cfg[group]
    if "_target_" not in node:
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
    with pytest.raises(registry.ConfigError, match="outside the allowed modules"):
        instantiate({"_target_": "os.system", "command": "true"})
    with pytest.raises(registry.ConfigError, match="compressor.inner"):
        instantiate({"compressor": {"inner": {"_target_": "subprocess.run"}}})
