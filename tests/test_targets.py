"""A config is data, not code (issue 34): a ``_target_`` may name only registered parts, the
models, data sets, loggers and callbacks of the package's own configs and a listed set of
outside classes, by exact name; every ``_target_`` of the composed config, ``hydra.*``
included, is checked before anything runs, and ``allow_any_target`` comes only from the
person running the command. Every case here ran code before the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gracecomm import build
from gracecomm.config import check_targets, instantiate
from gracecomm.experiments.training.config import compose_config, validate
from gracecomm.validation import ConfigError
from tests.helpers import console_script, experiment_dir

ROOT = Path(__file__).resolve().parent.parent
HELPER = "gracecomm.experiments.cluster.topologies._run"  # runs its arguments as a command


def touch(marker: Path) -> list[str]:
    return ["touch", str(marker)]


def refused(fn, *words):
    with pytest.raises(ConfigError) as info:
        fn()
    for word in words:
        assert word in str(info.value), str(info.value)
    return str(info.value)


# -- package functions as targets ---------------------------------------------------------

def test_a_package_function_from_an_override_is_refused(tmp_path):
    marker = tmp_path / "MARKER"
    refused(lambda: validate(compose_config(f"compressor._target_={HELPER}",
                                            f"+compressor._args_=[touch,{marker}]")),
            HELPER, "may be instantiated")
    assert not marker.exists()


def test_a_package_function_nested_in_deepreduce_is_refused(tmp_path):
    marker = tmp_path / "MARKER"
    refused(lambda: validate(compose_config(
        "compressor=deepreduce", f"compressor.sparsifier._target_={HELPER}",
        f"+compressor.sparsifier._args_=[touch,{marker}]")), "compressor.sparsifier", HELPER)
    assert not marker.exists()


def test_a_package_function_from_a_config_dir_yaml_is_refused(tmp_path):
    marker = tmp_path / "MARKER"
    (tmp_path / "compressor").mkdir()
    (tmp_path / "compressor" / "evil.yaml").write_text(
        f"_target_: {HELPER}\n_args_: [touch, {marker}]\n")
    refused(lambda: validate(compose_config(f"hydra.searchpath=[file://{tmp_path}]",
                                            "compressor=evil")), HELPER)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["compressor", "memory", "communicator", "sparsifier",
                                   "compose"])
def test_a_package_function_through_build_is_refused(tmp_path, where):
    marker = tmp_path / "MARKER"
    spec = {"_target_": HELPER, "_args_": touch(marker)}
    call = {"compressor": lambda: build(spec),
            "memory": lambda: build("topk", memory=spec),
            "communicator": lambda: build("topk", communicator=spec),
            "sparsifier": lambda: build({"name": "deepreduce", "sparsifier": spec}),
            "compose": lambda: build({"name": "compose", "compressors": ["topk", spec]})}[where]
    refused(call, HELPER, "may be instantiated")
    assert not marker.exists()


def test_resolve_target_as_a_target_imports_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "MARKER"
    (tmp_path / "side_effect_module.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("gracecomm.config.resolve_target", "gracecomm.config.check_target"):
        refused(lambda n=name: build({"_target_": n, "target": "side_effect_module.x"}), name)
    assert not marker.exists()


def test_instantiate_and_a_loader_as_targets_load_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    (tmp_path / "evil.yaml").write_text(f"_target_: {HELPER}\n_args_: [touch, {marker}]\n")
    spec = {"_target_": "gracecomm.config.instantiate", "allow_any_target": True,
            "cfg": {"_target_": "gracecomm.experiments.training.config.part_config",
                    "group": f"../../../../../../../../{tmp_path}", "name": "evil"}}
    refused(lambda: build(spec), "gracecomm.config.instantiate")
    refused(lambda: instantiate(spec["cfg"]), "part_config")
    assert not marker.exists()


def test_part_config_stays_in_the_config_tree(tmp_path):
    from gracecomm.experiments.training.config import part_config
    (tmp_path / "evil.yaml").write_text("_target_: builtins.print\n")
    for group, name in ((f"../../../../../../../..{tmp_path}", "evil"), (str(tmp_path), "evil"),
                        ("memory", f"../../../../../../../..{tmp_path}/evil")):
        refused(lambda g=group, n=name: part_config(g, n), "config tree")


def test_an_object_target_from_python_is_judged_by_what_it_is(tmp_path):
    marker = tmp_path / "MARKER"
    refused(lambda: instantiate({"_target_": subprocess.run, "args": touch(marker)}),
            "subprocess.run")
    assert not marker.exists()
    from gracecomm.compressors.topk import TopK
    assert isinstance(instantiate({"_target_": TopK, "ratio": 0.1}), TopK)


def test_attribute_walks_and_outside_functions_stay_refused():
    for target in ("gracecomm.experiments.training.train.os.system", "torch.load", "builtins.eval",
                   "torch.nn.modules.module.torch.load", "functools.partial",
                   "torch.optim.sgd.torch.load", "hydra.utils.instantiate"):
        refused(lambda t=target: check_targets({"_target_": t}), target, "may be instantiated")


# -- hydra.* and the rest of the composed config ------------------------------------------

def test_a_hydra_callback_target_is_refused_at_composition():
    refused(lambda: compose_config("+hydra.callbacks.x._target_=builtins.print"),
            "hydra.callbacks.x", "builtins.print")


def test_hydra_launcher_and_sweeper_targets_are_checked():
    refused(lambda: compose_config(f"hydra.launcher._target_={HELPER}"), "hydra.launcher")
    refused(lambda: compose_config(f"hydra.sweeper._target_={HELPER}"), "hydra.sweeper")
    compose_config("hydra/launcher=joblib")  # an installed Hydra plugin is allowed


def test_logging_factories_from_a_config_are_refused(tmp_path):
    (tmp_path / "memory").mkdir()
    for i, node in enumerate(['formatters: {evil: {"()": ' + HELPER + ', command: "touch x"}}',
                              "handlers: {file: {class: " + HELPER + "}}",
                              "handlers: {console: {stream: ext://os.system}}"]):
        (tmp_path / "memory" / f"evil{i}.yaml").write_text(
            "# @package _global_\nmemory: {_target_: gracecomm.memories.none.NoneMemory}\n"
            f"hydra:\n  job_logging:\n    {node}\n")
        refused(lambda i=i: compose_config(f"hydra.searchpath=[file://{tmp_path}]",
                                           f"memory=evil{i}"), "hydra.job_logging")


@pytest.mark.parametrize("name", ["PYTHONPATH", "LD_PRELOAD", "PYTHONSTARTUP", "NUMBA_CACHE_DIR"])
def test_job_environment_that_loads_code_is_refused(name):
    refused(lambda: compose_config(f"+hydra.job.env_set.{name}=/tmp"), name, "env_set")


def test_job_environment_of_listed_variables_is_allowed():
    compose_config("+hydra.job.env_set.OMP_NUM_THREADS=1")


@pytest.mark.parametrize("how", ["up", "absolute", "sibling"])
def test_a_group_choice_that_leaves_the_config_tree_is_refused(tmp_path, how):
    marker = tmp_path / "MARKER"
    (tmp_path / "evil.yaml").write_text(f"_target_: {HELPER}\n_args_: [touch, {marker}]\n")
    group = ROOT / "configs" / "compressor"
    up = "../" * len(group.parts[1:]) + str(tmp_path)[1:] + "/evil"
    overrides = {"up": [f"compressor={up}"], "absolute": [f"compressor={tmp_path}/evil"],
                 "sibling": ["compressor=deepreduce", "compressor/sparsifier=../compose"]}[how]
    with pytest.raises(Exception) as info:  # noqa: PT011 - Hydra's own or ours
        validate(compose_config(*overrides))
    assert "leaves the config tree" in str(info.value) or "Could not find" in str(info.value), \
        str(info.value)
    if how != "absolute":  # Hydra finds the file: the choice must be refused by name
        assert "leaves the config tree" in str(info.value), str(info.value)
    assert not marker.exists()


# -- allow_any_target: the person running the command, never a file ------------------------

def test_allow_any_target_from_a_config_file_is_refused(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "open.yaml").write_text(
        "# @package _global_\nallow_any_target: true\n")
    refused(lambda: compose_config(f"hydra.searchpath=[file://{tmp_path}]", "+experiment=open"),
            "a config file sets allow_any_target", "command line")


def test_allow_any_target_from_a_sweeper_config_is_refused():
    from gracecomm.config import check_composed
    cfg = OmegaConf.create({"allow_any_target": False,
                            "hydra": {"sweeper": {"params": {"allow_any_target": "true"}}}})
    refused(lambda: check_composed(cfg, []), "allow_any_target", "command line")


def test_allow_any_target_on_the_command_line_opens_every_target():
    cfg = compose_config("allow_any_target=true")
    assert cfg.allow_any_target is True
    assert instantiate({"_target_": "collections.OrderedDict"},
                       allow_any_target=cfg.allow_any_target) == {}


def test_offered_and_outside_targets_instantiate():
    cfg = compose_config("compressor=deepreduce", "compressor/index=bloom")
    for group in ("compressor", "memory", "communicator", "model", "data"):
        instantiate(cfg[group])
    layer = instantiate({"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1})
    opt = instantiate({"_target_": "torch.optim.SGD", "params": layer.parameters(), "lr": 0.1})
    assert isinstance(layer, torch.nn.Linear) and isinstance(opt, torch.optim.SGD)
    # a registered class under the name it is defined at, and re-exported at
    instantiate({"_target_": "gracecomm.compressors.deepreduce.bloom.BloomIndex"})


def test_old_root_targets_keep_their_message():
    refused(lambda: check_targets({"_target_": "grace.compressors.topk.TopK"}),
            "gracecomm.compressors.topk.TopK", "import root gracecomm")


# -- the command line, end to end ---------------------------------------------------------

def cli(tmp_path, *args, options=(), timeout=240):
    return subprocess.run([sys.executable, "-m", "gracecomm.experiments.training", *options,
                           f"hydra.run.dir={tmp_path}/run", "trainer.progress=false",
                           "trainer.max_steps=1", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_the_issue_command_runs_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    proc = cli(tmp_path, f"compressor._target_={HELPER}", f"+compressor._args_=[touch,{marker}]")
    assert proc.returncode != 0 and "may be instantiated" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


@pytest.mark.slow
def test_a_hydra_callback_runs_nothing(tmp_path):
    proc = cli(tmp_path, "+hydra.callbacks.x._target_=builtins.print",
               "+hydra.callbacks.x._args_=[CALLBACK_RAN]")
    assert "CALLBACK_RAN" not in proc.stdout + proc.stderr
    assert proc.returncode != 0 and "hydra.callbacks.x" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["gracecomm-bench", "gracecomm-netbench",
                                     "gracecomm-gpucheck"])
def test_every_command_checks_what_it_composes(tmp_path, command):
    """Not only gracecomm-train: every console script runs its Hydra entry point inside
    `gracecomm.config.guarded`."""
    proc = console_script(command, tmp_path, "+hydra.callbacks.x._target_=builtins.print",
                          "+hydra.callbacks.x._args_=[CALLBACK_RAN]", timeout=120)
    assert "CALLBACK_RAN" not in proc.stdout + proc.stderr
    assert proc.returncode != 0 and "hydra.callbacks.x" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_config_dir_cannot_open_targets(tmp_path):
    marker = tmp_path / "MARKER"
    conf = experiment_dir(tmp_path, "open", f"allow_any_target: true\ncompressor:\n"
                          f"  _target_: {HELPER}\n  _args_: [touch, {marker}]\n")
    proc = cli(tmp_path, "+experiment=open", options=("--config-dir", str(conf)))
    assert proc.returncode != 0 and "a config file sets allow_any_target" in proc.stderr, \
        proc.stderr[-2000:]
    assert not marker.exists()
