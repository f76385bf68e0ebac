"""mkdocs hooks for the flax-ln site (named in ``mkdocs.yml``).

The docstrings mark cross-references with Sphinx roles (``:func:`generate```); the Google-style
renderer leaves the role in front of the code span. This hook drops the role, so the page shows
``generate`` as code, as a reader of the source sees it.
"""

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj|const):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    """Remove Sphinx role prefixes left in front of rendered code spans."""
    return _ROLE.sub("", html)
