"""Cross-framework parity: the one engine behind ``flax-ln parity``, the tests and user code.

:mod:`~flax_ln.parity.engine` runs a torch module and its NNX twin on the same weights
and compares every output and gradient; :mod:`~flax_ln.parity.cases` builds the book's
models on it; :mod:`~flax_ln.parity.cli` is the ``flax-ln`` command. torch is imported
lazily, only when a comparison runs.
"""

from flax_ln.parity.engine import (
    TOLERANCES,
    Case,
    CaseReport,
    FirstDivergence,
    TensorResult,
    Tolerance,
    TrainSpec,
    check_case,
    check_training,
    compare,
    relative_error,
)

__all__ = [
    "Case",
    "CaseReport",
    "FirstDivergence",
    "TOLERANCES",
    "TensorResult",
    "Tolerance",
    "TrainSpec",
    "check_case",
    "check_training",
    "compare",
    "relative_error",
]
