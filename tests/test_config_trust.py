"""A config is data, not code, as Hydra will use it (issues 41 and 44): the check sees the
composed config resolved (interpolations that build a callback, a logging handler or a
forwarded ``allow_any_target``), the Optuna sweeper's function hook, the files a config
loads and the files its logging writes. Every case here ran code, opened a socket, read a
file from outside the config tree or wrote outside the run directory before the fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gracecomm.config import check_composed
from gracecomm.experiments.training.config import compose_config
from gracecomm.validation import ConfigError
from tests.helpers import console_script, experiment_dir

HELPER = "gracecomm.experiments.cluster.topologies._run"  # runs its arguments as a command


def refused(fn, *words):
    with pytest.raises(ConfigError) as info:
        fn()
    message = str(info.value)
    for word in words:
        assert word in message, message
    assert "\n" not in message, message
    return message


def global_file(tmp_path: Path, text: str, name: str = "evil") -> list[str]:
    """Overrides that compose the training config with `text` (a ``_global_`` YAML file of
    group ``memory``) from a directory on the search path."""
    (tmp_path / "memory").mkdir(exist_ok=True)
    (tmp_path / "memory" / f"{name}.yaml").write_text(
        "# @package _global_\nmemory: {_target_: gracecomm.memories.none.NoneMemory}\n" + text)
    return [f"hydra.searchpath=[file://{tmp_path}]", f"memory={name}"]


# -- hydra.callbacks built by an interpolation ------------------------------------------------

CALLBACKS = {
    "decode": "x: \"${oc.decode:'{_target_: builtins.print, _args_: [RAN]}'}\"\n",
    "decode_hidden": "x: ${oc.decode:${hidden}}\n",
    "create_quoted": "x: \"${oc.create:'{_target_: builtins.print, _args_: [RAN]}'}\"\n",
    "create": "x: \"${oc.create:{_target_: builtins.print, _args_: [RAN]}}\"\n",
    "nested": "x: {_target_: \"${oc.decode:'builtins.print'}\"}\n",
}


@pytest.mark.parametrize("how", sorted(CALLBACKS))
def test_a_callback_built_by_an_interpolation_is_refused(tmp_path, how):
    text = ("hidden: '{_target_: builtins.print, _args_: [RAN]}'\n"
            "hydra:\n  callbacks:\n    " + CALLBACKS[how])
    refused(lambda: compose_config(*global_file(tmp_path, text)), "hydra.callbacks.x",
            "builtins.print")


def test_a_callback_that_cannot_be_resolved_before_the_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("GRACECOMM_UNSET", raising=False)
    text = "hydra:\n  callbacks:\n    x: ${oc.decode:${oc.env:GRACECOMM_UNSET}}\n"
    refused(lambda: compose_config(*global_file(tmp_path, text)), "hydra.callbacks.x",
            "resolved")


def test_the_package_callbacks_and_interpolations_still_compose():
    cfg = compose_config("trainer.max_steps=1")
    assert cfg.trainer.max_steps == 1


# -- the Optuna sweeper's function hook -------------------------------------------------------

def test_optuna_custom_search_space_is_refused():
    refused(lambda: compose_config("hydra/sweeper=optuna",
                                   f"+hydra.sweeper.custom_search_space={HELPER}"),
            "hydra.sweeper.custom_search_space", HELPER, "allow_any_target=true")


def test_optuna_custom_search_space_from_an_interpolation_is_refused(tmp_path):
    text = (f"hidden: {HELPER}\nhydra:\n  sweeper:\n    custom_search_space: ${{hidden}}\n")
    refused(lambda: compose_config("hydra/sweeper=optuna", *global_file(tmp_path, text)),
            "hydra.sweeper.custom_search_space")


def test_optuna_sweeper_without_the_hook_composes():
    compose_config("hydra/sweeper=optuna")


def test_optuna_custom_search_space_opens_with_the_command_line_opt_in():
    compose_config("hydra/sweeper=optuna", f"+hydra.sweeper.custom_search_space={HELPER}",
                   "allow_any_target=true")


# -- allow_any_target forwarded by a config file ----------------------------------------------

FORWARDED = {
    "netbench": {"overrides": ["model=resnet20", "allow_any_target=true",
                               f"compressor._target_={HELPER}"]},
    "bench": {"hook": {"overrides": ["model=resnet20", "+allow_any_target=true",
                                     f"compressor._target_={HELPER}"]}},
    "interpolated": {"flag": "true",
                     "overrides": ["model=resnet20", "allow_any_target=${flag}"]},
}


@pytest.mark.parametrize("where", sorted(FORWARDED))
def test_allow_any_target_forwarded_from_a_config_file_is_refused(where):
    cfg = OmegaConf.create(FORWARDED[where])
    refused(lambda: check_composed(cfg, []), "allow_any_target", "command line")


def test_allow_any_target_forwarded_from_the_command_line_is_allowed():
    check_composed(OmegaConf.create(FORWARDED["netbench"]),
                   ["overrides=['model=resnet20','allow_any_target=true']"])
    check_composed(OmegaConf.create(FORWARDED["bench"]),
                   ["+hook.overrides=['model=resnet20','+allow_any_target=true']"])
    # the command line giving some other list does not open the file's
    refused(lambda: check_composed(OmegaConf.create(FORWARDED["bench"]),
                                   ["overrides=['allow_any_target=true']"]), "hook.overrides")


def test_allow_any_target_false_may_be_forwarded():
    check_composed(OmegaConf.create({"overrides": ["allow_any_target=false"]}), [])


def test_sweeper_params_that_forward_allow_any_target_are_refused():
    cfg = OmegaConf.create({"hydra": {"sweeper": {"params": {
        "overrides": "[allow_any_target=true],[model=resnet20]"}}}})
    refused(lambda: check_composed(cfg, []), "hydra.sweeper.params", "allow_any_target")


# -- logging configs, resolved ------------------------------------------------------------------

SOCKET = "{class: logging.handlers.SocketHandler, host: 127.0.0.1, port: 9}"
HANDLERS = {
    "create": f"sock: \"${{oc.create:{SOCKET}}}\"",
    "decode_hidden": "sock: ${oc.decode:${hidden}}",
    "node": "sock: ${hidden_node}",
    "class": "sock: {class: \"${oc.decode:'logging.handlers.SocketHandler'}\", host: x, port: 9}",
    "class_node": "sock: {class: {SocketHandler: 1}, host: x, port: 9}",
}


def refused_handler(tmp_path: Path, section: str, handler: str, *words: str,
                    top: str = "") -> None:
    """A config file whose ``hydra.SECTION.handlers`` holds `handler` (YAML lines, indented
    for it), with `top` (YAML) at its top level, is refused, naming the section and `words`."""
    text = f"{top}hydra:\n  {section}:\n    handlers:\n      {handler}\n"
    refused(lambda: compose_config(*global_file(tmp_path, text)), f"hydra.{section}", *words)


@pytest.mark.parametrize("how", sorted(HANDLERS))
@pytest.mark.parametrize("section", ["job_logging", "hydra_logging"])
def test_a_logging_handler_hidden_in_an_interpolation_is_refused(tmp_path, how, section):
    refused_handler(tmp_path, section, HANDLERS[how], "SocketHandler", "logging.FileHandler",
                    top=f"hidden: '{SOCKET}'\nhidden_node: {SOCKET}\n")


def test_a_logging_external_hidden_in_an_interpolation_is_refused(tmp_path):
    refused_handler(tmp_path, "job_logging",
                    "console:\n        stream: \"${oc.decode:'ext://os.system'}\"",
                    "ext://os.system")


# -- files outside the config tree and the run directory --------------------------------------

def test_a_defaults_entry_outside_the_config_tree_is_refused(tmp_path):
    conf, outside = tmp_path / "a" / "conf", tmp_path / "a" / "outside"  # memory/../..
    (conf / "memory").mkdir(parents=True)
    outside.mkdir()
    (outside / "evil_outside.yaml").write_text(f"compressor:\n  _target_: {HELPER}\n")
    (conf / "memory" / "evil.yaml").write_text(
        "# @package _global_\ndefaults:\n  - ../../outside/evil_outside\n"
        "memory: {_target_: gracecomm.memories.none.NoneMemory}\n")
    refused(lambda: compose_config(f"hydra.searchpath=[file://{conf}]", "memory=evil"),
            "../../outside/evil_outside", "config tree")


FILES = {
    "absolute": "/tmp/gracecomm_evil.log",
    "up": "${hydra.runtime.output_dir}/../../gracecomm_evil.log",
    "relative": "gracecomm_evil.log",
    "hidden": "${oc.decode:${hidden}}",
}


@pytest.mark.parametrize("where", sorted(FILES))
@pytest.mark.parametrize("section", ["job_logging", "hydra_logging"])
def test_a_log_file_outside_the_run_directory_is_refused(tmp_path, where, section):
    refused_handler(tmp_path, section,
                    "file:\n        class: logging.FileHandler\n        mode: w\n"
                    f"        filename: \"{FILES[where]}\"", "filename", "run directory",
                    top=f"hidden: \"'{tmp_path}/evil.log'\"\n")


@pytest.mark.parametrize("subdir", ["../../elsewhere", "/tmp/gracecomm_evil"])
def test_hydra_output_subdir_outside_the_run_directory_is_refused(subdir):
    refused(lambda: compose_config(f"hydra.output_subdir={subdir}"), "hydra.output_subdir",
            "run directory")


def test_a_log_file_in_the_run_directory_is_allowed(tmp_path):
    text = ("hydra:\n  job_logging:\n    handlers:\n      extra:\n"
            "        class: logging.FileHandler\n"
            "        filename: ${hydra.runtime.output_dir}/logs/extra.log\n")
    assert compose_config(*global_file(tmp_path, text)).memory is not None


# -- the commands, end to end -------------------------------------------------------------------

def one_line_refusal(proc: subprocess.CompletedProcess, *words: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.slow
def test_train_runs_no_callback_built_by_an_interpolation(tmp_path):
    marker = tmp_path / "MARKER"
    conf = experiment_dir(tmp_path, "cb",
                          f"hidden: '{{_target_: {HELPER}, _args_: [touch, {marker}]}}'\n"
                          "hydra:\n  callbacks:\n    x: ${oc.decode:${hidden}}\n")
    proc = console_script("gracecomm-train", tmp_path, "--config-dir", str(conf),
                          "+experiment=cb", "trainer.max_steps=1", "trainer.progress=false")
    one_line_refusal(proc, "hydra.callbacks.x", HELPER)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["netbench", "bench"])
def test_a_config_file_cannot_forward_allow_any_target(tmp_path, which):
    forwarded = f"[allow_any_target=true, 'compressor._target_={HELPER}']"
    body = {"netbench": f"overrides: {forwarded}\n",
            "bench": f"suite: hook\nhook:\n  overrides: {forwarded}\n"}[which]
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "evil.yaml").write_text(
        f"defaults:\n  - {which}\n  - _self_\n{body}")
    proc = console_script(f"gracecomm-{which}", tmp_path, "--config-dir",
                          str(tmp_path / "conf"), "--config-name", "evil")
    one_line_refusal(proc, "allow_any_target", "command line")
