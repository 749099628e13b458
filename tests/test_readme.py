"""Every sample output in README.md is what the command beside it prints.

The samples are README.md's ```console blocks whose first line starts with ``$ ``: each
``$ `` line is a command (a line ending in ``\\`` continues on the next), and the lines after
it, up to the next command, are what it prints. A block's commands run in order with bash in
one new temporary directory (so a command may use what an earlier one wrote), with the
installed console scripts on PATH and W&B offline. The conventions:

- Compared is the command's standard output when it exits with 0, and its standard error
  when it fails (a refused configuration prints one line there). The other stream is not
  shown: the progress bar and warnings go to standard error.
- Lines are compared exactly, after trailing spaces are dropped and blank lines at the start
  and end of the output are left out.
- ``…`` in a line stands for any text within that line: timings, dates, paths and process
  ids, which change from run to run. A line that is only ``…`` stands for any number of
  lines. Nothing else is masked: accuracies, bytes and compression factors are compared as
  shown.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MASK = "…"
TIMEOUT_S = 600  # one command: a full default training run is the longest


def console_blocks(text: str) -> list[list[tuple[str, list[str]]]]:
    """Every ```console block whose first line is a command: its (command, output lines)."""
    blocks = []
    for body in re.findall(r"^```console\n(.*?)^```", text, flags=re.S | re.M):
        lines = body.splitlines()
        if not lines or not lines[0].startswith("$ "):
            continue
        samples: list[tuple[str, list[str]]] = []
        continued = False
        for line in lines:
            if continued:
                samples[-1] = (samples[-1][0] + "\n" + line, samples[-1][1])
            elif line.startswith("$ "):
                samples.append((line[2:], []))
            else:
                samples[-1][1].append(line)
            continued = line.endswith("\\") and not samples[-1][1]
        blocks.append(samples)
    return blocks


def trimmed(lines: list[str]) -> list[str]:
    lines = [line.rstrip() for line in lines]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def line_pattern(expected: str) -> re.Pattern[str]:
    return re.compile(".*?".join(re.escape(part) for part in expected.split(MASK)))


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether `actual` is `expected` with its masks filled in (module docstring)."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head == MASK:
        return any(matches(rest, actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and bool(line_pattern(head).fullmatch(actual[0])) and matches(
        rest, actual[1:])


def test_the_masks_match_what_they_should():
    assert matches(["a … c", "…", "end"], ["a b b c", "x", "y", "end"])
    assert matches(["…"], []) and matches(["x …"], ["x "])
    assert not matches(["a … c"], ["a b c d"]) and not matches(["1.0x"], ["1.05x"])
    assert not matches(["a"], ["a", "b"]) and not matches(["a", "b"], ["a"])
    blocks = console_blocks("```console\n$ one \\\n  two\nout\n$ three\n```\n"
                            "```console\nnot a command\n```\n")
    assert blocks == [[("one \\\n  two", ["out"]), ("three", [])]]


SAMPLES = console_blocks(README.read_text(encoding="utf-8"))


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("block", SAMPLES, ids=[block[0][0][:60] for block in SAMPLES])
def test_readme_sample_is_what_its_command_prints(block, tmp_path):
    scripts = Path(sys.executable).parent  # the installed console scripts
    env = {**os.environ, "PATH": f"{scripts}{os.pathsep}{os.environ['PATH']}",
           "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("HYDRA_FULL_ERROR", None)
    for command, shown in block:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        printed = proc.stdout if proc.returncode == 0 else proc.stderr
        expected, actual = trimmed(shown), trimmed(printed.splitlines())
        other = proc.stderr if proc.returncode == 0 else proc.stdout
        assert matches(expected, actual), (
            f"README.md: `{command}` (exit code {proc.returncode}) printed\n"
            + "\n".join(actual) + "\n\nbut README.md shows\n" + "\n".join(expected)
            + f"\n\nits other stream ended:\n{other[-1500:]}")
