"""What is installed does not depend on what else is importable under generic names: everything
installs under the one root `gracecomm`, so a user's own `grace/`, `compressors/` or
`experiments/` package in the working directory cannot shadow any of it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

SHADOW = 'raise SystemExit("the user\'s own package was imported instead of gracecomm\'s")\n'


@pytest.fixture
def research_repo(tmp_path: Path) -> Path:
    """A working directory holding packages named like the repository's folders."""
    for name in ("grace", "compressors", "memories", "communicators", "experiments", "configs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(SHADOW)
    return tmp_path


def test_every_package_folder_is_listed_and_the_tests_are_not() -> None:
    """Every folder with an ``__init__.py`` under a mapped folder is a package of the wheel
    (``[tool.setuptools] packages``), and the test harnesses are not."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parent.parent
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in setup["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            found.add(".".join([package, *parts]))
    listed = set(setup["packages"])
    assert found - {"gracecomm.configs"} <= listed, sorted(found - listed)
    assert not any(name.startswith(("tests", "gracecomm.tests")) for name in listed)
    assert (root / "tests" / "reliability.py").exists()


@pytest.mark.slow
def test_registry_ignores_packages_in_the_working_directory(research_repo: Path) -> None:
    code = ("import gracecomm; g = gracecomm.build('topk'); print(g); "
            "print(len(gracecomm.available('compressor')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=research_repo, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Grace(compressor='topk', memory='residual', communicator='allgather')" in done.stdout
    assert int(done.stdout.split()[-1]) > 20


@pytest.mark.slow
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


def bash_completions(line: str) -> list[str]:
    """What bash completes for `line` (ending in the word being typed) after sourcing the
    script `gracecomm-train -sc install=bash` prints, as a user's shell would."""
    script = (f'eval "$(gracecomm-train -sc install=bash)"\n'
              f'COMP_LINE={shlex.quote(line)}; COMP_POINT=${{#COMP_LINE}}\n'
              'words=($COMP_LINE); COMP_CWORD=$(( ${#words[@]} - 1 ))\n'
              'hydra_bash_completion\nprintf "%s\\n" "${COMPREPLY[@]}"\n')
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=280,
                          env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.slow
def test_shell_completion_of_the_console_script() -> None:
    assert {"compressor=topk", "compressor=threshold"} <= set(
        bash_completions("gracecomm-train compressor=t"))
    assert "compressor.ratio=" in bash_completions("gracecomm-train compressor=topk compressor.ra")
    assert "compressor/index=bloom" in bash_completions(
        "gracecomm-train compressor=deepreduce compressor/index=bl")


@pytest.mark.slow
def test_built_wheel_works_beside_shadowing_packages(research_repo: Path, tmp_path: Path) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building needs setuptools>=77 (PEP 639), found {setuptools.__version__}")
    root = Path(__file__).resolve().parent.parent
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info beside it
    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"].values()
    for name in folders:
        shutil.copytree(root / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("gracecomm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{info}/METADATA").decode()
        scripts = archive.read(f"{info}/entry_points.txt").decode()
    assert {n.split("/")[0] for n in names} == {"gracecomm", info}
    assert "gracecomm/experiments/training/train.py" in names
    assert not [n for n in names if "reliability" in n], "a test harness is in the wheel"
    assert "gracecomm/configs/train.yaml" in names and f"{info}/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in metadata
    assert all(f"gracecomm-{s} =" in scripts for s in ("train", "bench", "report"))
    target = tmp_path / "installed"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # -S: no site processing, so the editable install of this checkout is not importable;
    # the dependencies come from this environment, gracecomm only from the wheel
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target),
                                                        sysconfig.get_paths()["purelib"]])}
    code = ("import sys, gracecomm; from gracecomm.experiments.training import train; "
            "print(gracecomm.__file__, train.__file__); print(gracecomm.build('topk')); "
            "sys.argv = ['gracecomm-train', '--cfg', 'job']; train.main()")
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=research_repo,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    files, built = done.stdout.splitlines()[:2]
    assert all(f.startswith(str(target)) for f in files.split()), files
    assert built == "Grace(compressor='topk', memory='residual', communicator='allgather')"
    assert "_target_: gracecomm.compressors.topk.TopK\n" in done.stdout
