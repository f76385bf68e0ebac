"""The flax-ln pytest plugin: ``pytest --parity-html DIR`` keeps the HTML page of every failing ``assert_parity``.

Installed with flax-ln (the ``pytest11`` entry point ``flax_ln``), or loaded with ``pytest -p flax_ln.pytest_plugin``.
With ``--parity-html DIR``, every :func:`flax_ln.parity.assert_parity` that fails inside a test writes the report's
page (:meth:`flax_ln.parity.ParityReport.to_html`) to ``DIR/<test id>.html`` (the node id made a safe file name)
and names that path in its assertion message. A page never overwrites another: a name already taken (a further
failure in the same test, another test whose id reads the same as a file name, ``test[a/b]`` and ``test[a_b]``, or
an earlier run) gets ``-2``, ``-3``, ...; each name is claimed by creating the file exclusively, so that parallel
workers cannot take the same one. A folder removed during the run is made again.

The option reaches :func:`assert_parity` through two environment variables, set for the run and restored after it,
so that it holds in pytest-xdist's workers too (each configures this plugin with the same options). This module
imports only the standard library: pytest loads it before any test, and it must not start torch or JAX.
"""

from __future__ import annotations

import itertools
import os
import re

DIR_VARIABLE = "FLAX_LN_PARITY_HTML_DIR"  # where failing comparisons' pages go (set by --parity-html)
TEST_VARIABLE = "FLAX_LN_PARITY_HTML_TEST"  # the node id of the test running now
_saved: dict[str, str | None] = {}


def pytest_addoption(parser) -> None:
    """``--parity-html DIR``."""
    parser.getgroup("flax-ln").addoption(
        "--parity-html",
        metavar="DIR",
        default=None,
        help="write the HTML report of every failing flax_ln assert_parity to DIR/<test id>.html (DIR is created)",
    )


def pytest_configure(config) -> None:
    """Create ``DIR`` and tell :func:`flax_ln.parity.assert_parity` about it."""
    folder = config.getoption("parity_html", None)
    if folder is None:
        return
    folder = os.path.abspath(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        import pytest

        raise pytest.UsageError(
            f"--parity-html {folder!r} cannot be created ({err.strerror or err}); give a folder path that can be"
        ) from None
    _set(DIR_VARIABLE, folder)


def pytest_unconfigure(config) -> None:
    """Restore the environment as it was before the run."""
    for name, value in _saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved.clear()


def pytest_runtest_logstart(nodeid: str, location) -> None:
    """The test about to run (setup, call and teardown): its pages are named after it."""
    if DIR_VARIABLE in _saved:
        _set(TEST_VARIABLE, nodeid)


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    """Outside a test, a failing comparison is named after no test."""
    if DIR_VARIABLE in _saved:
        os.environ.pop(TEST_VARIABLE, None)


def _set(name: str, value: str) -> None:
    _saved.setdefault(name, os.environ.get(name))
    os.environ[name] = value


def safe_file_name(nodeid: str) -> str:
    """A test's node id as a file name: every run of characters other than letters, digits, ``.``, ``-`` and
    ``_`` becomes one ``_``, the ends trimmed (``tests/test_x.py::test_y[a]`` -> ``tests_test_x.py_test_y_a``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid).strip("_")[:200] or "test"


def page_path() -> str | None:
    """Where the page of a comparison failing now goes, the file created (empty) so that the name is this page's:
    ``DIR/<test id>.html`` under ``--parity-html DIR``, or ``<test id>-2.html``, ... when that name is taken;
    ``None`` without the option. ``OSError`` when the folder cannot be made or written."""
    folder = os.environ.get(DIR_VARIABLE)
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)  # removed since the run began: made again
    name = safe_file_name(os.environ.get(TEST_VARIABLE) or "outside-a-test")
    for count in itertools.count(1):
        path = os.path.join(folder, name + ("" if count == 1 else f"-{count}") + ".html")
        try:
            open(path, "x").close()  # claimed: exclusive creation fails when another test or worker has it
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")  # itertools.count never ends
