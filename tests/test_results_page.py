"""The results page and docs/ are rendered from the stored outputs of results/reproduce.sh's
steps (results/render.py), each step stamped by results/stamp.py."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "results" / "reproduce.sh"


def load(name):
    path = ROOT / "results" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"results_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


render, stamp = load("render"), load("stamp")
STATED = re.compile(r"(?:\[(\w+)\]\([^)\s]*run\.json\)|reproduce\.sh (\w+)`) at `\w+`"
                    r"(?:(?!\]\(|reproduce\.sh).)*?"
                    r"(?P<note> \((?:\*\*stale\*\*|whether the code)[^)]*\))")


def pin_history(module):
    """Make `module` (a load of results/render.py) say of each step's staleness what the
    committed pages say, without git: the fast tier starts no process. The slow
    `test_every_page_renders_as_committed` checks the pages against git's history."""
    stated = {m[1] or m[2]: m["note"] for page in module.pages()
              for m in STATED.finditer(page.read_text(encoding="utf-8"))}
    module.staleness = lambda step, commit: stated.get(step, "")
    return module


pin_history(render)


def default_steps():
    text = SCRIPT.read_text()
    block = re.search(r"steps=\((grace_benchmark[^)]*)\)", text).group(1)
    return block.replace("\\", " ").split()


def test_every_step_runs_by_default_and_has_stamped_outputs():
    cases = re.findall(r"^    (\w+)\)", SCRIPT.read_text(), flags=re.M)
    assert sorted(cases) == sorted(default_steps())
    for step in default_steps():
        stamped = json.loads((ROOT / "results" / step / "run.json").read_text())
        assert stamped["step"] == step
        assert re.fullmatch(r"[0-9a-f]{12}", stamped["commit"]), step
        assert stamped["commands"] and all(c.strip() for c in stamped["commands"]), step
        assert stamped["load"]["before"] is not None or stamped.get("load_text"), step


@pytest.mark.slow
def test_every_page_renders_as_committed():
    """What CI runs (`bash results/reproduce.sh --check`)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    done = subprocess.run(["bash", str(SCRIPT), "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PATH": path})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def mirror(tmp_path):
    """A root with a copy of the results page and links to every stored output."""
    (tmp_path / "results").mkdir()
    for entry in (ROOT / "results").iterdir():
        if entry.is_dir():
            (tmp_path / "results" / entry.name).symlink_to(entry)
    page = tmp_path / "results" / "README.md"
    page.write_text((ROOT / "results" / "README.md").read_text())
    return page


def test_check_fails_after_a_hand_edit_of_a_rendered_table(tmp_path, capsys):
    page = mirror(tmp_path)
    render.main(["--check"], root=tmp_path)  # the copy renders as it is
    text = page.read_text()
    block = text.index("<!-- render: grace_benchmark -->")
    cell = re.compile(r"\| (\d+\.\d\d) \|")
    match = cell.search(text, block)
    edited = text[:match.start(1)] + "12.34" + text[match.end(1):]
    page.write_text(edited)
    with pytest.raises(SystemExit, match="differ from what the stored outputs render"):
        render.main(["--check"], root=tmp_path)
    assert "12.34" in capsys.readouterr().out
    render.main([], root=tmp_path)  # rendering again restores the table
    assert page.read_text() == text


def test_a_step_changes_only_the_blocks_that_read_it(tmp_path):
    """Another result of one step (here `variance`) re-renders that step's tables and stamp
    and leaves every other block of the page as it was."""
    import shutil

    page = mirror(tmp_path)
    copy = tmp_path / "results" / "variance"
    copy.unlink()
    shutil.copytree(ROOT / "results" / "variance", copy)
    records = json.loads((copy / "bench.json").read_text())
    records[0]["second_moment"] = 7.5
    (copy / "bench.json").write_text(json.dumps(records))
    stamped = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps({**stamped, "commit": "feedfacecafe"}))
    before = {m.spec: m.body for m in render.marks(page.read_text(), page)}
    render.main([], root=tmp_path)
    after = {m.spec: m.body for m in render.marks(page.read_text(), page)}
    changed = {spec for spec in before if before[spec] != after[spec]}
    reading = {spec for spec in before if "variance" in spec.split()}  # the step's blocks
    assert {"variance", "stamp variance"} <= changed <= reading
    assert "| 7.5 (" in after["variance"] and "feedfacecafe" in after["stamp variance"]


def test_a_block_needs_a_known_renderer_and_its_end(tmp_path):
    page = tmp_path / "page.md"
    with pytest.raises(SystemExit, match="no renderer 'nothing'"):
        render.render_text("<!-- render: nothing -->\n<!-- /render -->\n", page, {})
    with pytest.raises(SystemExit, match="needs one"):
        render.render_text("<!-- render: x -->\n", page, {"x": lambda ctx: "y"})


def test_blocks_get_the_stamps_they_read_and_inline_values_do_not(tmp_path):
    (tmp_path / "results" / "s").mkdir(parents=True)
    (tmp_path / "results" / "s" / "run.json").write_text(json.dumps(
        {"step": "s", "commit": "0123456789ab", "uncommitted": ["grace/x.py"],
         "date": "2026-01-02", "load": {"before": 1.5, "after": 2.0}, "commands": ["c"]}))
    (tmp_path / "results" / "s" / "bench.json").write_text('[{"v": 3}]')
    registry = {"v": lambda ctx: str(ctx.step("s").json()[0]["v"])}
    page = tmp_path / "docs" / "p.md"
    out = render.render_text("a <!-- render: v --><!-- /render --> b\n"
                             "<!-- render: v -->\n<!-- /render -->\n", page, registry, tmp_path)
    assert out.startswith("a <!-- render: v -->3<!-- /render --> b\n")
    assert ("<sub>Rendered from [s](../results/s/run.json) at `0123456789ab` with uncommitted "
            "changes to grace/x.py, 2026-01-02, load average 1.5 before, 2 after.</sub>") in out


@pytest.mark.slow
def test_stamp_names_the_commit_and_changes_that_could_alter_a_number(tmp_path):
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    paths = ("code.py", "results/script.py", "results/old/out.txt", "docs/page.md",
             "tests/test_x.py", "results/renderers/r.py")
    for path in paths:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    stamp.begin("lgc", tmp_path)
    stamp.command("lgc", ["gracecomm-bench", "methods=[a, b]"], tmp_path)
    stamp.end("lgc", tmp_path)
    stamped = json.loads((tmp_path / "results" / "lgc" / "run.json").read_text())
    assert stamped["commit"] == git("rev-parse", "--short=12", "HEAD")
    assert stamped["uncommitted"] == []
    assert stamped["commands"] == ["gracecomm-bench 'methods=[a, b]'"]
    assert stamped["load"]["after"] is not None
    for path in paths:
        (tmp_path / path).write_text("x = 2\n")
    (tmp_path / "grace").mkdir()
    (tmp_path / "grace" / "new.py").write_text("")
    stamp.begin("lgc", tmp_path)
    stamped = json.loads((tmp_path / "results" / "lgc.new" / "run.json").read_text())
    assert stamped["uncommitted"] == ["code.py", "grace/new.py", "results/script.py"]
    assert stamped["commands"] == []  # begin starts afresh


def test_a_step_replaces_its_stored_outputs_only_when_it_ends(tmp_path, monkeypatch):
    """`stamp.py begin` starts results/STEP.new/; only `end` puts it in place of
    results/STEP/, so a step that fails in between leaves the stored outputs as they were."""
    monkeypatch.setattr(stamp, "commit", lambda root: "0123456789ab")
    monkeypatch.setattr(stamp, "uncommitted_changes", lambda root: [])
    stored = tmp_path / "results" / "s"
    stored.mkdir(parents=True)
    (stored / "out.txt").write_text("old\n")
    (stored / "run.json").write_text('{"step": "s"}\n')
    stamp.begin("s", tmp_path)
    stamp.command("s", ["tool", "--out", "results/s.new/out.txt"], tmp_path)
    (tmp_path / "results" / "s.new" / "out.txt").write_text("partial\n")
    # the step fails here: no `end`
    assert (stored / "out.txt").read_text() == "old\n"
    assert json.loads((stored / "run.json").read_text()) == {"step": "s"}
    stamp.begin("s", tmp_path)  # a second try starts afresh
    assert not (tmp_path / "results" / "s.new" / "out.txt").exists()
    stamp.command("s", ["tool", "--out", "results/s.new/out.txt"], tmp_path)
    (tmp_path / "results" / "s.new" / "out.txt").write_text("new\n")
    stamp.end("s", tmp_path)
    assert (stored / "out.txt").read_text() == "new\n"
    stamped = json.loads((stored / "run.json").read_text())
    assert stamped["commands"] == ["tool --out results/s/out.txt"]  # as stored
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["s"]


def test_reproduce_writes_only_into_the_steps_staging_folder():
    """Every output path of reproduce.sh's steps is under $new (results/STEP.new/): none
    names results/STEP/ itself, except another step's stored output that a step reads."""
    writes = re.findall(r"(?:>|tee|cp .*?) +\"?(results/\w+/[^\s\"]*)", SCRIPT.read_text())
    assert writes == []


@pytest.mark.slow
def test_a_failed_step_leaves_its_stored_outputs_and_the_check_passes(tmp_path):
    """reproduce.sh with a `gracecomm-bench` that prints a table and fails: the step stops,
    results/STEP/ is as committed, and `--check` passes; the partial outputs stay in
    results/STEP.new/."""
    root = tmp_path / "repo"  # a clone of HEAD, with the history the footers count from
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(root)], check=True,
                   capture_output=True)
    for script in ("reproduce.sh", "stamp.py"):  # the working tree's, as tested
        (root / "results" / script).write_text((ROOT / "results" / script).read_text())
    stored = root / "results" / "bench_fig10"
    before = {p.name: p.read_bytes() for p in stored.iterdir()}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gracecomm-bench"
    fake.write_text("#!/bin/sh\necho '| method | total_s |'\nexit 1\n")
    fake.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path}
    done = subprocess.run(["bash", "results/reproduce.sh", "bench_fig10"], cwd=root,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert {p.name: p.read_bytes() for p in stored.iterdir()} == before
    assert (root / "results" / "bench_fig10.new" / "bench.txt").read_text() == (
        "| method | total_s |\n")
    check = subprocess.run(["bash", "results/reproduce.sh", "--check"], cwd=root,
                           capture_output=True, text=True, timeout=300, env=env)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


@pytest.mark.slow
def test_the_sidco_bound_script_runs():
    """`python results/sidco_bound.py` (the results page's floor for SIDCo-E on heavy tails)
    still runs against the kernels it drives, on a small tensor."""
    done = subprocess.run([sys.executable, str(ROOT / "results" / "sidco_bound.py"),
                           "--numel", "1048576", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| floor: the cheapest of (a)-(c) and decompression |" in done.stdout


def test_a_key_names_its_spec_once_at_the_bottom_of_the_page(tmp_path):
    """``VALUE<!--KEY-->`` and ``<!--KEY-->VALUE<!--/-->`` render the SPEC that the page's
    keys comment gives KEY; a value of several words may be wrapped, a fenced example is not
    a mark, and a key undefined or unused, or a word mark given several words, is an error."""
    registry = {"v": lambda ctx, x: x.replace("_", " ")}
    page = tmp_path / "p.md"
    keys = "\n<!-- render keys (results/render.py):\na: v 3\nb: v 1_to_2\n-->\n"
    text = ("It took 9<!--a--> ms (<!--b-->5\n  to 6<!--/-->), again 9<!--a-->.\n\n"
            "```\nshown 7<!--c--> <!-- render: w -->\n```\n" + keys)
    out = render.render_text(text, page, registry)
    assert out.startswith("It took 3<!--a--> ms (<!--b-->1 to 2<!--/-->), again 3<!--a-->.")
    wrapped = out.replace("1 to 2", "1\n  to 2")
    assert render.render_text(wrapped, page, registry) == wrapped
    assert [(m.key, m.spec, m.body) for m in render.marks(out, page)] == [
        ("a", "v 3", "3"), ("b", "v 1_to_2", "1 to 2"), ("a", "v 3", "3")]
    with pytest.raises(SystemExit, match="key 'c' is not defined"):
        render.render_text("4<!--c-->\n" + keys, page, registry)
    with pytest.raises(SystemExit, match="defined but not used: b"):
        render.render_text("4<!--a-->\n" + keys, page, registry)
    with pytest.raises(SystemExit, match="not one word: write it <!--b-->VALUE<!--/-->"):
        render.render_text("4<!--a--> 5<!--b-->\n" + keys, page, registry)
    with pytest.raises(SystemExit, match="closes no"):
        render.render_text("<!--/--> 4<!--a--> <!--b-->1 to 2<!--/-->\n" + keys, page, registry)


def test_every_step_declares_the_code_it_measures():
    spec = importlib.util.spec_from_file_location("results_measures",
                                                  ROOT / "results" / "measures.py")
    measures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measures)
    assert sorted(measures.MEASURES) == sorted(default_steps())
    for step, paths in measures.MEASURES.items():
        assert paths, step
        for path in paths:
            assert (ROOT / path).exists(), f"{step}: {path} does not exist"


def test_a_footer_says_how_many_commits_changed_the_measured_code(monkeypatch):
    real = load("render")  # not pinned: its staleness reads later_commits
    counts = {"a": 0, "b": 1, "c": 7, "d": None}
    monkeypatch.setattr(real, "later_commits", lambda commit, paths: counts[commit])
    notes = {c: real.staleness("first_run", c) for c in counts}
    assert notes == {
        "a": "", "b": " (**stale**: 1 later commit changes the code it measures, "
        "results/measures.py)",
        "c": " (**stale**: 7 later commits change the code it measures, results/measures.py)",
        "d": " (whether the code it measures changed since is unknown: that commit is not in "
        "this history)"}
    assert "not declared" in real.staleness("no_such_step", "a")


@pytest.mark.slow
def test_later_commits_come_from_the_history_of_the_declared_paths():
    real = load("render")

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()

    if git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone has no history to count")
    paths = ("grace/",)
    last = git("log", "-1", "--no-merges", "--format=%H", "--", *paths)
    assert real.later_commits(git("rev-parse", "HEAD"), paths) == 0
    assert real.later_commits(f"{last}~1", paths) >= 1
    assert real.later_commits("0" * 12, paths) is None  # not in this history: unknown
