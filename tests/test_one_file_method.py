"""Adding a compressor is one new file, with no YAML and no list to edit: the example of
docs/adding-a-method.md, written to a module of its own and installed as a plugin (the
entry point ``gracecomm.compressor``), passes the suite's per-method checks: it is a choice
of the command line and a ``+method`` preset, every sweep of "every method" includes it,
Hypothesis's hostile tensors and malformed peer payloads, the state dict across a
non-finite step, the warm-up, and a round trip through a real communicator on two ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
NAME = "mymethod"


def example() -> str:
    """The method of docs/adding-a-method.md, as the page gives it (its first code block)."""
    page = (ROOT / "docs" / "adding-a-method.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(# compressors/mymethod\.py\n.*?)```", page, re.S)
    assert code, "docs/adding-a-method.md has no ```python block for compressors/mymethod.py"
    return code.group(1)


def install(folder: Path) -> None:
    """The example as an installed plugin: its one module, and the entry point an installer
    records for a package that declares ``[project.entry-points."gracecomm.compressor"]``."""
    (folder / "mymethod.py").write_text(example(), encoding="utf-8")
    info = folder / "mymethod-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mymethod\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[gracecomm.compressor]\n{NAME} = mymethod:MyMethod\n")


# what the suite parametrizes over every compressor, and the lists of every method
PER_METHOD = ["tests/test_properties.py", "tests/test_warm_up.py", "tests/test_nonfinite.py",
              "tests/test_configs.py", "tests/test_presets.py"]
EVERY_METHOD = [
    "tests/test_configs.py::test_every_registered_part_is_a_choice",
    "tests/test_experiment_configs.py::test_every_method_runs_every_compressor_from_its_name_alone",
    "tests/test_experiment_configs.py::test_grace_benchmark_covers_every_registered_compressor",
    "tests/test_gpucheck.py::test_methods_are_every_registered_compressor_and_codec",
]


def round_trip_rank(rank: int, world_size: int) -> None:
    """Two ranks exchange the plugin's payloads through allgather: each gets the mean of
    both ranks' decompressed selections."""
    import gracecomm
    pipe = gracecomm.build(NAME, communicator="allgather")
    grads = [torch.randn(50, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    reference = gracecomm.create("compressor", NAME)
    want = sum(reference.decompress(*reference.compress(g, "w")) for g in grads) / 2
    (got,) = pipe.step_many([("w", grads[rank].clone())])
    assert torch.allclose(got, want), (got, want)


@pytest.mark.slow  # a pytest run of the per-method tests and two Gloo ranks: a minute
def test_a_method_from_one_file_passes_the_per_method_checks(tmp_path):
    install(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    listed = subprocess.run(
        [sys.executable, "-c", "import gracecomm; print(gracecomm.available('compressor', "
         "verbose=True))"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert f"'{NAME}': 'mymethod'" in listed.stdout, listed.stdout + listed.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "",
         "-k", f"{NAME} or every_registered or every_compressor or every_registered_compressor",
         *PER_METHOD, *EVERY_METHOD],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    ran = re.search(r"(\d+) passed", proc.stdout)
    assert ran and int(ran.group(1)) >= 20, tail  # the per-method checks ran on it
    rounds = subprocess.run(
        [sys.executable, "-c", "from tests.helpers import run_ranks; from "
         "tests.test_one_file_method import round_trip_rank; run_ranks(round_trip_rank, 2)"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rounds.returncode == 0, rounds.stdout[-3000:] + rounds.stderr[-3000:]
