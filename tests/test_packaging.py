"""What is installed does not depend on what else is importable under generic names: the
method folders install as `gracecomm.*`, so a user's own `compressors/` or `experiments/`
package in the working directory cannot shadow them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHADOW = 'raise SystemExit("the user\'s own package was imported instead of gracecomm\'s")\n'


@pytest.fixture
def research_repo(tmp_path: Path) -> Path:
    """A working directory holding packages named like the repository's folders."""
    for name in ("compressors", "memories", "communicators", "experiments", "configs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(SHADOW)
    return tmp_path


def test_registry_ignores_packages_in_the_working_directory(research_repo: Path) -> None:
    code = ("import grace; g = grace.build('topk'); print(g); "
            "print(len(grace.available('compressor')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=research_repo, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Grace(compressor='topk', memory='residual', communicator='allgather')" in done.stdout
    assert int(done.stdout.split()[-1]) > 20


@pytest.mark.parametrize(("script", "expect"), [("gracecomm-train", "_target_: gracecomm."),
                                               ("gracecomm-bench", "suite: compressors")])
def test_console_scripts_run_beside_shadowing_packages(research_repo: Path, script: str,
                                                       expect: str) -> None:
    exe = shutil.which(script, path=str(Path(sys.executable).parent))
    assert exe is not None, f"console script {script} is not installed beside {sys.executable}"
    done = subprocess.run([exe, "--cfg", "job"], cwd=research_repo, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert expect in done.stdout
