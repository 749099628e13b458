"""Print the declared minimum version of every dependency of gracecomm (``name>=X`` in
pyproject.toml's dependencies and in the extras that `dev` pulls in) as a pip constraint
``name==X``, so CI installs exactly the floors and tests them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

FLOOR = re.compile(r"^\s*([A-Za-z0-9._-]+)(\[[^\]]*\])?\s*>=\s*([^,;\s]+)\s*(?:;.*)?$")


def floors(pyproject: Path) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    pins: dict[str, str] = {}
    for requirement in requirements:
        if requirement.startswith(f"{project['name']}["):  # an extra pulling in others
            continue
        match = FLOOR.match(requirement)
        if match is None:
            raise SystemExit(f"{pyproject}: requirement {requirement!r} declares no minimum "
                             "version (name>=X); every dependency needs a tested floor")
        pins[match.group(1).lower()] = match.group(3)
    return pins


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    pins = floors(root / "pyproject.toml")
    print("\n".join(f"{name}=={version}" for name, version in pins.items()))
