"""Cross-framework parity: the one engine behind ``flax-ln parity``, the tests and user code.

:func:`compare_modules` / :func:`assert_parity` compare any torch module with its NNX
twin (outputs, and the gradients of every floating input and every parameter, keyed by
torch name) under the one tolerance policy :data:`TOLERANCES`, and name the first
submodule that diverges, and the module whose own computation differs (isolated mode).
Options: forward mode (``mode="jvp"``), float64 attribution (``attribute=True``) and
language-model metrics (``lm_logits=``); :mod:`~flax_ln.parity.reference` stores the torch
side in a file and checks the flax side against it without torch. :mod:`~flax_ln.parity.cases` builds the
book's models on it;
:mod:`~flax_ln.parity.cli` is the ``flax-ln`` command. torch is imported lazily, only
when a comparison runs.
"""

from flax_ln.convert import KeyMap
from flax_ln.parity.engine import (
    HALF_PRECISION,
    TOLERANCES,
    Case,
    Tolerance,
    TrainSpec,
    assert_parity,
    check_case,
    check_training,
    compare_modules,
    compare_tensors,
    lm_metrics,
    relative_error,
    zero_gradient_names,
)
from flax_ln.parity.report import FirstDivergence, Isolation, ParityReport, TensorResult

__all__ = [
    "Case",
    "FirstDivergence",
    "HALF_PRECISION",
    "Isolation",
    "KeyMap",
    "ParityReport",
    "TOLERANCES",
    "TensorResult",
    "Tolerance",
    "TrainSpec",
    "assert_parity",
    "check_case",
    "check_training",
    "compare_modules",
    "compare_tensors",
    "lm_metrics",
    "relative_error",
    "zero_gradient_names",
]
