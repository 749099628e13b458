"""Render the tables and quoted numbers of the results page and docs/ from the stored outputs.

    python results/render.py            # rewrite every rendered block of every page
    python results/render.py --check    # exit 1 with a diff where a page differs from its render

A page marks what is rendered with HTML comments, which neither GitHub nor the site shows.
What renders it is a SPEC, ``NAME ARG...``: NAME a renderer, ARGs its arguments (words, quoted
as in a shell where they hold spaces). A mark gives its SPEC in place or by a key:

- in place, for a block: ``<!-- render: SPEC -->`` and ``<!-- /render -->`` on lines of their
  own around a table (which ends with a footer naming the stamp of every step it read);
- by key, for a value in a sentence: ``VALUE<!--KEY-->`` for a value of one word (the
  characters before the comment, back to a space or one of ``([*`"'``), or
  ``<!--KEY-->VALUE<!--/-->`` for one of several words (which may be wrapped across lines) or
  for a block of prose and a table. The page defines its keys once, at its bottom, in one
  comment of ``KEY: SPEC`` lines::

      <!-- render keys (results/render.py):
      fr1: value first_run topk.json wire_bytes_per_step*0.001 '{:.1f}'
      -->

so that a sentence carries a short key, not its SPEC. Code (fenced blocks, spans) holds no
marks: a page can show the syntax. A renderer is a function
``(ctx, *args) -> str`` listed in the ``RENDERERS`` dict of a module in
``results/renderers/``; it reads nothing but the stored outputs of the steps it asks
`Context.step` for (``results/STEP/``: the step's files and its stamp ``run.json``, written
by ``results/stamp.py``), so a page renders the same on any machine, and a re-run of one
step changes only the values that read it.

A block's footer also says how many later commits change the code its steps measure (the
paths results/measures.py declares for each step; from ``git log``, so the same at the same
commit on any clone with history): a stale block shows it on the page, and
``python results/render.py --stale`` lists the stale steps and fails.

To add one: write the function in a module of ``results/renderers/`` (a new module for a new
family of results), add it to that module's ``RENDERERS``, and mark the page.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
MARKER = re.compile(r"<!-- render: *(?P<spec>[^\n]*?) *-->(?P<body>.*?)<!-- /render -->", re.S)
OPEN, CLOSE = "<!-- render:", "<!-- /render -->"
KEYS = re.compile(r"<!-- render keys[^\n]*\n(?P<defs>.*?)-->\n?", re.S)  # the page's keys
TAG = r"<!--(?P<key>[\w.-]+)-->"
KEYED = re.compile(  # <!--KEY-->VALUE<!--/--> (no comment in VALUE), or WORD<!--KEY-->
    TAG + r"(?P<body>(?:(?!<!--).)*?)<!--/-->"
    r"|(?P<word>[^\s([*`\"'<>]*)<!--(?P<key2>[\w.-]+)-->(?!(?:(?!<!--).)*?<!--/-->)", re.S)
WORD = re.compile(r"[^\s([*`\"'<>]+")

Renderer = Callable[..., str]


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose blocks are rendered: the README, the results page and docs/."""
    return [root / "README.md", root / "results" / "README.md",
            *sorted((root / "docs").rglob("*.md"))]


def load_renderers(folder: Path = RESULTS / "renderers") -> dict[str, Renderer]:
    """Every ``RENDERERS`` entry of the modules in `folder`; a name defined twice is an
    error."""
    registry: dict[str, Renderer] = {}
    for path in sorted(folder.glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"results_renderers_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        for name, fn in getattr(module, "RENDERERS", {}).items():
            if name in registry:
                raise SystemExit(f"render: renderer '{name}' is defined twice (second in {path})")
            registry[name] = fn
    return registry


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table of `rows` (cells as given, turned to str)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in `text`, as rows keyed by the header's cells."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if (lines[i].startswith("|") and i + 1 < len(lines)
                and re.fullmatch(r"\|(-+\|)+", lines[i + 1].replace(" ", ""))):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            i += 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                rows.append(dict(zip(header, cells)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


@dataclass
class Step:
    """The stored outputs of one step of results/reproduce.sh: ``results/NAME/``."""

    name: str
    folder: Path
    stamp: dict[str, Any]

    def path(self, name: str) -> Path:
        path = self.folder / name
        if not path.exists():
            raise FileNotFoundError(f"step '{self.name}' has no stored output {name} in "
                                    f"{self.folder} (bash results/reproduce.sh {self.name})")
        return path

    def text(self, name: str) -> str:
        return self.path(name).read_text(encoding="utf-8")

    def json(self, name: str = "bench.json") -> Any:
        return json.loads(self.text(name))

    def csv(self, name: str = "report.csv") -> list[dict[str, str]]:
        with self.path(name).open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))

    def tables(self, name: str) -> list[list[dict[str, str]]]:
        """The Markdown tables of a stored ``.md`` output."""
        return parse_markdown_tables(self.text(name))


@dataclass
class Context:
    """What a renderer may read: the stored outputs of steps, and the page it renders into
    (for relative links)."""

    page: Path
    root: Path = ROOT
    used: list[str] = field(default_factory=list)
    table = staticmethod(markdown_table)

    def pending(self, name: str) -> str | None:
        """What a block says while step `name` has not run (no stamp), else None: a timing
        step may wait for a machine that nothing else is using."""
        if (self.root / "results" / name / "run.json").exists():
            return None
        return (f"*Not recorded yet*: `bash results/reproduce.sh {name}` measures it (times: "
                "run it on a machine that nothing else is using).")

    def step(self, name: str) -> Step:
        folder = self.root / "results" / name
        stamp_path = folder / "run.json"
        if not stamp_path.exists():
            raise FileNotFoundError(f"step '{name}' has no stamp {stamp_path} "
                                    f"(bash results/reproduce.sh {name})")
        if name not in self.used:
            self.used.append(name)
        return Step(name, folder, json.loads(stamp_path.read_text(encoding="utf-8")))

    def link(self, path: Path) -> str:
        """`path` relative to the page's folder, as a Markdown link target."""
        return Path(os.path.relpath(path, self.page.parent)).as_posix()

    def provenance(self, name: str) -> str:
        """Where step `name`'s outputs come from: commit, date and load, from its stamp, and
        the later commits to the code it measures (`staleness`)."""
        stamp = self.step(name).stamp
        changed = stamp.get("uncommitted") or []
        dirty = f" with uncommitted changes to {', '.join(changed)}" if changed else ""
        return (f"at `{stamp['commit']}`{dirty}, {stamp['date']}, {load(stamp)}"
                f"{staleness(name, stamp['commit'])}")

    def footer(self) -> str:
        """The stamps of the steps read so far, one line."""
        parts = [f"[{name}]({self.link(self.step(name).folder / 'run.json')}) "
                 f"{self.provenance(name)}" for name in self.used]
        return "<sub>Rendered from " + "; ".join(parts) + ".</sub>"


def measured_paths(step: str) -> tuple[str, ...]:
    """The code step `step` measures (results/measures.py; tests/test_results_page.py holds
    every step of results/reproduce.sh to declaring it)."""
    spec = importlib.util.spec_from_file_location("results_measures", RESULTS / "measures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MEASURES.get(step, ())


@cache
def later_commits(commit: str, paths: tuple[str, ...]) -> int | None:
    """The commits after `commit` up to HEAD (merges left out) that change `paths`, in this
    repository's history; None where `commit` is not in it (a shallow clone) or there is no
    git."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    try:
        if git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            return None
        done = git("rev-list", "--no-merges", "--count", f"{commit}..HEAD", "--", *paths)
    except OSError:
        return None
    return int(done.stdout) if done.returncode == 0 else None


def staleness(step: str, commit: str) -> str:
    """What a footer says of the code `step` measures since its stamp's `commit`: nothing
    while unchanged, else how many commits changed it, or that this history cannot tell."""
    paths = measured_paths(step)
    if not paths:
        return " (the code it measures is not declared in results/measures.py)"
    count = later_commits(commit, paths)
    if count is None:
        return (" (whether the code it measures changed since is unknown: that commit is not "
                "in this history)")
    if count == 0:
        return ""
    commits = f"{count} later commits change" if count > 1 else "1 later commit changes"
    return f" (**stale**: {commits} the code it measures, results/measures.py)"


def stale_steps(names: Sequence[str]) -> list[str]:
    """`names` with commits since their stamp to the code they measure, or with no way to
    tell, each with what its footer says."""
    found = []
    for name in sorted(set(names)):
        stamp_path = RESULTS / name / "run.json"
        if stamp_path.exists():
            note = staleness(name, json.loads(stamp_path.read_text(encoding="utf-8"))["commit"])
            if note:
                found.append(f"{name}:{note}")
    return found


def load(stamp: dict[str, Any]) -> str:
    """The load average the stamp recorded (or the words of an older stamp)."""
    if stamp.get("load_text"):
        return f"load average {stamp['load_text']}"
    before, after = stamp["load"]["before"], stamp["load"]["after"]
    if before is None:
        return "load average not recorded"
    return f"load average {before:g} before, {after:g} after" if after is not None else (
        f"load average {before:g} before")


@dataclass
class Mark:
    """One rendered thing of a page: its SPEC, its body as the page has it, its span in the
    page's text (markup included) and the form it is written in."""

    spec: str
    body: str
    start: int
    end: int
    form: str  # "in place", "keyed" (<!--KEY-->BODY<!--/-->) or "word" (BODY<!--KEY-->)
    key: str = ""


def keys(text: str, page: Path) -> dict[str, str]:
    """The page's keys, KEY -> SPEC, from its ``<!-- render keys ... -->`` comment."""
    blocks = KEYS.findall(blank_code(text))
    if len(blocks) > 1:
        raise SystemExit(f"render: {page}: define the keys in one '<!-- render keys' comment, "
                         f"not {len(blocks)}")
    defined: dict[str, str] = {}
    for line in (blocks[0] if blocks else "").splitlines():
        if not line.strip():
            continue
        key, sep, spec = line.partition(":")
        if not sep or not re.fullmatch(r"[\w.-]+", key.strip()) or not spec.strip():
            raise SystemExit(f"render: {page}: a line of the keys must be 'KEY: SPEC' (KEY of "
                             f"letters, digits, '_', '.', '-'), not {line!r}")
        if key.strip() in defined:
            raise SystemExit(f"render: {page}: key '{key.strip()}' is defined twice")
        defined[key.strip()] = spec.strip()
    return defined


def blank_code(text: str) -> str:
    """`text` with its code blanked (fenced blocks and spans; lines kept), so that a page
    can show the marks' syntax."""
    out, fence = [], False
    for line in text.split("\n"):
        starts = line.lstrip().startswith("```")
        out.append(" " * len(line) if fence or starts
                   else re.sub(r"`[^`]*`", lambda m: " " * len(m[0]), line))
        fence ^= starts
    return "\n".join(out)


def marks(text: str, page: Path) -> list[Mark]:
    """Every mark of `text`, in order, each with its SPEC (a key looked up); a key that is
    not defined, a key defined and not used, or an unpaired in-place mark is an error."""
    code = blank_code(text)
    if code.count(OPEN) != code.count(CLOSE) or code.count(OPEN) != len(MARKER.findall(code)):
        raise SystemExit(f"render: {page}: every '{OPEN} NAME -->' needs one '{CLOSE}' after "
                         "it, and they do not nest")
    defined = keys(text, page)
    bare = KEYS.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), code)
    found = [Mark(m["spec"], text[m.start("body"):m.end("body")], m.start(), m.end(),
                  "in place") for m in MARKER.finditer(bare)]
    for m in KEYED.finditer(bare):
        key = m["key"] or m["key2"]
        if key not in defined:
            raise SystemExit(f"render: {page}: key '{key}' is not defined in the page's "
                             "'<!-- render keys' comment")
        body = text[m.start("body"):m.end("body")] if m["key"] else m["word"]
        found.append(Mark(defined[key], body, m.start(), m.end(),
                          "keyed" if m["key"] else "word", key))
    if bare.count("<!--/-->") != sum(mark.form == "keyed" for mark in found):
        raise SystemExit(f"render: {page}: a '<!--/-->' closes no '<!--KEY-->' (nothing but "
                         "the value may stand between them)")
    unused = sorted(set(defined) - {mark.key for mark in found})
    if unused:
        raise SystemExit(f"render: {page}: keys defined but not used: {', '.join(unused)}")
    return sorted(found, key=lambda mark: mark.start)


def render_text(text: str, page: Path, registry: dict[str, Renderer],
                root: Path = ROOT, read: list[str] | None = None) -> str:
    """`text` with every mark rendered again; the steps read are added to `read`."""
    out, at = [], 0
    for mark in marks(text, page):
        name, *args = shlex.split(mark.spec)
        if name not in registry:
            raise SystemExit(f"render: {page}: no renderer '{name}'; renderers: "
                             f"{', '.join(sorted(registry))}")
        ctx = Context(page, root)
        try:
            body = registry[name](ctx, *args).strip("\n")
        except Exception as err:
            raise SystemExit(f"render: {page}: '{mark.spec}' failed: {err}") from err
        if read is not None:
            read.extend(ctx.used)
        if mark.body.startswith("\n"):  # a block: a footer with the stamps it read
            body = f"\n{body}\n\n{ctx.footer()}\n" if ctx.used else f"\n{body}\n"
        if mark.form == "word" and not WORD.fullmatch(body):
            raise SystemExit(f"render: {page}: '{mark.spec}' renders {body!r}, not one word: "
                             f"write it <!--{mark.key}-->VALUE<!--/-->")
        if (mark.form == "keyed" and not mark.body.startswith("\n")
                and mark.body.split() == body.split()):
            body = mark.body  # a value of several words may be wrapped across lines
        out.append(text[at:mark.start])
        out.append({"in place": f"{OPEN} {mark.spec} -->{body}{CLOSE}",
                    "keyed": f"<!--{mark.key}-->{body}<!--/-->",
                    "word": f"{body}<!--{mark.key}-->"}[mark.form])
        at = mark.end
    return "".join(out) + text[at:]


def unrendered(text: str, page: Path = Path("page")) -> str:
    """`text` with every mark and the keys' comment blanked (their lines kept): what a
    reader wrote, not what a renderer did."""
    spans = [(m.start, m.end) for m in marks(text, page)] + [
        m.span() for m in KEYS.finditer(blank_code(text))]
    chars = list(text)
    for start, end in spans:
        chars[start:end] = [c if c == "\n" else " " for c in text[start:end]]
    return "".join(chars)


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; fail if a page differs from its render")
    parser.add_argument("--stale", action="store_true",
                        help="fail if a step the pages read has later commits to the code it "
                        "measures (results/measures.py), listing them")
    parser.add_argument("pages", nargs="*", type=Path, help="pages (default: every page)")
    args = parser.parse_args(argv)
    registry = load_renderers(root / "results" / "renderers")
    stale, read = [], []
    for page in [p.resolve() for p in args.pages] or pages(root):
        if not page.exists():
            continue
        text = page.read_text(encoding="utf-8")
        new = render_text(text, page, registry, root, read)
        if new == text:
            continue
        rel = page.relative_to(root) if page.is_relative_to(root) else page
        if args.check:
            stale.append(str(rel))
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(True), new.splitlines(True), f"{rel} (page)",
                f"{rel} (rendered from the stored outputs)"))
        else:
            page.write_text(new, encoding="utf-8")
            print(f"rendered {rel}")
    outdated = stale_steps(read) if args.stale else []
    if outdated:
        print("steps whose stored outputs predate a change to the code they measure (re-run "
              "them: bash results/reproduce.sh STEP):\n" + "\n".join(outdated))
    if stale:
        raise SystemExit(f"render: {', '.join(stale)} differ from what the stored outputs "
                         "render (a table edited by hand, or a stored output changed without "
                         "re-rendering): run 'python results/render.py' to rewrite them")
    if outdated:
        raise SystemExit(f"render: {len(outdated)} steps are stale")


if __name__ == "__main__":
    main()
