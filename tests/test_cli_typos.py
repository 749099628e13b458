"""A misspelt option, config group choice or value on any command's line ends in one line
that names it and suggests the close names, as `gracecomm.build` does; ``--help`` of every
command shows its own options with their defaults (gracecomm.config.explain_override_error,
check_part_options, the ``hydra.help`` section of each config in configs/)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from gracecomm.config import check_part_options, guard_composition, instantiate
from gracecomm.registry import COMPRESSORS
from gracecomm.validation import ConfigError
from tests.helpers import console_script

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def compose(config: str, *overrides: str):
    """The command's config composed with `overrides`, as its entry point composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    with guard_composition(), initialize_config_dir(config_dir=str(CONFIG_DIR),
                                                    version_base="1.3"):
        return hydra_compose(config_name=config, overrides=list(overrides))


def refusal(config: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        compose(config, *overrides)
    message = str(info.value)
    assert "\n" not in message and "HYDRA_FULL_ERROR" not in message, message
    return message


def build_message(name: str, **options) -> str:
    """`gracecomm.build`'s refusal of a part built with `options` (the registry's)."""
    with pytest.raises(ConfigError) as info:
        COMPRESSORS.create(name, **options)
    return str(info.value)


# -- in-process: the translation --------------------------------------------------------------

@pytest.mark.parametrize(("config", "override", "words"), [
    ("train", "compressor.ratoi=0.1",
     ["unknown option 'compressor.ratoi'.", "Did you mean 'compressor.ratio'?",
      "Options of compressor: ratio, backend"]),
    ("train", "~compressor.ratoi",
     ["unknown option 'compressor.ratoi'.", "Did you mean 'compressor.ratio'?"]),
    ("train", "trainer.epochz=1",
     ["unknown option 'trainer.epochz'.", "Did you mean 'trainer.epochs'?", "Options of trainer:"]),
    ("train", "compresor.ratio=0.1", ["unknown option 'compresor'.", "Did you mean 'compressor'?"]),
    ("train", "modell=cnn", ["unknown option 'modell'.", "Did you mean 'model'?"]),
    ("netbench", "bandwidth_mbpz=10",
     ["unknown option 'bandwidth_mbpz'.", "Did you mean 'bandwidth_mbps'?", "topology"]),
    ("gpucheck", "sizez=[1]", ["unknown option 'sizez'.", "Did you mean 'sizes'?"]),
    ("gpucheck", "ddp.stepz=1", ["unknown option 'ddp.stepz'.", "Did you mean 'ddp.steps'?",
                                 "Options of ddp: methods, steps"]),
    ("bench", "methds=[topk]", ["unknown option 'methds'.", "Did you mean 'methods'?"]),
    ("advise", "nodez=8", ["unknown option 'nodez'.", "Did you mean 'nodes'?"]),
])
def test_an_unknown_option_is_named_with_the_close_name(config, override, words):
    message = refusal(config, override)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(("override", "words"), [
    ("compressor=topkk", ["unknown compressor 'topkk'.", "Did you mean 'topk'?",
                          "Available:", "redsync"]),  # a ConfigStore-generated choice
    ("model=resnet", ["unknown model 'resnet'.", "Did you mean 'resnet20'?", "cnn"]),
    ("+method=topk11", ["unknown method 'topk11'.", "Did you mean 'topk1'?"]),
])
def test_an_unknown_group_choice_is_named_with_the_close_choices(override, words):
    message = refusal("train", override)
    for word in words:
        assert word in message, message


def test_the_first_of_several_misspellings_is_named():
    message = refusal("train", "trainer.epochs=1", "compressor.ratoi=0.1", "seedd=1")
    assert "unknown option" in message and ("ratoi" in message or "seedd" in message), message


def test_an_unreadable_override_is_one_line():
    assert "cannot read the override 'sizes=[1'" in refusal("gpucheck", "sizes=[1")


def test_an_added_option_the_class_does_not_take_is_refused_as_build_refuses_it():
    assert refusal("train", "+compressor.ratoi=0.1") == build_message("topk", ratoi=0.1)


def test_instantiate_checks_a_registered_part_s_options_as_build_does():
    with pytest.raises(ConfigError) as info:
        instantiate({"_target_": "gracecomm.compressors.topk.TopK", "ratoi": 0.1})
    assert str(info.value) == build_message("topk", ratoi=0.1)


def test_the_options_check_passes_the_shipped_configs_and_leaves_required_options_out():
    check_part_options(compose("train"))
    check_part_options({"_target_": "gracecomm.compressors.topk.TopK"})  # ratio: its default
    check_part_options({"_target_": "torch.nn.Linear", "in_features": 2, "out_featurez": 2})


# -- the commands ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("name", "args", "words"), [
    ("gracecomm-train", ["compressor.ratoi=0.1"], ["'compressor.ratio'"]),
    ("gracecomm-train", ["+compressor.ratoi=0.1"], ["compressor 'topk'", "'ratio'"]),
    ("gracecomm-train", ["compressor=topkk"], ["unknown compressor 'topkk'", "'topk'"]),
    ("gracecomm-train", ["trainer.epochz=1"], ["'trainer.epochs'"]),
    ("gracecomm-train", ["compressor.ratio=abc"], ["compressor 'topk'", "'ratio'", "abc"]),
    ("gracecomm-netbench", ["bandwidth_mbpz=10"], ["'bandwidth_mbps'"]),
    ("gracecomm-netbench", ["methods=[ddp]", "goall=step"], ["'goal'"]),
    ("gracecomm-netbench", ["accuracy.max_stepz=1"], ["'accuracy.max_steps'"]),
    ("gracecomm-bench", ["methds=[topk]"], ["'methods'"]),
    ("gracecomm-bench", ["capture.lrr=0.1"], ["'capture.lr'"]),
    ("gracecomm-bench", ["repeat=1"], ["'repeats'"]),
    ("gracecomm-gpucheck", ["sizez=[1]"], ["'sizes'"]),
    ("gracecomm-gpucheck", ["device=cpu", "ddp.stepz=1"], ["'ddp.steps'"]),
    ("gracecomm-gpucheck", ["tolerance.statistic=0.1"], ["'tolerance.statistics'"]),
    ("gracecomm-advise", ["bandwidth_mbs=10"], ["'bandwidth_mbps'"]),
])
def test_a_misspelt_command_line_ends_in_one_line(tmp_path, name, args, words):
    proc = console_script(name, tmp_path, *args)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("gracecomm.validation.ConfigError: "), lines[0]
    for word in [*words, "Did you mean" if "abc" not in args[0] else "must be"]:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.jsonl"))


def test_compositions_share_the_config_store_and_leave_hydra_as_it_was():
    """Hydra deep-copies its config repository for every composition and for every group
    ``--help`` lists; inside the guard the (registered parts') ConfigStore is shared by the
    copies instead of copied (``--help`` 3.7 s of CPU against 1.9 s), and nothing of it is
    left outside."""
    from hydra.core.config_store import ConfigStore
    store = ConfigStore.instance()
    with guard_composition():
        assert copy.deepcopy({"repo": store})["repo"] is store
        assert compose("train", "compressor=dgc").compressor.ratio == 0.01
    assert copy.deepcopy(store) is not store and "__deepcopy__" not in vars(ConfigStore)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "own", "foreign"), [
    ("gracecomm-train", ["compressor=topk", "ratio:", "epochs:", "== Config groups",
                         "model: cnn, lstm"], ["bandwidth_mbps"]),
    ("gracecomm-netbench", ["bandwidth_mbps: 100", "topology: loopback", "goal: step"],
     ["compressor: bf16", "== Config groups", "epochs:"]),
    ("gracecomm-bench", ["suite: compressors", "repeats: 5", "capture:"],
     ["compressor: bf16", "== Config groups", "bandwidth_mbps"]),
    ("gracecomm-gpucheck", ["device: cuda", "check_numel: 262161", "budget_s: 400"],
     ["compressor: bf16", "== Config groups", "bandwidth_mbps"]),
    ("gracecomm-report", ["--out", "--no-plots", "source"], ["bandwidth_mbps"]),
    ("gracecomm-advise", ["nodes: 4", "ranks_per_node: 1", "evidence: null"],
     ["compressor: bf16", "== Config groups", "epochs:"]),
])
def test_help_shows_the_command_s_own_options_with_their_defaults(tmp_path, name, own, foreign):
    exe = Path(sys.executable).parent / name
    proc = subprocess.run([str(exe), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert name in proc.stdout, proc.stdout[:2000]
    for word in own:
        assert word in proc.stdout, (word, proc.stdout[:3000])
    for word in foreign:
        assert word not in proc.stdout, (word, proc.stdout[:3000])
