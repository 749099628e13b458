"""README.md and the pages of docs/ quote measurements, never copy them (issue 32): a number
that a run measured is rendered from the run's stored output (a ``<!-- render: ... -->``
block, results/render.py) or left to the page that holds it. This test flags a
measured-looking number outside the rendered blocks: a decimal with a unit of time, size,
speed or share (``5.5 ms``, ``12.0 reads``, ``49.8x``, ``3.1 KB``, ``0.3465%``, ``2.4
points``) or an accuracy written as ``0.9xx``. Integers (sizes, defaults, counts) and
command-line values (``ratio=0.001``) are not flagged. What is allowed outside the blocks is
listed in ``ALLOWED`` with its reason: a paper's figure, or a value a definition fixes.
"""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEASURED = re.compile(
    r"(?<![\w.=/-])(?:\d+\.\d+ ?(?:ms|µs|us|s|×|x|reads?|KB|MB|GB|KiB|MiB|%|points?)(?![\w/])"
    r"|0\.9\d{2,3}(?!\d))")

# page: {number as written: why it is not a measurement of this project}
ALLOWED = {
    "lgc.md": dict.fromkeys(("3.19x", "2.30x", "8.62x", "17.0x", "5.71x", "8.10x"),
                            "the paper's Table VI")
    | {"0.017 MB": "the paper's leader row", "0.026 MB": "the paper's latent, from its sizes",
       "0.1%": "the paper's α", "0.8x": "the bound a test asserts"},
    "deepreduce.md": dict.fromkeys(("8.466%", "8.143%"), "the thesis's Tables 3-4"),
    "sparsifiers.md": dict.fromkeys(("25.1%", "6.3%", "1.58%", "0.40%"),
                                    "the warm-up formula's densities")
    | {"0.1%": "a ratio"},
    "experiments.md": {"0.1%": "the sidco experiment's density"},
}


def _render_module():
    spec = importlib.util.spec_from_file_location("results_render", ROOT / "results" / "render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


MARKER = _render_module().MARKER


def measured(text: str) -> list[tuple[int, str]]:
    """(line, number) of every measured-looking number of `text` outside rendered blocks."""
    bare = MARKER.sub(lambda m: "\n" * m[0].count("\n"), text)
    return [(i, m[0]) for i, line in enumerate(bare.splitlines(), 1)
            for m in MEASURED.finditer(line)]


def test_the_pages_quote_measurements_from_stored_outputs():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{page.name}:{line}: {number}"
             for page in pages for line, number in measured(page.read_text(encoding="utf-8"))
             if number not in ALLOWED.get(page.name, {})]
    assert not found, ("numbers copied by hand: render them from a stored output "
                       "(results/renderers/values.py) or link to where they are:\n"
                       + "\n".join(found))


def test_the_check_flags_copied_numbers_and_skips_rendered_ones():
    text = ("took 5.5 ms on fresh pages, 12.0 reads, 49.8x fewer, 3.1 KB, 0.3465% of dense, "
            "ends at 0.9889\n"
            "<!-- render: value s f x '{:.1f}' -->2.3<!-- /render --> ms, and\n"
            "<!-- render: t -->\n| 4.4 ms | 0.983 |\n<!-- /render -->\n"
            "`compressor.ratio=0.001` on 2 ranks, 20 epochs, 4 MiB, 3x3 convolutions\n")
    assert measured(text) == [(1, "5.5 ms"), (1, "12.0 reads"), (1, "49.8x"), (1, "3.1 KB"),
                              (1, "0.3465%"), (1, "0.9889")]


def test_a_printed_summary_keeps_bytes_and_accuracy_and_masks_times(tmp_path):
    """The `summary` renderer (README's first run): the run's own printout from its stored
    summary, with every time and speedup as '…' and nothing else changed."""
    render = _render_module()
    registry = render.load_renderers()
    page = tmp_path / "docs" / "p.md"
    text = "<!-- render: summary first_run topk '$ gracecomm-train' -->\n<!-- /render -->\n"
    out = render.render_text(text, page, registry)
    lines = out.split("```console\n", 1)[1].split("```", 1)[0].splitlines()
    assert lines[0] == "$ gracecomm-train"
    assert lines[2].split()[-1] == "0.9833" and "3.1 KB per rank (dense 153.1 KB" in lines[3]
    for line in lines[4:]:  # after the command, the header, the accuracy and the bytes
        assert not re.search(r"\d+\.\d+(?![\d.]*Gbps)", line.replace("49.8x fewer", "")), line
    assert "…x at 0.1Gbps" in out and "49.8x fewer bytes" in out


def test_a_timing_step_not_yet_recorded_says_so(tmp_path):
    render = _render_module()
    registry = render.load_renderers()
    out = render.render_text("<!-- render: bench_step -->\n<!-- /render -->\n",
                             tmp_path / "p.md", registry, root=tmp_path)
    assert "*Not recorded yet*: `bash results/reproduce.sh bench_step`" in out
    assert "Rendered from" not in out
