"""``flax-ln plan``: its arguments and its run, for :func:`flax_ln.cli.main` (torch-free)."""

from flax_ln.plan import add_arguments, main_args

__all__ = ["add_arguments", "main_args"]
