"""Every method trains from its name alone: the trainer options a compressor declares
(`Compressor.training_defaults`) apply where the command line set nothing, whichever way the
method is chosen (``compressor=``, ``+method=``, an experiment's sweep); and every sparsifier,
and every method built on one, keeps one default ratio, written once in Python."""

from __future__ import annotations

import inspect
import re
from types import MappingProxyType

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from gracecomm import registry
from gracecomm.compressors.compose import Compose
from gracecomm.compressors.deepreduce import DeepReduce
from gracecomm.compressors.topk import TopK
from gracecomm.config import instantiate
from gracecomm.configstore import node_of
from gracecomm.experiments import presets
from gracecomm.experiments.method_defaults import RECORD_KEY, apply_method_defaults, given_keys
from gracecomm.sparse import DEFAULT_RATIO
from gracecomm.validation import ConfigError
from tests.helpers import CONFIG_DIR, compose_train
from tests.test_experiment_configs import jobs

COMPRESSORS = registry.available("compressor")
PRESETS = presets.available()


def resolved(*overrides: str):
    """The config a run of ``gracecomm-train OVERRIDES`` trains with."""
    cfg = compose_train(*overrides)
    apply_method_defaults(cfg, given_keys(overrides))
    return cfg


def declared(name: str) -> dict:
    return dict(registry.get("compressor", name).training_defaults)


def test_some_methods_declare_training_defaults():
    assert declared("signsgd") == {"lr": 0.0005} and declared("signum") == {"lr": 0.001}
    assert declared("randomk") == {"momentum": 0.0}
    assert declared("topk") == {}


@pytest.mark.parametrize("name", COMPRESSORS)
def test_compressor_name_alone_applies_them_and_records_them(name):
    cfg = resolved(f"compressor={name}")
    defaults = instantiate(cfg.compressor).training_defaults
    base = compose_train()
    for option in ("lr", "momentum", "weight_decay"):
        assert cfg.trainer[option] == defaults.get(option, base.trainer[option]), option
    assert dict(cfg[RECORD_KEY]) == {f"trainer.{k}": v for k, v in defaults.items()}


def test_command_line_wins_and_the_run_says_so():
    cfg = compose_train("compressor=signsgd", "trainer.lr=0.01")
    lines = apply_method_defaults(cfg, given_keys(["compressor=signsgd", "trainer.lr=0.01"]))
    assert cfg.trainer.lr == 0.01 and dict(cfg[RECORD_KEY]) == {}
    assert lines == ["signsgd: trainer.lr=0.01 (given; the method's default is 0.0005)"]
    cfg = compose_train("compressor=signsgd")
    assert apply_method_defaults(cfg, set()) == ["signsgd: trainer.lr=0.0005 (method default)"]


def test_memory_reading_the_trainer_follows_the_default():
    """efsignsgd's memory reads ``${trainer.lr}``; DGC's reads ``${trainer.momentum}``."""
    cfg = resolved("compressor=efsignsgd", "trainer.lr=0.02")
    assert instantiate(cfg.memory).gamma == 0.02
    cfg = resolved("compressor=deepreduce", "compressor/sparsifier=randomk", "memory=dgc")
    assert cfg.trainer.momentum == 0.0 and instantiate(cfg.memory).momentum == 0.0


def test_wrappers_take_their_parts_defaults():
    assert DeepReduce(sparsifier="randomk").training_defaults == declared("randomk")
    assert Compose(["randomk", "natural"]).training_defaults == declared("randomk")
    assert DeepReduce(sparsifier="randomk").sensitivities == registry.get(
        "compressor", "randomk").sensitivities


class _Fast(TopK):
    training_defaults = MappingProxyType({"lr": 0.5})


class _Slow(_Fast):
    training_defaults = MappingProxyType({"lr": 0.001})


def test_conflicting_and_unknown_defaults_are_refused():
    wrapper = Compose(["topk", "natural"])
    with pytest.raises(ConfigError, match="different values of trainer option 'lr'"):
        wrapper.adopt_training_needs([_Fast(), _Slow()])
    cfg = compose_train()
    wrong = _Fast()
    wrong.training_defaults = MappingProxyType({"learning_rate": 0.1})
    with pytest.raises(ConfigError, match="'trainer.learning_rate', which is not a trainer option"):
        apply_method_defaults(cfg, set(), wrong)


@pytest.mark.slow  # composes every preset and experiment: seconds
def test_presets_and_experiments_do_not_restate_them():
    """One declaration: no preset sets a trainer option its compressor declares, and no
    config reads a preset's copy of one (the former ``method.lr``)."""
    for preset in PRESETS:
        path = CONFIG_DIR / "method" / f"{preset}.yaml"
        raw = OmegaConf.load(path) if path.exists() else {}  # generated: no trainer options
        compressor = instantiate(compose_train(f"+method={preset}").compressor)
        restated = set(raw.get("trainer", {})) & set(compressor.training_defaults)
        assert not restated, f"configs/method/{preset}.yaml restates {restated}"
    for path in CONFIG_DIR.rglob("*.yaml"):
        assert "method.lr" not in path.read_text(), path


@pytest.mark.slow  # composes every job of a sweep: seconds
@pytest.mark.parametrize("experiment", ["grace_benchmark", "deepreduce", "natural"])
def test_experiments_get_the_method_defaults_over_their_recipe(experiment):
    for job in jobs(experiment):
        cfg = resolved(*job)
        compressor = instantiate(cfg.compressor)
        for option, value in compressor.training_defaults.items():
            assert cfg.trainer[option] == value, (job, option)
        if not compressor.training_defaults:
            assert cfg.trainer.lr == compose_train(*job).trainer.lr, job
    paper = resolved("+method=signsgd", "+experiment=grace_benchmark", "experiment.scale=paper")
    assert paper.trainer.lr == 0.0005 and paper.trainer.epochs == 160
    assert resolved("+method=dense", "+experiment=grace_benchmark",
                    "experiment.scale=paper").trainer.lr == 0.1


def _ratio_classes() -> dict[str, type]:
    return {n: registry.get("compressor", n) for n in COMPRESSORS
            if "ratio" in inspect.signature(registry.get("compressor", n)).parameters}


def test_one_default_ratio_written_once():
    """Every sparsifier's ratio defaults to `DEFAULT_RATIO`; its generated config follows an
    experiment's ``experiment.ratio`` and falls back to that default; no config file writes
    a fallback of its own, and compose's Top-k stage takes the class's."""
    classes = _ratio_classes()
    assert {"topk", "randomk", "dgc", "dgc_reference", "sidco", "redsync", "gaussiank",
            "lgc_ps", "lgc_rar"} <= set(classes)
    for name, cls in classes.items():
        assert inspect.signature(cls).parameters["ratio"].default == DEFAULT_RATIO, name
        assert node_of(cls)["ratio"] == f"${{oc.select:experiment.ratio,{DEFAULT_RATIO}}}"
        assert compose_train(f"compressor={name}").compressor.ratio == DEFAULT_RATIO, name
        assert compose_train(f"compressor={name}", "+experiment.ratio=0.2").compressor.ratio \
            == 0.2, name
    assert instantiate(compose_train("compressor=compose").compressor).stages[0].ratio \
        == DEFAULT_RATIO
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        assert not re.findall(r"experiment\.ratio,\s*[0-9.]", path.read_text()), path


@pytest.mark.parametrize("sparsifier", ["topk", "randomk", "dgc", "sidco", "redsync",
                                        "gaussiank", "threshold"])
def test_deepreduce_over_any_sparsifier_keeps_its_ratio(sparsifier):
    cfg = compose_train("compressor=deepreduce", f"compressor/sparsifier={sparsifier}")
    assert cfg.compressor.sparsifier.get("ratio", DEFAULT_RATIO) == DEFAULT_RATIO


def test_a_sweep_of_sparsifiers_compares_one_density():
    names = ["topk", "randomk", "dgc", "sidco", "redsync", "gaussiank"]
    for name in names:
        cfg = compose_train(f"compressor={name}")
        assert instantiate(cfg.compressor).ratio == DEFAULT_RATIO, name
        assert get_class(cfg.compressor._target_) is registry.get("compressor", name)
