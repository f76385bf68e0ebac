"""The ``flax-ln`` command line: ``flax-ln parity`` (:mod:`.parity`), ``flax-ln report`` (:mod:`.report`) and
``flax-ln plan`` (:mod:`.plan`).

:func:`main` is the console script (and ``python -m flax_ln``). Building the parser and
running ``flax-ln plan`` import neither torch nor the parity engine.
"""

from __future__ import annotations

import argparse

import flax_ln
from flax_ln.cli import parity, plan, report


def build_parser() -> argparse.ArgumentParser:
    """The ``flax-ln`` argument parser, with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="flax-ln",
        description="flax-ln: the book's LayerNorm and Transformer blocks in Flax NNX, "
        "with a PyTorch reference and cross-framework parity checks.",
    )
    parser.add_argument("--version", action="version", version=f"flax-ln {flax_ln.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    parity.add_arguments(
        commands.add_parser(
            "parity",
            help="load the same weights into torch_ref and flax_ln and compare outputs and gradients",
            description="Load the same weights into the PyTorch reference and the Flax port, then compare "
            "every output and the gradient of every input and parameter. Exit code 0 if all are within "
            "tolerance, 1 if any is not (the first submodule whose output diverges is named) or if a --reference "
            "file was altered since it was written, 2 for a usage error, a refused checkpoint or a reference file "
            "that breaks its schema; every argument is checked before anything runs.",
        )
    )
    report.add_arguments(
        commands.add_parser(
            "report",
            help="render a report written by flax-ln parity --json as its HTML page",
            description="Read a report written by flax-ln parity --json and write its self-contained HTML page, "
            "as --html would have (a CI artifact rendered later); needs neither torch nor the models. Exit code 0 "
            "when the page is written, 2 for a usage error or a file that is not a parity report.",
        )
    )
    plan.add_arguments(
        commands.add_parser(
            "plan",
            help="compile a model's training step for a TPU topology on this machine: per-chip memory, fit, roofline",
            description="Compile the examples' training step (or, with --generate, the GPT's KV-cache decode step) "
            "for a TPU topology with libtpu, on any machine and without a TPU, and report the memory per chip, "
            "whether it fits and a roofline bound. Exit code 0 if it fits, 1 if it does not (also when the TPU "
            "compiler refuses it for lack of memory), 2 for a usage error (also: libtpu missing, an op that cannot "
            "run on TPU). The numbers are compiled-for-TPU figures, not measurements on a TPU.",
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``flax-ln`` command: parse ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "plan":
        return plan.main_args(args, "flax-ln plan")
    if args.command == "report":
        return report.main_args(parser, args)
    parity.validate(parser, args)
    mesh = parity.make_mesh(parser, args)
    # The parity engine is imported here, when a comparison runs, and nowhere earlier: `flax-ln plan`
    # and `--help` start without it (plan runs where torch is not installed), and JAX's CPU device
    # count (make_mesh, for --devices) is set before anything the engine does can start JAX's backends.
    from flax_ln.cli.parity_run import run_parity

    return run_parity(args, mesh)
