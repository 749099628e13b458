"""Resume refuses every setting that changes what the next step computes (issue 34): the
batch size, the data split and fraction, the seed, the method and its options; the
optimizer's hyper-parameters are applied and recorded; the data settings may change only
when listed. A malformed manifest is a clear error, a failed write leaves no file behind,
and a checkpoint directory is never shared by two runs. Before the fix a new batch size,
test fraction or seed resumed silently and a new lr was replaced by the checkpoint's."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gracecomm.experiments.training import checkpoint
from gracecomm.experiments.training.config import compose_config, validate
from gracecomm.experiments.training.train import claim_run
from gracecomm.experiments.training.worker import train_worker
from gracecomm.validation import ConfigError

ROOT = Path(__file__).resolve().parent.parent
BASE = ("trainer.world_size=1", "trainer.exchange=step", "trainer.progress=false",
        "compressor=topk")


def run(tmp: Path, name: str, *overrides: str) -> Path:
    """One rank trains in this process (no process group), saving into `tmp/name`."""
    cfg = compose_config(*BASE, f"trainer.checkpoint_dir={tmp / name}", *overrides)
    validate(cfg)
    train_worker(0, 1, OmegaConf.to_container(cfg, resolve=True), str(tmp / f"{name}_run"), None)
    return tmp / name


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint at step 10 of epoch 0 (digits: 46 batches of 32 per epoch on one rank)."""
    return run(tmp_path_factory.mktemp("resume"), "ckpt", "trainer.max_steps=10",
               "trainer.checkpoint_every=10")


@pytest.fixture
def folder(saved: Path, tmp_path: Path) -> Path:
    """A copy of the step-10 checkpoint that a test may change."""
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    return copy


def save_step_12(folder: Path) -> None:
    """Save step 12 into `folder` from its step-10 state (a tiny model: the files' content
    does not matter to the tests that fail it)."""
    state = torch.load(folder / "rank0-step10.pt", weights_only=True)
    model = torch.nn.Linear(2, 2)
    checkpoint.save(folder, 0, 1, checkpoint.Position(12, 0, 12), model,
                    torch.optim.SGD(model.parameters(), lr=0.1), state["grace"],
                    state["totals"], "f")


def refused(saved: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate(compose_config(*BASE, f"trainer.resume={saved}", "trainer.max_steps=12",
                                *overrides))
    return str(info.value)


@pytest.mark.parametrize("override, words", [
    ("trainer.batch_size=16", ["trainer.batch_size is 16 here but 32", "trainer.batch_size=32",
                               "trainer.resume_changes=[trainer.batch_size]"]),
    ("data.test_fraction=0.5", ["data.test_fraction is 0.5 here but 0.2",
                                "data.test_fraction=0.2"]),
    ("seed=1", ["seed is 1 here but 0", "data.seed is 1 here but 0", "seed=0"]),
    ("compressor.ratio=0.1", ["compressor.ratio is 0.1 here but 0.01",
                              "compressor.ratio=0.01"]),
    ("compressor=randomk", ["compressor._target_", "RandomK"]),
    ("trainer.optimizer=adam", ["trainer.optimizer is 'adam' here but 'sgd'"]),
    ("check_finite=false", ["check_finite is False here but True"]),
])
def test_a_changed_setting_is_refused_naming_both_values(saved, override, words):
    message = refused(saved, override)
    for word in words:
        assert word in message, message
    if not override.startswith(("trainer.batch", "data", "seed")):
        assert "resume_changes" not in message, message  # no way to allow it


def test_only_data_settings_may_be_allowed_to_change(saved):
    message = refused(saved, "compressor.ratio=0.1", "trainer.resume_changes=[compressor]")
    assert "'compressor', which cannot change on resume" in message


@pytest.mark.parametrize("overrides", [
    ("trainer.batch_size=16", "trainer.resume_changes=[batch_size]"),  # docs/checkpoints.md
    ("trainer.batch_size=16", "trainer.resume_changes=[trainer.batch_size]"),
    ("seed=1", "trainer.resume_changes=[seed]"),  # data.seed is ${seed}: it follows
    ("seed=1", "data.test_fraction=0.5", "trainer.resume_changes=[seed,data]"),
    ("trainer.lr=0.01", "trainer.resume_changes=[trainer.lr]"),  # applied, listed or not
    ("trainer.momentum=0.5", "trainer.resume_changes=[momentum]"),
])
def test_the_documented_forms_of_resume_changes_resume(saved, overrides):
    """The forms docs/checkpoints.md and configs/trainer/default.yaml give (before the fix
    ``[batch_size]`` and ``[trainer.lr]`` were refused, and ``[seed]`` always failed on
    data.seed)."""
    validate(compose_config(*BASE, f"trainer.resume={saved}", "trainer.max_steps=12",
                            *overrides))


def test_listing_the_seed_does_not_allow_a_data_seed_of_its_own(saved):
    message = refused(saved, "seed=1", "data.seed=5", "trainer.resume_changes=[seed]")
    assert "data.seed is 5 here but 0" in message and "seed is 1" not in message, message


def test_an_allowed_data_change_continues_at_the_next_epoch(folder, tmp_path):
    cfg = compose_config(*BASE, f"trainer.resume={folder}", "trainer.batch_size=16",
                         "trainer.resume_changes=[trainer.batch_size]", "trainer.max_steps=12")
    validate(cfg)
    run_dir = tmp_path / "run"
    train_worker(0, 1, OmegaConf.to_container(cfg, resolve=True), str(run_dir), None)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resume"]["changed"] == {"trainer.batch_size": [32, 16]}
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").open()
              if '"type": "step"' in line]
    assert epochs == [1, 1], epochs  # steps 11 and 12, in the next epoch


def test_a_new_learning_rate_is_applied_and_recorded(folder, tmp_path, capsys):
    cfg = compose_config(*BASE, f"trainer.resume={folder}", "trainer.lr=0.01",
                         "trainer.max_steps=12", "trainer.checkpoint_every=12",
                         f"trainer.checkpoint_dir={folder}")
    validate(cfg)
    run_dir = tmp_path / "run"
    train_worker(0, 1, OmegaConf.to_container(cfg, resolve=True), str(run_dir), None)
    assert "trainer.lr 0.05 -> 0.01" in capsys.readouterr().out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resume"]["changed"] == {"trainer.lr": [0.05, 0.01]}
    entry = checkpoint.manifest(folder, 1)["ranks"][0]
    state = torch.load(folder / entry["file"], weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [0.01]


def test_the_same_settings_resume(folder):
    cfg = compose_config(*BASE, f"trainer.resume={folder}", "trainer.max_steps=12")
    validate(cfg)


# -- the manifest --------------------------------------------------------------------------

@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(ranks=["x"]), ["'ranks' must be a list of objects", "'x'"]),
    (lambda m: m.update(step="ten"), ["'step' must be an integer"]),
    (lambda m: m.pop("settings"), ["'settings' must be an object", "nothing"]),
    (lambda m: m.update(world_size=True), ["'world_size' must be an integer"]),
    (lambda m: m["ranks"][0].update(sha256=None), ["'ranks'"]),
    (lambda m: m.update(version=2), ["format 2", "format 3"]),
])
def test_a_malformed_manifest_is_a_clear_error(folder, edit, words):
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as info:
        checkpoint.manifest(folder, 1)
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize("text", ['["a", "b"]', "{", '{"version": 3}', "null"])
def test_a_manifest_that_is_not_one_is_a_clear_error(tmp_path, text):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(ConfigError, match="manifest.json"):
        checkpoint.manifest(tmp_path, 1)


class Evil:
    """Unpickling it would run a command (a crafted checkpoint)."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("content", ["pickle", "torch", "list", "garbage"])
def test_a_crafted_or_foreign_rank_file_is_refused_naming_it(folder, content):
    """A rank file that the manifest vouches for (size and hash) but that holds a crafted
    pickle, or is no checkpoint, is refused with the library's message naming the file
    (before the fix: torch's "Please file an issue" text)."""
    import hashlib
    import io
    import pickle
    path = folder / "rank0-step10.pt"
    buffer = io.BytesIO()
    if content == "pickle":
        buffer.write(pickle.dumps({"version": 3, "x": Evil()}))
    elif content == "torch":
        torch.save({"version": 3, "x": Evil()}, buffer)
    elif content == "list":
        torch.save([1, 2], buffer)
    else:
        buffer.write(b"garbage")
    data = buffer.getvalue()
    path.write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["ranks"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as info:
        checkpoint.load(folder, 0, 1, manifest["fingerprint"])
    message = str(info.value)
    assert message.startswith(f"checkpoint {path} "), message
    assert "Please file an issue" not in message and "\n" not in message, message
    if content in ("pickle", "torch"):
        assert "tensors and plain Python values" in message, message


# -- failed writes, shared directories -----------------------------------------------------

def test_a_full_disk_leaves_no_file_behind(folder, monkeypatch):
    before = sorted(p.name for p in folder.iterdir())

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left on device") as info:
        save_step_12(folder)
    assert "rank0-step12.pt" in str(info.value) and "intact" in str(info.value)
    assert sorted(p.name for p in folder.iterdir()) == before  # no .tmp, no unlisted file
    monkeypatch.undo()
    assert checkpoint.manifest(folder, 1)["step"] == 10


def test_a_full_disk_at_the_manifest_removes_the_new_file(folder, monkeypatch):
    before = sorted(p.name for p in folder.iterdir())
    write = checkpoint._write_atomically

    def full_at_manifest(path: Path, data: bytes) -> None:
        if path.name == checkpoint.MANIFEST:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(path, data)

    monkeypatch.setattr(checkpoint, "_write_atomically", full_at_manifest)
    with pytest.raises(OSError):
        save_step_12(folder)
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_checkpoint_directory_in_use_is_locked(tmp_path):
    cfg = compose_config(*BASE, "trainer.checkpoint_every=5",
                         f"trainer.checkpoint_dir={tmp_path / 'shared'}")
    with claim_run(cfg, str(tmp_path / "a")):
        with pytest.raises(ConfigError, match="checkpoint directory .* is in use by another run"):
            with claim_run(cfg, str(tmp_path / "b")):
                pass


def test_a_checkpoint_directory_of_another_run_is_refused(folder, tmp_path):
    cfg = compose_config(*BASE, "trainer.checkpoint_every=5", f"trainer.checkpoint_dir={folder}")
    with pytest.raises(ConfigError, match="holds the checkpoint of another run"):
        with claim_run(cfg, str(tmp_path / "run")):
            pass
    resumed = compose_config(*BASE, "trainer.checkpoint_every=5", f"trainer.resume={folder}",
                             f"trainer.checkpoint_dir={folder}")
    with claim_run(resumed, str(tmp_path / "run")):  # continuing in place is allowed
        pass


# -- the command lines -------------------------------------------------------------

@pytest.mark.slow
def test_resume_with_another_batch_size_is_refused_before_workers_start(tmp_path):
    def cli(*overrides: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gracecomm.experiments.training",
                               "trainer.progress=false", *overrides], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    first = cli(f"hydra.run.dir={tmp_path}/a", "trainer.max_steps=10",
                "trainer.checkpoint_every=10")
    assert first.returncode == 0, first.stderr[-2000:]
    again = cli(f"hydra.run.dir={tmp_path}/b", f"trainer.resume={tmp_path}/a/checkpoints",
                "trainer.batch_size=16")
    assert again.returncode != 0 and "trainer.batch_size is 16 here but 32" in again.stderr, \
        again.stderr[-2000:]
    assert "worker rank" not in again.stderr
