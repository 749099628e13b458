"""MkDocs hooks of this repository's site (`hooks:` in mkdocs.yml; nothing to install).

The site is built from two folders of the repository: the pages in docs/ and the results
page in results/ (docs/results is a symbolic link to it, so the page is not copied). Two
things follow that MkDocs does not do by itself:

- Pages link to each other by their paths in the repository, as GitHub shows them
  (docs/benchmarks.md links ``../results/README.md#...``, results/README.md links
  ``../docs/experiments.md``). `on_page_markdown` rewrites such a link to the target's place
  in the site, where docs/ is the root and results/ sits inside it.
- A table must follow a blank line for Python-Markdown's ``tables`` extension (GitHub
  does not ask for one): a stored output printed as a line of text and then a table
  (results/lgc/bound.md) showed its table as raw ``|...|`` lines. `on_page_markdown` sets
  every table apart (`set_tables_apart`), so a page shows the same tables on both.
- The API reference is read from source by griffe (mkdocstrings-python), which finds
  `gracecomm` in grace/ but not the subpackages that pyproject.toml maps from other folders
  (`[tool.setuptools.package-dir]`: compressors/ is `gracecomm.compressors`, ...).
  `on_startup` lays the package out as it installs, as symbolic links under ``build/api/``,
  which mkdocs.yml gives mkdocstrings as its search path.
"""

from __future__ import annotations

import posixpath
import re
import shutil
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the docs extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
API_TREE = ROOT / "build" / "api"
SITE_FOLDERS = {"docs/": "", "results/": "results/"}  # repository folder -> place in the site
LINK = re.compile(r"(\]\()([^)\s#:]+)(#[^)\s]*)?\)")  # a relative markdown link: ](path#anchor)
TABLE_RULE = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")  # |---|:--:|
FENCE = re.compile(r"^\s*(```|~~~)")


def on_startup(command: str, dirty: bool) -> None:
    """Build ``build/api/gracecomm/`` from pyproject.toml's package-dir mapping: one real
    folder per mapped package, holding links to its folder's files and subfolders."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = pyproject["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(API_TREE, ignore_errors=True)
    for package in sorted(mapping, key=lambda name: name.count(".")):
        folder = ROOT / mapping[package]
        target = API_TREE.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in folder.iterdir():
            if entry.name == "__pycache__" or f"{package}.{entry.name}" in mapping:
                continue
            (target / entry.name).symlink_to(entry)


def site_path(repo_path: str) -> str | None:
    """Where a file of the repository is in the site, or None if it is not part of it."""
    for folder, place in SITE_FOLDERS.items():
        if repo_path.startswith(folder):
            return place + repo_path[len(folder):]
    return None


def repo_path(src_uri: str) -> str:
    """Where a page of the site is in the repository."""
    if src_uri.startswith("results/"):
        return src_uri
    return "docs/" + src_uri


def table_starts(lines: list[str]) -> list[int]:
    """The indices of the lines that start a table (a ``|`` line followed by its rule
    ``|---|``), outside fenced code."""
    starts, fenced = [], False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        elif (not fenced and line.lstrip().startswith("|") and i + 1 < len(lines)
              and "-" in lines[i + 1] and TABLE_RULE.match(lines[i + 1])):
            starts.append(i)
    return starts


def set_tables_apart(markdown: str) -> str:
    """A blank line before every table that directly follows a line of text."""
    lines = markdown.split("\n")
    for i in reversed(table_starts(lines)):
        if i > 0 and lines[i - 1].strip():
            lines.insert(i, "")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Point links written as repository paths at the same files in the site, and set
    tables apart (`set_tables_apart`)."""
    src_dir = posixpath.dirname(page.file.src_uri)
    here = posixpath.dirname(repo_path(page.file.src_uri))

    def rewrite(match: re.Match[str]) -> str:
        link = match.group(2)
        target = site_path(posixpath.normpath(posixpath.join(here, link)))
        if target is None or posixpath.normpath(posixpath.join(src_dir, link)) == target:
            return match.group(0)
        new = posixpath.relpath(target, src_dir or ".")
        return f"{match.group(1)}{new}{match.group(3) or ''})"

    return set_tables_apart(LINK.sub(rewrite, markdown))
