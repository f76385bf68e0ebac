"""Write constraints/lower-bounds.txt: every lower bound pyproject.toml declares, pinned exactly.

flax-ln's runtime dependencies and its `torch` and `test` extras are ranges (`jax>=0.8.2`); this file pins each to
the bottom of its range, so that `.ci/run` can install exactly the oldest versions flax-ln promises to work with and
run the tests marked `lower_bounds` on them. Run it from the repository root after changing a bound:

    python constraints/refresh_lower.py            # rewrite the file
    python constraints/refresh_lower.py --check    # exit 1 if the file is not what pyproject.toml says (CI)

Every requirement of those groups must have a lower bound (`>=`); a pin (`==`) or an upper bound (`<`) is refused,
since the extras are ranges. A package named in more than one group must have the same bound in each. The `dev` and
`docs` extras are the tools' pins (constraints/tools.txt), not ranges, and are not read. A pyproject.toml it cannot
read (bad TOML, no `[project]`, an extra missing) is a one-line error (exit 1), an unknown flag a usage error (exit
2); neither writes anything.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "constraints" / "lower-bounds.txt"
EXTRAS = ("torch", "test")
HEADER = """\
# The lower bound of every runtime dependency and of the `torch` and `test` extras, pinned: the oldest versions
# flax-ln declares it works with. Written by `python constraints/refresh_lower.py` from pyproject.toml (each bound's
# reason is the comment beside it there); .ci/run checks it is current, installs with `-c constraints/lower-bounds.txt`
# in a second venv and runs `python -m pytest -q -m lower_bounds` there.
"""
_LOWER = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*$")


def _requirement_groups() -> dict[str, Any]:
    """``{group: its requirements}`` of the runtime dependencies and :data:`EXTRAS`, read from pyproject.toml; what
    is missing or malformed there exits with one line saying what and where."""
    path = ROOT / "pyproject.toml"
    try:
        project = tomllib.loads(path.read_text())["project"]
    except OSError as err:
        sys.exit(f"cannot read {path}: {err.strerror}")
    except tomllib.TOMLDecodeError as err:
        sys.exit(f"{path} is not valid TOML: {err}")
    except KeyError:
        sys.exit(f"{path} has no [project] table")
    extras = project.get("optional-dependencies", {})
    groups = {"dependencies": project.get("dependencies")}
    groups |= {f"[{name}]": extras.get(name) if isinstance(extras, dict) else None for name in EXTRAS}
    for group, requirements in groups.items():
        if not isinstance(requirements, list) or not all(isinstance(r, str) for r in requirements):
            where = "[project] dependencies" if group == "dependencies" else f"[project.optional-dependencies] {group}"
            found = "missing" if requirements is None else f"a {type(requirements).__name__}"
            sys.exit(f"{path}: {where} is {found}; expected a list of NAME>=VERSION requirement strings")
    return groups


def lower_bounds() -> dict[str, str]:
    """Each package's declared lower bound, by its normalised name (``orbax-checkpoint``), from pyproject.toml."""
    bounds: dict[str, str] = {}
    for group, requirements in _requirement_groups().items():
        for requirement in requirements:
            match = _LOWER.match(requirement)
            if match is None:
                sys.exit(f"{group}: {requirement!r} is not NAME>=VERSION: each runtime and test requirement is a range")
            name, version = re.sub(r"[-_.]+", "-", match[1]).lower(), match[3]
            if bounds.setdefault(name, version) != version:
                sys.exit(f"{name}: two lower bounds ({bounds[name]} and {version}); declare the same in each group")
    return bounds


def render() -> str:
    """The file's text: the header, then ``name==version`` per package, sorted."""
    return HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(lower_bounds().items()))


def main(argv: list[str] | None = None) -> None:
    """Write :data:`OUT`, or with ``--check`` exit 1 if it differs from what :func:`render` gives."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not what pyproject.toml says")
    check = parser.parse_args(argv).check  # an unknown flag (--chek): a usage error, exit 2, nothing written
    text = render()
    if check:
        if not OUT.exists() or OUT.read_text() != text:
            sys.exit(f"{OUT.relative_to(ROOT)} is stale: run `python constraints/refresh_lower.py` and commit it")
        return
    OUT.write_text(text)
    print(f"wrote {text.count('==')} pins to {OUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
