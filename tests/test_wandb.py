"""W&B runs a user can navigate, checked in offline mode (no network) by reading the run's
own ``.wandb`` file: name, tags and config keys from the parts, a readable sweep group,
evaluation metrics on their own axis with the best value in the summary, the run's own
report table and plots, every run in a group, and a resumed run continuing the same W&B run
in the same group."""

import json
import struct
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gracecomm.experiments.training.loggers import (
    JsonlLogger,
    logged_group,
    run_group,
    run_name,
    run_parts,
    sweep_group,
)
from tests.test_train import train

CHOICES = {"logger": "wandb", "compressor": "deepreduce", "compressor/index": "bloom",
           "compressor/sparsifier": "topk", "memory": "residual", "communicator": "allgather",
           "data": "digits", "model": "cnn", "trainer": "default", "hydra/launcher": "basic",
           "hydra/callbacks": None}


def test_parts_name_and_group_come_from_hydra_choices():
    parts = run_parts(CHOICES)
    assert parts == {"compressor": "deepreduce", "compressor_index": "bloom",
                     "compressor_sparsifier": "topk", "memory": "residual",
                     "communicator": "allgather", "data": "digits", "model": "cnn"}
    assert run_name(parts, ["compressor=deepreduce", "compressor.index.fpr=0.6",
                            "trainer.lr=0.1"], {"compressor": {}}) == (
        "deepreduce(bloom+topk)-index.fpr=0.6")
    topk = {"compressor": "topk", "memory": "residual"}
    assert run_name(topk, ["compressor=topk", "++compressor.ratio=0.01", "memory=none"],
                    {"compressor": {"ratio": 0.01}}) == "topk-0.01-memory=none"
    hydra = OmegaConf.create({"runtime": {"choices": {"experiment": "sidco"}},
                              "job": {"name": "train"},
                              "sweep": {"dir": "multirun/2026-11-22/00-08-05_81230"},
                              "run": {"dir": "outputs/2026-11-22/02-10-06_topk_81230"}})
    assert sweep_group(hydra) == "sidco_2026-11-22_00-08-05_81230"
    hydra.runtime.choices = {}
    assert sweep_group(hydra) == "train_2026-11-22_00-08-05_81230"
    assert run_group(hydra) == "train_2026-11-22_02-10-06_topk_81230"


def test_a_later_report_finds_the_sweep_group_the_runs_logged(tmp_path):
    assert logged_group(tmp_path) is None
    JsonlLogger(str(tmp_path / "0_topk"), {"a": 1}, group="train_2026-11-22_00-08-05")
    assert logged_group(tmp_path) == "train_2026-11-22_00-08-05"


def wandb_records(path):
    """The protobuf records of a ``.wandb`` file (LevelDB log format: 32 KiB blocks of
    chunks, each with a 7-byte header: CRC, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        buf = (b"" if kind in (1, 2) else buf) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def offline_run(run_dir):
    """The run record, metric definitions, history rows and final summary of the one
    offline W&B run under `run_dir`."""
    (path,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    out = {"run": None, "metrics": {}, "history": [], "summary": {}}

    def key(item):
        return item.key or "/".join(item.nested_key)

    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
        elif kind == "metric":
            out["metrics"][record.metric.name or record.metric.glob_name] = record.metric
        elif kind == "history":
            out["history"].append({key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            out["summary"].update({key(i): json.loads(i.value_json) for i in record.summary.update})
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)  # two training runs of fresh processes
def test_wandb_run_is_named_tagged_and_resumes_the_same_run(tmp_path):
    pytest.importorskip("wandb")
    common = ["logger=wandb", "compressor=topk", "compressor.ratio=0.05", "+memory.beta=0.5",
              "trainer.world_size=1", "trainer.checkpoint_every=10"]
    first = train(tmp_path / "first", *common, "trainer.max_steps=50", timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    run = offline_run(tmp_path / "first" / "run")
    info = run["run"]
    assert info.display_name == "topk-0.05-memory.beta=0.5"
    assert {"compressor:topk", "memory:residual", "communicator:allgather", "model:cnn",
            "data:digits"} == set(info.tags)
    # a single run is a group of its own, named after its directory
    assert info.job_type == "train" and info.run_group == "train_first_run"
    config = {u.key: json.loads(u.value_json) for u in info.config.update}
    assert config["parts"] == {"compressor": "topk", "memory": "residual",
                               "communicator": "allgather", "data": "digits", "model": "cnn"}
    assert config["compressor"]["ratio"] == 0.05
    assert run["metrics"]["eval/*"].step_metric == "eval/epoch"
    assert run["metrics"]["train/*"].step_metric == "train/step"
    assert run["metrics"]["eval/test_acc"].summary.max
    evals = [row for row in run["history"] if "eval/test_acc" in row]
    assert [row["eval/epoch"] for row in evals] == [0, 1]  # 43 steps per epoch on one rank
    assert run["summary"]["eval/test_acc"] == {"max": max(r["eval/test_acc"] for r in evals)}
    report = next(row for row in run["history"] if "report/table/_type" in row)
    assert report["report/table/_type"] == "table-file" and report["report/table/nrows"] == 1
    assert report["report/loss/_type"] == report["report/pareto/_type"] == "image-file"
    assert (tmp_path / "first" / "run" / "report.md").exists()

    resumed = train(tmp_path / "second", *common, "trainer.max_steps=60",
                    f"trainer.resume={tmp_path}/first/run/checkpoints", timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = offline_run(tmp_path / "second" / "run")
    assert again["run"].run_id == info.run_id and again["run"].run_group == info.run_group
    steps = [row["train/step"] for row in again["history"] if "train/step" in row]
    assert steps == list(range(51, 61))
