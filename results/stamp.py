"""Provenance of a results step: the stamp `results/STEP/run.json` that every rendered table
of the step shows (results/render.py).

    python results/stamp.py begin STEP              # starts results/STEP.new/ and its stamp
    python results/stamp.py command STEP -- ARGS... # records one command the step runs
    python results/stamp.py end STEP                # records the load after the step, and puts
                                                    # results/STEP.new/ in place of results/STEP/

`results/reproduce.sh` calls these around every step, and the step writes its outputs into
``results/STEP.new/``: the stored outputs in ``results/STEP/`` are replaced only when the step
got to its end, so a step that fails leaves them (and the pages rendered from them) as they
were. The stamp holds the commit, the date,
the 1-minute load average before and after, the minutes the step took, every command the
step ran (as a shell line), and the uncommitted changes of the working tree that could alter
a number: everything git sees as modified or untracked except Markdown pages, tests, CI
scripts, the stored outputs under results/ and the code that renders them
(results/render.py, results/renderers/); the scripts under results/ that measure (`*.py`,
`*.sh`) do count.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = "run.json"


def can_alter_numbers(path: str) -> bool:
    """Whether a changed file at `path` (relative to the repository) could change a stored
    output: code and configs can; pages, tests, CI scripts, the stored outputs themselves and
    the code that renders them into pages cannot."""
    if path.endswith(".md") or path.startswith(("tests/", ".ci/", "results/render")):
        return False
    return not path.startswith("results/") or path.endswith((".py", ".sh"))


def uncommitted_changes(root: Path = ROOT) -> list[str]:
    """Paths with uncommitted changes (modified, staged or untracked, not ignored) that could
    alter a number."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "-z"],
                         cwd=root, check=True, capture_output=True, text=True).stdout
    paths = []
    entries = iter(out.split("\0"))
    for entry in entries:
        if not entry:
            continue
        status, path = entry[:2], entry[3:]
        if "R" in status or "C" in status:
            next(entries)  # the rename's source follows its target
        paths.append(path)
    return sorted(p for p in paths if can_alter_numbers(p))


def commit(root: Path = ROOT) -> str:
    return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def step_dir(step: str, root: Path = ROOT) -> Path:
    """The stored outputs of `step`: ``results/STEP/``."""
    if not step.replace("_", "").isalnum():
        raise SystemExit(f"stamp: step '{step}' must be a name of letters, digits and '_'")
    return root / "results" / step


def staging_dir(step: str, root: Path = ROOT) -> Path:
    """Where a run of `step` writes its outputs until it succeeds: ``results/STEP.new/``."""
    folder = step_dir(step, root)
    return folder.with_name(folder.name + ".new")


def begin(step: str, root: Path = ROOT) -> None:
    """Start the step's outputs in an empty ``results/STEP.new/`` (what a failed run left
    there goes) and its stamp; ``results/STEP/`` stays as it is."""
    folder = staging_dir(step, root)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    stamp = {"step": step, "commit": commit(root), "uncommitted": uncommitted_changes(root),
             "date": datetime.date.today().isoformat(), "started": time.time(),
             "load": {"before": round(os.getloadavg()[0], 2), "after": None},
             "commands": []}
    write(folder, stamp)


def read(folder: Path) -> dict:
    path = folder / STAMP
    if not path.exists():
        raise SystemExit(f"stamp: {path} does not exist; run 'python results/stamp.py begin "
                         f"{folder.name}' first")
    return json.loads(path.read_text(encoding="utf-8"))


def write(folder: Path, stamp: dict) -> None:
    (folder / STAMP).write_text(json.dumps(stamp, indent=1) + "\n", encoding="utf-8")


def command(step: str, args: Sequence[str], root: Path = ROOT) -> None:
    """Record one command of the step, with the paths it writes as they will be stored."""
    folder = staging_dir(step, root)
    stamp = read(folder)
    line = shlex.join(args).replace(f"results/{folder.name}/", f"results/{step}/")
    stamp["commands"].append(line)
    write(folder, stamp)


def end(step: str, root: Path = ROOT) -> None:
    """Finish the stamp and put ``results/STEP.new/`` in place of ``results/STEP/``."""
    staged = staging_dir(step, root)
    stamp = read(staged)
    stamp["load"]["after"] = round(os.getloadavg()[0], 2)
    if "started" in stamp:
        stamp["minutes"] = round((time.time() - stamp.pop("started")) / 60, 1)
    write(staged, stamp)
    folder = step_dir(step, root)
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    staged.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["begin", "command", "end"])
    parser.add_argument("step")
    parser.add_argument("args", nargs="*", help="command: the command line the step runs")
    args = parser.parse_args(argv)
    if args.action == "command":
        if not args.args:
            parser.error("command: give the command after '--'")
        command(args.step, args.args)
    elif args.args:
        parser.error(f"{args.action} takes no command")
    else:
        {"begin": begin, "end": end}[args.action](args.step)


if __name__ == "__main__":
    main()
