"""Presets are defined once: a named setting of a method lives in ``configs/method/`` and
nowhere else (no preset tables in other configs, no override lists in the experiments'
code), the benchmarks name those presets, and a preset named like a registered compressor
means exactly that compressor with its defaults."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gracecomm import registry
from gracecomm.experiments import presets
from gracecomm.experiments.bench.hook import plan as hook_plan
from gracecomm.validation import ConfigError
from tests.helpers import CONFIG_DIR, compose_train

ROOT = CONFIG_DIR.parent
PARTS = ("compressor", "memory", "communicator")


def is_setting(text: object) -> bool:
    """A gracecomm-train override that picks or sets a part, or PyTorch's exchange."""
    if not isinstance(text, str) or "=" not in text:
        return False
    key = text.split("=", 1)[0].lstrip("+~")
    return key.split(".")[0].split("/")[0] in PARTS or key == "trainer.exchange"


def named_settings_in_yaml(node: object, path: str) -> list[str]:
    """Paths of mappings from a name to a list of part-setting overrides (a preset table)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, list) and any(is_setting(v) for v in value):
                found.append(f"{path}.{key}")
            found += named_settings_in_yaml(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += named_settings_in_yaml(value, f"{path}[{i}]")
    return found


@pytest.mark.parametrize("path", sorted(p.relative_to(CONFIG_DIR) for p in CONFIG_DIR.rglob(
    "*.yaml") if p.parent.name != "method"), ids=str)
def test_no_config_outside_method_defines_a_preset(path):
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / path))
    assert "presets" not in raw, f"configs/{path} has a preset table; use configs/method/"
    assert named_settings_in_yaml(raw, str(path)) == [], "name the presets of configs/method/"
    for spec in raw.get("methods", []) if path == Path("bench.yaml") else []:
        assert isinstance(spec, str), f"bench.yaml: {spec} is not a preset or registry name"


def python_files() -> list[Path]:
    return sorted((ROOT / "experiments").rglob("*.py")) + sorted((ROOT / "results").glob("*.py"))


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_experiment_code_defines_a_preset(path):
    """A dict from a name to a list of overrides that set a part is a preset written outside
    configs/method/ (as netbench's table and powersgd_vs_torch's modes once were)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values):
            if isinstance(value, (ast.List, ast.Tuple)):
                texts = [e.value for e in value.elts if isinstance(e, ast.Constant)]
                name = key.value if isinstance(key, ast.Constant) else "?"
                assert not any(map(is_setting, texts)), (
                    f"{path.relative_to(ROOT)}:{node.lineno}: '{name}' is a setting written "
                    f"in code ({texts}); make it a preset in configs/method/ and name it")


@pytest.mark.parametrize("name", sorted(set(presets.available())
                                        & set(registry.available("compressor"))))
def test_a_preset_named_like_a_compressor_is_that_compressor_with_its_defaults(name):
    preset = compose_train(*presets.overrides(name))
    plain = compose_train(f"compressor={name}")
    assert OmegaConf.to_container(preset.compressor, resolve=True) == \
        OmegaConf.to_container(plain.compressor, resolve=True)
    for part in ("memory", "communicator", "trainer"):
        assert preset[part] == plain[part], f"+method={name} changes {part}"


def test_pytorch_hook_presets_build_on_ours_and_only_change_the_exchange():
    assert presets.torch_twin("fp16") == "torch_fp16"
    assert presets.torch_twin("powersgd_parity") == "torch_powersgd"
    assert presets.torch_twin("dense") == "ddp" and presets.torch_twin("powersgd") is None
    ours, theirs = (compose_train(*presets.overrides(n)) for n in ("powersgd_parity",
                                                                   "torch_powersgd"))
    assert ours.compressor == theirs.compressor and ours.memory == theirs.memory
    assert (ours.trainer.exchange, theirs.trainer.exchange) == ("hook", "torch")
    assert (ours.compressor.start_iter, ours.memory.reference) == (2, "mean")
    own = compose_train(*presets.overrides("powersgd"))  # the compressor's own defaults
    assert (own.compressor.start_iter, own.memory.reference) == (0, "own")


def test_benchmarks_name_presets_and_refuse_other_names():
    assert hook_plan(["ddp", "topk"], ["model=mlp"]) == [
        ("ddp", ["model=mlp", "+method=ddp"]), ("topk", ["model=mlp", "+method=topk"])]
    with pytest.raises(ConfigError, match=r"names \['topkk'\].*Did you mean 'topk'"):
        presets.check(["topk", "topkk"], "netbench")


def test_a_bench_label_cannot_take_a_presets_name():
    from gracecomm.experiments.bench.compressors import method_instances
    spec = OmegaConf.create([{"name": "sidco", "label": "sidco_gp", "variant": "sidco_gp"}])
    with pytest.raises(ConfigError, match=r"sidco_gp.*method preset \(\+method=sidco_gp\)"):
        list(method_instances(spec, [0.01]))
    # a compressor's name is a preset too, though no file under configs/method/ holds it
    spec = OmegaConf.create([{"name": "randomk", "label": "topk"}])
    with pytest.raises(ConfigError, match=r"'topk' is the name of a method preset \(\+method="):
        list(method_instances(spec, [0.01]))
    (label, ratio, comp), = method_instances(OmegaConf.create(["sidco_gp"]), [0.001])
    assert (label, ratio, comp.ratio, comp.variant) == ("sidco_gp", 0.001, 0.001, "sidco_gp")
