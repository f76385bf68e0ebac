"""Rewrite constraints/tools.txt: every package the `dev` and `docs` extras resolve, pinned.

The extras pin the tools themselves (mkdocs, mkdocstrings, ruff, mypy); this file pins what they pull in
(griffelib, Markdown, pymdown-extensions, mypy's own dependencies ...), so that a fresh machine builds the docs
and checks the code with the same versions as every other. Run it from the repository root:

    python constraints/refresh_tools.py      # Python 3.11 or newer (tomllib)

It installs the two extras' requirements alone into a temporary virtual environment (no flax-ln, no runtime
dependencies) and writes what `pip freeze` lists there.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "constraints" / "tools.txt"
EXTRAS = ("dev", "docs")
HEADER = """\
# Every package the `dev` and `docs` extras resolve, pinned (the docs build, ruff, mypy, pre-commit).
# Written by `python constraints/refresh_tools.py`; .ci/run and CONTRIBUTING install with `-c constraints/tools.txt`.
# Meant for the tools: flax-ln's own ranges live in pyproject.toml. In an install that also takes the runtime and test
# dependencies, a package both need (packaging, filelock ...) is held at its pin here too.
"""


def main() -> None:
    """Install the extras' requirements into a fresh venv and write its freeze to :data:`OUT`."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    requirements = [r for name in EXTRAS for r in extras[name]]
    with tempfile.TemporaryDirectory() as tmp:
        venv.create(tmp, with_pip=True)
        python = str(Path(tmp) / "bin" / "python")
        subprocess.run([python, "-m", "pip", "install", "--quiet", *requirements], check=True)
        frozen = subprocess.run([python, "-m", "pip", "freeze"], check=True, capture_output=True, text=True).stdout
    pins = sorted((line for line in frozen.splitlines() if "==" in line), key=str.lower)
    OUT.write_text(HEADER + "\n".join(pins) + "\n")
    print(f"wrote {len(pins)} pins to {OUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
