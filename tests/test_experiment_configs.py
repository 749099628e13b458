"""Every experiment config's sweep names registered compressors and existing method presets,
and every job of the sweep composes and builds, without running anything. The jobs are
expanded exactly as Hydra's basic sweeper does (the config's ``hydra.sweeper.params`` first,
then the command line), so a preset that sets a trainer option is checked in the order it is
really applied."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import get_class
from omegaconf import DictConfig

from gracecomm import registry
from gracecomm.configstore import register_configs
from gracecomm.experiments import presets
from gracecomm.experiments.training.config import validate
from tests.helpers import CONFIG_DIR, compose_train

EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
PRESETS = presets.available()
GROUP_OPTIONS = {"compressor": registry.available("compressor"), "+method": PRESETS,
                 "method": PRESETS}


def sweep_params(experiment: str) -> dict[str, str]:
    register_configs()  # as every command does before it composes
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"+experiment={experiment}"],
                      return_hydra_config=True)
    return dict(cfg.hydra.sweeper.params or {})


def jobs(experiment: str, *arguments: str) -> list[list[str]]:
    """The override list of every job of ``gracecomm-train -m
    +experiment=EXPERIMENT ARGUMENTS...``."""
    params = [f"{k}={v}" for k, v in sweep_params(experiment).items()]
    params += [f"+experiment={experiment}", *arguments]
    overrides = OverridesParser.create().parse_overrides(params)
    (batch,) = BasicSweeper.split_arguments(overrides, None)
    return batch


def values(experiment: str, key: str) -> list[str]:
    raw = sweep_params(experiment)[key]
    (override,) = OverridesParser.create().parse_overrides([f"{key}={raw}"])
    return list(override.sweep_string_iterator())


def compressor_name(cfg: DictConfig) -> str:
    cls = get_class(cfg.compressor._target_)
    return next(n for n in registry.available("compressor") if registry.get("compressor", n) is cls)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_sweep_names_registered_compressors_and_existing_presets(experiment):
    params = sweep_params(experiment)
    assert params, f"configs/experiment/{experiment}.yaml has no hydra.sweeper.params"
    for key, options in GROUP_OPTIONS.items():
        if key in params:
            unknown = sorted(set(values(experiment, key)) - set(options))
            assert not unknown, f"{experiment}: {key} names {unknown}, not in {options}"


@pytest.mark.slow  # composes and builds every job: seconds per sweep
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_job_of_the_sweep_composes_and_builds(experiment):
    """Every job, each seed of a sweep over seeds once (a seed changes no other option)."""
    seeds = values(experiment, "seed")[:1] if "seed" in sweep_params(experiment) else []
    for overrides in jobs(experiment, *(f"seed={seed}" for seed in seeds)):
        cfg = compose_train(*overrides)
        validate(cfg)  # what gracecomm.experiments.training checks before any worker starts:
        # its pipeline built, the model against the data, the logger, the networks


def sweep_compressors(experiment: str, *arguments: str) -> dict[str, DictConfig]:
    return {" ".join(o for o in job if not o.startswith("+experiment")): compose_train(*job)
            for job in jobs(experiment, *arguments)}


@pytest.mark.slow  # composes every job of a sweep: seconds
def test_grace_benchmark_covers_every_registered_compressor():
    cfgs = sweep_compressors("grace_benchmark")
    assert sorted({compressor_name(c) for c in cfgs.values()}) == registry.available("compressor")
    for job, cfg in cfgs.items():
        if "ratio" in cfg.compressor:
            assert cfg.compressor.ratio == 0.01, job
    by_method = {job.split("=", 1)[1]: cfg for job, cfg in cfgs.items()}
    # the sign methods' own step sizes: tests/test_method_defaults.py
    assert by_method["dense"].trainer.lr == 0.05
    assert by_method["dgc_reference"].compressor.warmup_epochs == 1
    lgc = by_method["lgc_rar"].compressor
    assert (lgc.warmup_iters, lgc.ae_train_iters) == (20, 60)


@pytest.mark.slow  # composes every job of a sweep: seconds
def test_every_method_runs_every_compressor_from_its_name_alone():
    """Each job is ``compressor=NAME seed=S`` on the default experiment: nothing else."""
    assert values("every_method", "seed") == ["0", "1", "2"]
    cfgs = sweep_compressors("every_method", "seed=1")
    assert sorted(compressor_name(c) for c in cfgs.values()) == registry.available("compressor")
    for job, cfg in cfgs.items():
        alone = compose_train(*job.split())
        assert {k: v for k, v in cfg.items() if k != "experiment"} == alone, job


def test_sidco_compares_its_variants_with_the_baselines_at_two_densities():
    assert values("sidco", "experiment.ratio") == ["0.01", "0.001"]
    cfgs = sweep_compressors("sidco")
    seen = set()
    for job, cfg in cfgs.items():
        name = compressor_name(cfg)
        if name == "none":
            continue
        assert cfg.compressor.ratio == cfg.experiment.ratio, job
        seen.add((name, cfg.compressor.get("variant"), cfg.experiment.ratio))
    for ratio in (0.01, 0.001):
        assert {(n, v) for n, v, r in seen if r == ratio} == {
            ("topk", None), ("dgc", None), ("redsync", None), ("gaussiank", None),
            ("sidco", "sidco_e"), ("sidco", "sidco_gp"), ("sidco", "sidco_gamma_gp")}


def test_natural_has_the_standard_counterparts():
    names = {compressor_name(c) for c in sweep_compressors("natural").values()}
    assert {"none", "natural", "natural_dithering", "standard_dithering", "qsgd",
            "compose"} <= names
    levels = sorted(c.compressor.levels for c in sweep_compressors("natural").values()
                    if compressor_name(c) == "standard_dithering")
    assert levels == [8, 128]


def _bloom(cfg: DictConfig) -> tuple[str, float] | None:
    if (compressor_name(cfg) != "deepreduce"
            or not cfg.compressor.index._target_.endswith("BloomIndex")):
        return None
    return cfg.compressor.index.policy, cfg.compressor.index.fpr


@pytest.mark.slow  # composes every job of a sweep: seconds
def test_deepreduce_breaks_down_codecs_and_bloom_policies():
    cfgs = sweep_compressors("deepreduce")
    index = {c.compressor.index._target_.rsplit(".", 1)[1] for c in cfgs.values()
             if compressor_name(c) == "deepreduce"}
    value = {c.compressor.value._target_.rsplit(".", 1)[1] for c in cfgs.values()
             if compressor_name(c) == "deepreduce"}
    assert {"PackedIndex", "BitmapIndex", "RLEIndex", "HuffmanIndex", "DeltaVarintIndex",
            "DeflateIndex", "BloomIndex"} <= index
    assert {"RawValues", "FP16Values", "QSGDValues", "DeflateValues", "PolyFitValues",
            "DExpValues"} <= value
    assert {b[0] for c in cfgs.values() if (b := _bloom(c))} == {"naive", "p0", "p1", "p2"}
    # the Bloom grid of docs/experiments.md: four policies x three false-positive rates
    grid = sweep_compressors("deepreduce", "+method=dr_bf_naive,dr_bf_p0,dr_bf_p1,dr_bf_p2",
                             "experiment.fpr=0.001,0.01,0.03")
    assert sorted(_bloom(c) for c in grid.values()) == sorted(
        (p, f) for p in ("naive", "p0", "p1", "p2") for f in (0.001, 0.01, 0.03))


def test_sparse_model_runs_deepreduce_without_a_sparsifier():
    cfgs = [c for c in sweep_compressors("sparse_model").values()
            if compressor_name(c) == "deepreduce"]
    assert ({c.compressor.sparsifier._target_ for c in cfgs}
            == {"gracecomm.compressors.deepreduce.NonZero"})
    assert sorted(_bloom(c) for c in cfgs) == [("p0", 0.6), ("p2", 0.01)]
    assert {"none"} <= {compressor_name(c) for c in sweep_compressors("sparse_model").values()}


def test_lgc_compares_both_variants_with_top_k_and_dgc_at_one_density():
    """The byte ratios against Top-k need the same density in every run, and LGC's default
    phase lengths apply to both variants; LGC_PS runs with its own and the leader's indices."""
    cfgs = sweep_compressors("lgc")
    assert sorted(compressor_name(c) for c in cfgs.values()) == [
        "dgc", "lgc_ps", "lgc_ps", "lgc_rar", "none", "topk"]
    assert sorted(c.compressor.indices for c in cfgs.values()
                  if compressor_name(c) == "lgc_ps") == ["leader", "own"]
    for job, cfg in cfgs.items():
        if "ratio" in cfg.compressor:
            assert cfg.compressor.ratio == cfg.experiment.ratio == 0.02, job
        if compressor_name(cfg).startswith("lgc"):
            phases = (cfg.compressor.warmup_iters, cfg.compressor.ae_train_iters)
            assert phases == (200, 300), job
