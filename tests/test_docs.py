"""The docs site and the README, checked without building the site (`mkdocs build --strict`
in .ci/run checks links, anchors and the API reference): the nav of mkdocs.yml against the
pages in docs/, the results page reached through a link rather than a copy, the build hooks
of docs/hooks.py, and the README's length and first commands."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS_PAGE = "results/README.md"


class _Loader(yaml.SafeLoader):
    """mkdocs.yml's own tags (``!!python/object/apply:...``) read as None: only the nav
    matters here."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def nav_entries(node: object) -> list[str]:
    """Every page a nav (nested lists of titles and pages) names."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in nav_entries(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in nav_entries(value)]
    return []


def nav() -> list[str]:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_Loader)
    return nav_entries(config["nav"])


def docs_pages() -> set[str]:
    """The pages written in docs/, relative to it (the results folder is a link, not docs)."""
    return {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")
            if p.relative_to(DOCS).parts[0] != "results"}


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_page_is_in_the_nav_once():
    entries = nav()
    missing = sorted(docs_pages() - set(entries))
    assert missing == [], f"pages in docs/ missing from mkdocs.yml's nav: {missing}"
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    assert repeated == [], f"pages named more than once in the nav: {repeated}"


def test_every_nav_entry_exists():
    missing = [entry for entry in nav() if not (DOCS / entry).is_file()]
    assert missing == [], f"mkdocs.yml's nav names pages that do not exist under docs/: {missing}"


def test_the_results_page_is_in_the_site_through_a_link():
    assert RESULTS_PAGE in nav()
    link = DOCS / "results"
    assert link.is_symlink() and link.resolve() == (ROOT / "results").resolve(), (
        "docs/results must be a symbolic link to ../results, so the results page is not copied")


def test_every_reference_page_names_importable_modules():
    """The API reference pages' ``::: module`` lines name modules that exist (a renamed
    module fails here before it fails the build)."""
    modules = [m for page in (DOCS / "reference").glob("*.md")
               for m in re.findall(r"^::: ([\w.]+)", page.read_text(encoding="utf-8"), re.M)]
    assert modules
    for name in modules:
        importlib.import_module(name)


def test_the_framework_integrations_have_reference_pages():
    """`GraceStrategy`, the Accelerate helper and `GraceTrainer` are in the API reference."""
    pages = {page.name: page.read_text(encoding="utf-8")
             for page in (DOCS / "reference").glob("*.md")}
    for module, name in (("gracecomm.lightning", "GraceStrategy"),
                         ("gracecomm.accelerate", "register_comm_hook"),
                         ("gracecomm.hf", "GraceTrainer")):
        assert any(re.search(rf"^::: {re.escape(module)}$(\n    .*)*{name}", text, re.M)
                   for text in pages.values()), f"no reference page documents {module}.{name}"


@pytest.mark.parametrize(("src_uri", "link", "expected"), [
    ("benchmarks.md", "../results/README.md#11-netbench", "results/README.md#11-netbench"),
    ("results/README.md", "../docs/experiments.md#every-method", "../experiments.md#every-method"),
    ("results/README.md", "bench_sidco.txt", "bench_sidco.txt"),
    ("results/README.md", "lgc/report.md", "lgc/report.md"),
    ("reference/sparsifiers.md", "../sparsifiers.md", "../sparsifiers.md"),
    ("reference/index.md", "../../results/README.md", "../results/README.md"),
    ("design.md", "sweeps.md#groups", "sweeps.md#groups"),
    ("design.md", "../grace/network.py", "../grace/network.py"),  # not in the site: left alone
    ("design.md", "https://pytorch.org/docs/", "https://pytorch.org/docs/"),
])
def test_links_between_repository_folders_point_into_the_site(src_uri, link, expected):
    hooks = load_hooks()
    page = SimpleNamespace(file=SimpleNamespace(src_uri=src_uri))
    text = f"see [there]({link}) and `code`"
    assert hooks.on_page_markdown(text, page, None, None) == f"see [there]({expected}) and `code`"


def published_pages() -> list[tuple[str, Path]]:
    """(place in the site, file) of every Markdown page the site publishes: docs/ and the
    results folder it links, less mkdocs.yml's ``exclude_docs``."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_Loader)
    excluded = {line.strip().lstrip("/") for line in config["exclude_docs"].splitlines()}
    pages = [(str(p.relative_to(DOCS)), p) for p in sorted(DOCS.rglob("*.md"))
             if p.relative_to(DOCS).parts[0] != "results"]
    pages += [(str(p.relative_to(ROOT)), p) for p in sorted((ROOT / "results").rglob("*.md"))]
    return [(uri, p) for uri, p in pages if uri not in excluded]


def test_every_published_table_follows_a_blank_line():
    """Python-Markdown reads a table only after a blank line (GitHub also without one): no
    page, as the hooks hand it to MkDocs, has a table's first line (a ``|`` line followed by
    its ``|---|`` rule) directly after a line of text, outside fenced code."""
    hooks = load_hooks()
    glued = []
    for uri, path in published_pages():
        page = SimpleNamespace(file=SimpleNamespace(src_uri=uri))
        lines = hooks.on_page_markdown(path.read_text(encoding="utf-8"), page, None,
                                       None).split("\n")
        fenced = False
        for i in range(1, len(lines) - 1):
            if lines[i].lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            if (not fenced and lines[i].lstrip().startswith("|") and lines[i - 1].strip()
                    and not lines[i - 1].lstrip().startswith("|")
                    and re.fullmatch(r"\s*\|?[-:| ]*-[-:| ]*", lines[i + 1])):
                glued.append(f"{uri}:{i + 1}: {lines[i - 1][:60]!r}")
    assert len(published_pages()) > 50
    assert glued == [], f"tables directly after a line of text: {glued}"


def test_a_table_after_text_is_set_apart_and_code_is_left_alone():
    hooks = load_hooks()
    text = "300 vectors\n| a | b |\n|---|---|\n| 1 | 2 |\n```\nx\n| c |\n|---|\n```"
    assert hooks.set_tables_apart(text) == text.replace("vectors\n", "vectors\n\n", 1)


def test_the_api_tree_lays_out_the_package_as_installed(tmp_path, monkeypatch):
    """griffe reads the package from ``build/api``: every package of pyproject.toml is a
    folder there with its modules, the mapped subpackages included."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    hooks = load_hooks()
    monkeypatch.setattr(hooks, "API_TREE", tmp_path / "api")
    hooks.on_startup(command="build", dirty=False)
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]
    for package in packages:
        folder = tmp_path.joinpath("api", *package.split("."))
        assert (folder / "__init__.py").is_file(), package
    pipeline = tmp_path / "api" / "gracecomm" / "pipeline.py"
    assert pipeline.resolve() == ROOT / "grace" / "pipeline.py"
    assert (tmp_path / "api" / "gracecomm" / "compressors" / "topk.py").is_file()


def test_readme_is_short_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    first, second = blocks[0].strip(), blocks[1].strip()
    assert first.endswith("pip install -e . && gracecomm-train"), first
    assert second in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines(), (
        "the README's test command must be the line .ci/run runs")
    assert 'python -m pytest -m "not slow" -n 2 --dist worksteal' in readme
    assert "\n## First run\n" in readme
