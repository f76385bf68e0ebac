"""Cross-framework parity: the one engine behind ``flax-ln parity``, the tests and user code.

:func:`compare_modules` / :func:`assert_parity` compare any torch module with its NNX
twin, a Linen module (:class:`Linen`) or a function over a parameter pytree (:class:`Function`)
(outputs, and the gradients of every floating input and every parameter, keyed by
torch name) under the one tolerance policy :data:`TOLERANCES`, and name the first
submodule that diverges, and the module whose own computation differs (isolated mode).
Options: forward mode (``mode="jvp"``), float64 attribution (``attribute=True``) and
language-model metrics (``lm_logits=``); :mod:`~flax_ln.parity.reference` stores the torch
side in a file and checks the flax side against it without torch. :mod:`~flax_ln.parity.cases` builds the
book's models on it;
:mod:`~flax_ln.parity.cli` is the ``flax-ln`` command. torch is imported lazily, only
when a comparison runs.
"""

import importlib
from typing import TYPE_CHECKING

from flax_ln.convert import KeyMap

if TYPE_CHECKING:  # the lazily imported names, for type checkers and documentation tools
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
    from flax_ln.parity.flax_side import Function, Linen
    from flax_ln.parity.report import FirstDivergence, Isolation, ParityReport, TensorResult

# Imported on first use (PEP 562), so that ``flax-ln plan``, which lives in the same command
# line, starts without the engine: the names are those of the engine and the report.
_LAZY = {
    **dict.fromkeys(
        [
            "HALF_PRECISION",
            "TOLERANCES",
            "Case",
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
        ],
        "flax_ln.parity.engine",
    ),
    **dict.fromkeys(["FirstDivergence", "Isolation", "ParityReport", "TensorResult"], "flax_ln.parity.report"),
    **dict.fromkeys(["Function", "Linen"], "flax_ln.parity.flax_side"),
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Case",
    "FirstDivergence",
    "Function",
    "HALF_PRECISION",
    "Isolation",
    "KeyMap",
    "Linen",
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
