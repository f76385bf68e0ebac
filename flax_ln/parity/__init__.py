"""Cross-framework parity: the one engine behind ``flax-ln parity``, the tests and user code.

:func:`compare_modules` / :func:`assert_parity` compare any torch module with its NNX
twin, a Linen module (:class:`Linen`) or a function over a parameter pytree (:class:`Function`)
(outputs, and the gradients of every floating input and every parameter, keyed by
torch name) under the one tolerance policy :data:`TOLERANCES`, and name the first
submodule that diverges, and the module whose own computation differs (isolated mode).
Options: forward mode (``mode="jvp"``), float64 attribution (``attribute=True``) and
language-model metrics (``lm_logits=``).

The engine lives in rooms, each importing only the rooms below it (``docs/design.md`` draws the map):

* :mod:`.core`: what both sides run (``Call``), the metrics and the tolerance policy, failures, progress, spill;
* :mod:`.records`: each side's recorded submodule calls, which modules pair, and a recorded call replayed;
* :mod:`.islands`: float32 islands in a float64 run, found, lifted or listed, on both sides;
* :mod:`.report`: what a comparison found (``ParityReport``), as JSON, text, chart and HTML page;
* :mod:`.sides`: the torch run and the flax side, one file per kind (NNX, Linen, Equinox, Keras, functions), with their
  registry;
* :mod:`.localize`: the first divergence and isolated mode, once for every kind;
* the comparison itself at the top: :mod:`.compare` (``compare_modules``, ``assert_parity``), :mod:`.stored`
  (``compare_side``: the flax side against a stored ``TorchSide``) and :mod:`.case` (a model with its inputs and
  training step);
* :mod:`.streamed`: ``compare_streamed``, the same comparison stage by stage, for models larger than memory.

The book's models, torch checkpoints and reference files are run on this engine from
:mod:`flax_ln.book`, which the engine does not import; the ``flax-ln`` command is
:mod:`flax_ln.cli`. torch is imported only when a comparison runs: importing this package
does not import it.
"""

from flax_ln._deprecated import alias_modules
from flax_ln.convert import KeyMap
from flax_ln.parity.case import Case, TrainSpec, check_case, check_training
from flax_ln.parity.compare import assert_parity, compare_modules
from flax_ln.parity.core.policy import (
    HALF_PRECISION,
    TOLERANCES,
    TensorResult,
    Tolerance,
    compare_tensors,
    lm_metrics,
    relative_error,
    zero_gradient_names,
)
from flax_ln.parity.report.data import FirstDivergence, Isolation, ParityReport
from flax_ln.parity.sides.equinox import Equinox
from flax_ln.parity.sides.flax import Function, Linen
from flax_ln.parity.sides.keras import Keras
from flax_ln.parity.streamed.compare import compare_streamed
from flax_ln.parity.streamed.sides import parameters_on_meta
from flax_ln.parity.streamed.stages import Stage, Stages

# the modules that moved into rooms in 0.1.x, importable at their old paths (with a warning) until the next minor
alias_modules(
    {
        "flax_ln.parity.call": "flax_ln.parity.core.call",
        "flax_ln.parity.capture": "flax_ln.parity.records.capture",
        "flax_ln.parity.equinox_side": "flax_ln.parity.sides.equinox",
        "flax_ln.parity.failure": "flax_ln.parity.core.failure",
        "flax_ln.parity.flax_side": "flax_ln.parity.sides.flax",
        "flax_ln.parity.function_side": "flax_ln.parity.sides.function",
        "flax_ln.parity.html": "flax_ln.parity.report.html",
        "flax_ln.parity.jax_internals": "flax_ln.parity.islands.jax_internals",
        "flax_ln.parity.jax_islands": "flax_ln.parity.islands.jax",
        "flax_ln.parity.kinds": "flax_ln.parity.sides.kinds",
        "flax_ln.parity.lifting": "flax_ln.parity.islands.lifting",
        "flax_ln.parity.linen_side": "flax_ln.parity.sides.linen",
        "flax_ln.parity.nnx_side": "flax_ln.parity.sides.nnx",
        "flax_ln.parity.pairing": "flax_ln.parity.records.pairing",
        "flax_ln.parity.policy": "flax_ln.parity.core.policy",
        "flax_ln.parity.progress": "flax_ln.parity.core.progress",
        "flax_ln.parity.render": "flax_ln.parity.report.text",
        "flax_ln.parity.replay": "flax_ln.parity.records.replay",
        "flax_ln.parity.report_schema": "flax_ln.parity.report.schema",
        "flax_ln.parity.shared": "flax_ln.parity.sides.shared",
        "flax_ln.parity.spill": "flax_ln.parity.core.spill",
        "flax_ln.parity.split": "flax_ln.parity.sides.split",
        "flax_ln.parity.stages": "flax_ln.parity.streamed.stages",
        "flax_ln.parity.stream_sides": "flax_ln.parity.streamed.sides",
        "flax_ln.parity.tensor_stats": "flax_ln.parity.core.tensor_stats",
        "flax_ln.parity.torch_islands": "flax_ln.parity.islands.torch",
        "flax_ln.parity.torch_side": "flax_ln.parity.sides.torch",
        "flax_ln.parity.tree_side": "flax_ln.parity.sides.tree",
    }
)

__all__ = [
    "Case",
    "FirstDivergence",
    "Equinox",
    "Function",
    "HALF_PRECISION",
    "Isolation",
    "KeyMap",
    "Keras",
    "Linen",
    "ParityReport",
    "Stage",
    "Stages",
    "TOLERANCES",
    "TensorResult",
    "Tolerance",
    "TrainSpec",
    "assert_parity",
    "check_case",
    "check_training",
    "compare_modules",
    "compare_streamed",
    "compare_tensors",
    "lm_metrics",
    "parameters_on_meta",
    "relative_error",
    "zero_gradient_names",
]
