"""The API reference covers every public name: each entry of ``flax_ln.__all__`` and
``flax_ln.parity.__all__`` must be rendered by a ``:::`` block in ``docs/api/*.md``.

A name counts as documented when a page has ``::: <package>.<name>`` or a ``::: <package>``
block whose ``members:`` option lists it. The pages are read as text; mkdocs is not run
(CI builds the site with ``mkdocs build --strict``, which fails on a block it cannot resolve).
"""

import re
from pathlib import Path

import pytest

import flax_ln
import flax_ln.parity

API_PAGES = Path(__file__).resolve().parent.parent / "docs" / "api"
_BLOCK = re.compile(r"^:::\s*([\w.]+)\s*$")
_MEMBERS_INLINE = re.compile(r"^\s+members:\s*\[(.*)\]\s*$")
_MEMBERS_START = re.compile(r"^\s+members:\s*$")
_LIST_ITEM = re.compile(r"^\s+-\s*([\w]+)\s*$")


def documented(pages: list[Path]) -> set[str]:
    """Every dotted name the pages render: the ``:::`` identifiers, and ``module.member`` for
    each name in a block's ``members:`` list (inline ``[a, b]`` or one ``- name`` per line)."""
    names: set[str] = set()
    for page in pages:
        block, in_members = None, False
        for line in page.read_text(encoding="utf-8").splitlines():
            if match := _BLOCK.match(line):
                block, in_members = match.group(1), False
                names.add(block)
                continue
            if block is None:
                continue
            if line and not line[0].isspace():  # the block's indented options end here
                block, in_members = None, False
                continue
            if match := _MEMBERS_INLINE.match(line):
                names.update(f"{block}.{m.strip()}" for m in match.group(1).split(",") if m.strip())
            elif _MEMBERS_START.match(line):
                in_members = True
            elif in_members and (match := _LIST_ITEM.match(line)):
                names.add(f"{block}.{match.group(1)}")
            elif line.strip():
                in_members = False
    return names


def test_the_parser_reads_blocks_and_members_lists(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n::: pkg.a\n\n::: pkg\n    options:\n      members:\n        - b\n        - c\n      heading_level: 2\n"
        "\n::: other\n    options:\n      members: [d, e]\n\ntext - f\n",
        encoding="utf-8",
    )
    assert documented([page]) == {"pkg.a", "pkg", "pkg.b", "pkg.c", "other", "other.d", "other.e"}


@pytest.mark.parametrize("package", [flax_ln, flax_ln.parity], ids=lambda p: p.__name__)
def test_every_public_name_is_in_the_api_reference(package):
    pages = sorted(API_PAGES.glob("*.md"))
    assert pages, f"no API reference pages in {API_PAGES}"
    names = documented(pages)
    missing = sorted(n for n in package.__all__ if f"{package.__name__}.{n}" not in names)
    assert not missing, (
        f"{package.__name__}.__all__ names without an API reference entry: {missing}. "
        f"Add a `::: {package.__name__}.<name>` block for each to a page in docs/api/."
    )
