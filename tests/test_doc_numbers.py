"""README.md, the results page and the pages of docs/ quote measurements, never copy them
(issue 32): a number that a run measured is rendered from the run's stored output (a mark
of results/render.py: ``VALUE<!--KEY-->``, ``<!--KEY-->VALUE<!--/-->`` or a
``<!-- render: ... -->`` block) or left to the page that holds it. This test flags a
measured-looking number outside the rendered marks: a decimal with a unit of
time, size, speed or share (``5.5 ms``, ``12.0 reads``, ``49.8x``, ``3.1 KB``, ``0.3465%``,
``2.4 points``), signed (``-1.3 points``) or as a range (``2.0-4.1x``, ``1-2.5 ms``), or an
accuracy written as ``0.9xx``. Integers (sizes, defaults, counts) and command-line values
(``ratio=0.001``) are not flagged. What is allowed outside the blocks is listed in
``ALLOWED`` with its reason: a paper's figure, a target or a value a definition fixes.
"""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MEASURED = re.compile(
    r"(?<![\w.=/-])(?:(?:[-+]?\d+\.\d+(?:-\d+(?:\.\d+)?)?|\d+-\d+\.\d+)"
    r" ?(?:ms|µs|us|s|×|x|reads?|KB|MB|GB|KiB|MiB|%|points?)(?![\w/])"
    r"|0\.9\d{2,3}(?!\d))")

# page (from the repository's root): {number as written: why it is not a measurement here}
TABLE_VI = "the LGC paper's Table VI"
ALLOWED = {
    "docs/lgc.md": dict.fromkeys(("3.19x", "2.30x", "8.62x", "17.0x", "5.71x", "8.10x"),
                                 TABLE_VI)
    | {"0.017 MB": "the paper's leader row", "0.026 MB": "the paper's latent, from its sizes",
       "0.1%": "the paper's α", "0.8x": "the bound a test asserts"},
    "docs/deepreduce.md": dict.fromkeys(("8.466%", "8.143%"), "the thesis's Tables 3-4"),
    "docs/sparsifiers.md": dict.fromkeys(("25.1%", "6.3%", "1.58%", "0.40%"),
                                         "the warm-up formula's densities")
    | {"0.1%": "a ratio"},
    "docs/experiments.md": {"0.1%": "the sidco experiment's density"},
    "docs/contributing.md": {"153.1 KB": "an example of the marks' syntax, in code"},
    "results/README.md": dict.fromkeys(("3.19x", "2.30x", "8.62x", "17.0x", "5.71x", "8.10x"),
                                       TABLE_VI)
    | dict.fromkeys(("8.466%", "8.143%"), "the thesis's Tables 3-4, at FPR 0.02")
    | {"0.1%": "a density the experiments set (and the LGC paper's α)",
       "2.8 points": "the thesis's Random-1% below its Top-1% (Kostopoulou 2020, Table 5)",
       "7.6x": "SIDCo's end-to-end speed-up over Top-k (Abdelmoniem et al., Sec. 4.2)",
       "3.2-3.6x": "natural compression's Table 1 as printed (Horváth et al.)",
       "0.017 MB": "the LGC paper's ResNet-50 leader row",
       "0.026 MB": "the LGC paper's latent at its α, from its sizes",
       "8.347%": "the thesis's Table 2 row printed at FPR 0.015",
       "1.8x": "the LGC specification's target for RAR's cr_total (a limit)",
       "1.5x": "netbench's target for fp16 at 100 Mbit/s (a limit)"},
}


def _render_module():
    spec = importlib.util.spec_from_file_location("results_render", ROOT / "results" / "render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


RENDER = _render_module()


def measured(text: str) -> list[tuple[int, str]]:
    """(line, number) of every measured-looking number of `text` outside rendered marks."""
    bare = RENDER.unrendered(text)
    return [(i, m[0]) for i, line in enumerate(bare.splitlines(), 1)
            for m in MEASURED.finditer(line)]


def test_the_pages_quote_measurements_from_stored_outputs():
    found = [f"{name}:{line}: {number}"
             for page in RENDER.pages()
             for name in [page.relative_to(ROOT).as_posix()]
             for line, number in measured(page.read_text(encoding="utf-8"))
             if number not in ALLOWED.get(name, {})]
    assert not found, ("numbers copied by hand: render them from a stored output "
                       "(results/renderers/values.py) or link to where they are:\n"
                       + "\n".join(found))


def test_the_check_flags_copied_numbers_and_skips_rendered_ones():
    text = ("took 5.5 ms on fresh pages, 12.0 reads, 49.8x fewer, 3.1 KB, 0.3465% of dense, "
            "ends at 0.9889\n"
            "(-1.3 points), 2.0-4.1x one read, 1-2.5 ms, +1.0 KB, lr 0.05, fpr 0.001-0.03\n"
            "<!-- render: value s f x '{:.1f}' -->2.3<!-- /render --> ms, and\n"
            "<!-- render: t -->\n| 4.4 ms | 0.983 |\n<!-- /render -->\n"
            "`compressor.ratio=0.001` on 2 ranks, 20 epochs, 4 MiB, 3x3 convolutions,\n"
            "keyed: 2.5<!--a--> ms, <!--b-->1.5 ms to 2.5 ms<!--/-->\n"
            "<!-- render keys (results/render.py):\na: v 0.5 ms\nb: w 1.5 ms\n-->\n")
    assert measured(text) == [(1, "5.5 ms"), (1, "12.0 reads"), (1, "49.8x"), (1, "3.1 KB"),
                              (1, "0.3465%"), (1, "0.9889"), (2, "-1.3 points"),
                              (2, "2.0-4.1x"), (2, "1-2.5 ms"), (2, "+1.0 KB")]


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


def test_inline_means_and_comparisons_of_records(tmp_path):
    """`mean`, `compare` and `KEY!=VALUE` (results/renderers/values.py) on a step's records."""
    step = tmp_path / "results" / "s"
    step.mkdir(parents=True)
    (step / "run.json").write_text(json.dumps(
        {"step": "s", "commit": "0123456789ab", "date": "2026-01-02",
         "load": {"before": 1.0, "after": 1.0}, "commands": ["c"]}))
    (step / "r.json").write_text(json.dumps([
        {"run": "dense", "acc": 0.99, "bytes": 1000, "proj": 1.0},
        {"run": "topk", "acc": 0.97, "bytes": 20, "proj": 2.2},
        {"run": "dgc", "acc": 0.96, "bytes": 25, "proj": 1.8}]))
    (tmp_path / "results" / "t").symlink_to(step)  # a second step with the same records
    registry = RENDER.load_renderers()

    def inline(spec):
        out = RENDER.render_text(f"<!-- render: {spec} --><!-- /render -->",
                                 tmp_path / "p.md", registry, root=tmp_path)
        return out.split("-->", 1)[1].rsplit("<!--", 1)[0]

    assert inline("range s r.json acc '{:.2f}' run!=dense") == "0.96-0.97"
    assert inline("mean s r.json acc '{:.3f}' run!=dense|dgc") == "0.970"
    assert inline("compare - '{:+.1f}' s r.json acc*100 run=topk vs run=dense") == "-2.0"
    assert inline("compare % '{:+.0%}' s r.json bytes run=topk vs run=dgc") == "-20%"
    assert inline("compare / '{:.0f}' s r.json bytes run=dense vs t r.json bytes run=topk") == "50"
    # several records against one, and each record's field against another of its own
    assert inline("compare - '{:+.2f}' s r.json acc run!=dense vs run=dense") == "-0.03 to -0.02"
    assert inline("compare / '{:.1f}' s r.json proj run!=dense vs acc") == "1.9-2.3"
    with pytest.raises(SystemExit, match="3 records of s/r.json"):
        inline("compare - '{:.1f}' s r.json acc run=topk vs acc run!=none")
    with pytest.raises(SystemExit, match="after 'vs' name FIELD or STEP FILE FIELD"):
        inline("compare - '{:.1f}' s r.json acc run=topk vs s r.json run=dense")
    with pytest.raises(SystemExit, match="OP one of"):
        inline("compare * '{:.1f}' s r.json acc run=topk vs run=dense")


# Issue 40: a page's sources read as prose. In a paragraph that carries a number, the marks
# that render it (results/render.py) may take at most this share of the raw characters.
MARKUP_LIMIT = 0.15
MARKUP = re.compile(r"<!-- render: [^\n]*?-->|<!-- /render -->|<!--[\w.-]+-->|<!--/-->")


def prose_paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of every paragraph of `text`: lines between blank lines outside
    code fences, less the page's keys comment. A table or a code block (once the lines
    that hold nothing but a mark are set aside) is not prose and is left out."""
    text = RENDER.KEYS.sub(lambda m: "\n" * m[0].count("\n"), text)
    found, lines, start, fence = [], [], 0, False
    for number, line in enumerate(text.splitlines() + [""], 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        if line.strip() or fence:
            start = start or number
            lines.append(line)
            continue
        own = [ln for ln in lines if MARKUP.sub("", ln).strip()]
        if own and not own[0].lstrip().startswith(("|", "```")):
            found.append((start, "\n".join(lines)))
        lines, start = [], 0
    return found


def markup_shares(text: str) -> list[tuple[int, float]]:
    """(first line, share of the characters that are marks, outside code) of every paragraph
    of prose in `text` that carries a number."""
    return [(line, sum(map(len, MARKUP.findall(RENDER.blank_code(para)))) / len(para))
            for line, para in prose_paragraphs(text)
            if re.search(r"\d", MARKUP.sub("", para))]


def test_the_pages_read_as_prose():
    found = [f"{page.relative_to(ROOT).as_posix()}:{line}: {share:.0%} markup"
             for page in RENDER.pages()
             for line, share in markup_shares(page.read_text(encoding="utf-8"))
             if share > MARKUP_LIMIT]
    assert not found, (f"paragraphs over {MARKUP_LIMIT:.0%} markup: give the values keys "
                       "(VALUE<!--KEY--> with 'KEY: SPEC' in the page's '<!-- render keys' "
                       "comment, results/render.py) or put them in a table the prose cites:\n"
                       + "\n".join(found))


def test_the_markup_share_counts_marks_in_prose_and_not_tables_or_keys():
    spec = "<!-- render: value step bench.json quality '{:.2f}' method=sidco_e -->"
    text = (f"SIDCo reaches\n{spec}0.94<!-- /render -->\nhere.\n\n"
            "SIDCo reaches 0.94<!--q--> here, about a tenth of the paragraph in marks.\n\n"
            "No number here <!--n-->met<!--/-->.\n\n"
            f"{spec}\n| a | b |\n|---|---|\n| 1 | 2 |\n<!-- /render -->\n\n"
            "```\n<!--q--> 1 2 3\n```\n\n"
            "<!-- render keys (results/render.py):\nq: value 1 2 3\n-->\n")
    shares = markup_shares(text)
    assert [line for line, _ in shares] == [1, 5]
    assert shares[0][1] > 0.7 > MARKUP_LIMIT > shares[1][1] > 0.1
