"""The results page and the script that regenerates it: every step of results/reproduce.sh
stamps the page with the commit its numbers come from."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "results" / "reproduce.sh"


def default_steps():
    text = SCRIPT.read_text()
    block = re.search(r"steps=\((grace_benchmark[^)]*)\)", text).group(1)
    return block.replace("\\", " ").split()


def test_every_step_runs_by_default_and_has_a_stamp_on_the_page():
    text = SCRIPT.read_text()
    cases = re.findall(r"^    (\w+)\)", text, flags=re.M)
    assert sorted(cases) == sorted(default_steps())
    page = (ROOT / "results" / "README.md").read_text()
    for step in default_steps():
        assert page.count(f"<!-- stamp:{step} -->") == 1, step


@pytest.mark.slow
def test_stamp_names_the_commit_and_uncommitted_changes(tmp_path):
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    (tmp_path / "results").mkdir()
    page = tmp_path / "results" / "README.md"
    page.write_text("# Results\n<!-- stamp:lgc -->Produced at commit `old`.\ntext\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    stamp = "source <(sed -n '/^stamp()/,/^}/p' " + str(SCRIPT) + "); stamp lgc"
    page.write_text(page.read_text() + "a table the step wrote\n")  # results/ does not count
    subprocess.run(["bash", "-c", stamp], cwd=tmp_path, check=True)
    head = git("rev-parse", "--short=12", "HEAD")
    line = page.read_text().splitlines()[1]
    assert line.startswith(f"<!-- stamp:lgc -->Produced at commit `{head}` on ")
    assert line.endswith("by `bash results/reproduce.sh lgc`.")
    (tmp_path / "code.py").write_text("x = 2\n")
    subprocess.run(["bash", "-c", stamp], cwd=tmp_path, check=True)
    assert f"`{head} with uncommitted changes`" in page.read_text()
    assert page.read_text().endswith("text\na table the step wrote\n")


def test_no_placeholder_is_left_on_the_page():
    """Tables laid out by hand replace markers such as ``@@FPR@@``; one left behind is a
    section published without its numbers."""
    page = (ROOT / "results" / "README.md").read_text()
    assert re.findall(r"@@\w+@@", page) == []


@pytest.mark.slow
def test_the_sidco_bound_script_runs():
    """`python results/sidco_bound.py` (the results page's floor for SIDCo-E on heavy tails)
    still runs against the kernels it drives, on a small tensor."""
    done = subprocess.run([sys.executable, str(ROOT / "results" / "sidco_bound.py"),
                           "--numel", "1048576", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| floor: the cheapest of (a)-(c) and decompression |" in done.stdout
