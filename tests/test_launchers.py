"""Hydra plugins users sweep with: the joblib and submitit (local) launchers run every job,
the Optuna sweeper optimises the returned objective (always minimised; a tuple in
multi-objective mode), and torchrun refuses a multirun instead of running only its first
job."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gracecomm.experiments.training.summary import objective, objective_names
from gracecomm.validation import ConfigError
from tests.helpers import compose_train
from tests.test_train import train

BIN = Path(sys.executable).parent


def test_objective_is_always_minimised():
    accuracy = {"metric": "test_acc", "test_acc": 0.9, "higher_is_better": True,
                "wire_bytes_per_step": 100.0, "sent_bytes_per_step": 120.0}
    assert objective(accuracy, ["error"]) == pytest.approx(0.1)
    perplexity = {"metric": "test_ppl", "test_ppl": 80.0, "higher_is_better": False}
    assert objective(perplexity, ["error"]) == 80.0
    assert objective(accuracy, ["error", "wire_bytes", "sent_bytes"]) == (
        pytest.approx(0.1), 100.0, 120.0)
    assert math.isnan(objective({}, ["error"]))  # a run that wrote no summary


def test_objective_option_is_checked():
    assert objective_names(compose_train()) == ["error"]
    assert objective_names(compose_train("objective=[error,wire_bytes]")) == [
        "error", "wire_bytes"]
    with pytest.raises(ConfigError, match="option 'objective' must be one of 'error'"):
        objective_names(compose_train("objective=accuracy"))
    with pytest.raises(ConfigError, match="option 'objective' is empty"):
        objective_names(compose_train("objective=[]"))


def summaries(sweep):
    return [json.loads(p.read_text()) for p in sorted(Path(sweep).glob("*_*/summary.json"))]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a sweep of fresh processes: minutes on a busy 2-core machine
def test_joblib_launcher_runs_every_job(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    # python -m: the module is __main__ here, which launchers cannot pickle by name
    proc = train(tmp_path, "hydra/launcher=joblib", "compressor=none,topk",
                 "trainer.world_size=1", "trainer.max_steps=3", multirun=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s["compressor"] for s in summaries(tmp_path / "sweep")] == ["none", "topk"]
    assert (tmp_path / "sweep" / "report.md").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_submitit_local_launcher_runs_every_job(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [str(BIN / "gracecomm-train"), "-m", "hydra/launcher=submitit_local",
         f"hydra.sweep.dir={sweep}", "compressor=none,topk", "trainer.world_size=1",
         "trainer.max_steps=3", "trainer.progress=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s["compressor"] for s in summaries(sweep)] == ["none", "topk"]
    assert (sweep / "report.md").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_optuna_multi_objective_sweep_of_three_trials(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    proc = train(tmp_path, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3",
                 "hydra.sweeper.n_jobs=3", "hydra.sweeper.sampler.seed=0",
                 "hydra.sweeper.direction=[minimize,minimize]", "objective=[error,wire_bytes]",
                 "compressor=topk", "compressor.ratio=tag(log,interval(0.001,0.1))",
                 "trainer.world_size=1", "trainer.max_steps=3", multirun=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = summaries(tmp_path / "sweep")
    assert len(runs) == 3
    results = OmegaConf.load(tmp_path / "sweep" / "optimization_results.yaml")
    by_ratio = {}
    for path in sorted((tmp_path / "sweep").glob("*_*/metrics.jsonl")):
        config = json.loads(path.read_text().splitlines()[0])["config"]
        by_ratio[config["compressor"]["ratio"]] = json.loads(
            (path.parent / "summary.json").read_text())
    assert results.solutions, "no Pareto solution"
    for solution in results.solutions:  # the values Optuna saw are the runs' objectives
        run = by_ratio[solution.params["compressor.ratio"]]
        assert list(solution["values"]) == pytest.approx(
            [1 - run["test_acc"], run["wire_bytes_per_step"]])
    assert (tmp_path / "sweep" / "report.md").exists()


@pytest.mark.slow
def test_torchrun_refuses_a_multirun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    torchrun = shutil.which("torchrun", path=str(BIN))
    assert torchrun is not None
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=1", f"--log-dir={tmp_path}/torchrun",
         "-m", "gracecomm.experiments.training",
         "-m", f"hydra.sweep.dir={tmp_path}/sweep", "compressor=none,topk",
         "trainer.max_steps=2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode != 0
    assert "a Hydra multirun (-m) cannot run under torchrun" in proc.stdout + proc.stderr
    assert not list((tmp_path / "sweep").glob("*/metrics.jsonl"))
