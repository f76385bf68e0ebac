"""The ``flax-ln`` command line."""

from __future__ import annotations

import argparse
import sys

import flax_ln


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flax-ln",
        description="flax-ln: the book's LayerNorm and Transformer blocks in Flax NNX, "
        "with a PyTorch reference and cross-framework parity checks.",
    )
    parser.add_argument("--version", action="version", version=f"flax-ln {flax_ln.__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
