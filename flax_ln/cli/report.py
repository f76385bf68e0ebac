"""``flax-ln report``: a report written by ``flax-ln parity --json``, rendered again (an HTML page) without a rerun.

Reads the JSON back into reports (:func:`flax_ln.parity.report.data.reports_from_json`) and writes the page of
:func:`flax_ln.parity.report.html.render_html`, as ``flax-ln parity --html`` would have: a CI run's JSON artifact
rendered later, where neither torch nor the models are needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from flax_ln.cli.paths import output_file_problem, same_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``flax-ln report``'s arguments."""
    parser.add_argument("json_path", metavar="PATH.json", help="a file written by flax-ln parity --json")
    parser.add_argument(
        "--html", metavar="OUT", required=True, help="write the report's self-contained HTML page to OUT"
    )


def main_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Render ``args.json_path`` to ``args.html``; exit code 0 when written, 2 for an unusable input or output.

    The exit code does not repeat the report's verdict: the page shows it, and the run that wrote the JSON
    already returned it."""
    if not os.path.isfile(args.json_path):
        parser.error(f"{args.json_path!r}: no such file; give a file written by flax-ln parity --json")
    if problem := output_file_problem("--html", args.html):
        parser.error(problem)
    if same_file(args.html, args.json_path):
        parser.error(f"--html {args.html!r} is the JSON file itself; give --html a different file")
    from flax_ln.parity.report.data import reports_from_json
    from flax_ln.parity.report.html import render_html

    try:
        reports = reports_from_json(args.json_path)
    except (ValueError, KeyError, TypeError) as err:  # not JSON, or not a parity report's
        kind = "not JSON" if isinstance(err, json.JSONDecodeError) else f"{type(err).__name__}: {err}"
        print(
            f"flax-ln report: error: {args.json_path!r} is not a flax-ln parity --json report ({kind}); write "
            "one with flax-ln parity --json PATH",
            file=sys.stderr,
        )
        return 2
    with open(args.html, "w", encoding="utf-8") as f:
        f.write(render_html(reports))
    print(f"report: {len(reports)} model(s) from {args.json_path} written to {args.html}")
    return 0
