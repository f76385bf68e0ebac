"""Cross-framework parity: the one engine behind ``flax-ln parity``, the tests and user code.

:func:`compare_modules` / :func:`assert_parity` compare any torch module with its NNX
twin, a Linen module (:class:`Linen`) or a function over a parameter pytree (:class:`Function`)
(outputs, and the gradients of every floating input and every parameter, keyed by
torch name) under the one tolerance policy :data:`TOLERANCES`, and name the first
submodule that diverges, and the module whose own computation differs (isolated mode).
Options: forward mode (``mode="jvp"``), float64 attribution (``attribute=True``) and
language-model metrics (``lm_logits=``).

The engine, by concern:

* :mod:`.policy`: the metrics and the tolerance policy (``relative_error``, ``Tolerance``,
  ``TOLERANCES``, ``compare_tensors``, ``TensorResult``, ``numerics``, ``lm_metrics``), its float64
  statistics read block by block in :mod:`.tensor_stats`;
* :mod:`.call`: what both sides run (``Call``: inputs, names, kwargs, each side's forward,
  the loss) and the outputs as named leaves, the same on both sides;
* :mod:`.torch_side`: the torch run, into a ``TorchSide`` (made live, or read from a reference
  file); :mod:`.flax_side`: the flax run, written once over ``FlaxSide``, with one module a kind of
  flax side (:mod:`.nnx_side`, :mod:`.linen_side`, :mod:`.function_side`, the last two over
  :mod:`.tree_side`); :mod:`.capture`: recording submodule calls; :mod:`.pairing` and :mod:`.localize`:
  which modules are the same layer, the first divergence and isolated mode, once for every kind;
* :mod:`.compare`: ``compare_modules`` and ``assert_parity``; :mod:`.stored`: ``compare_side`` (the flax side
  against a ``TorchSide``), with :mod:`.shared` for distinct torch tensors that fill one flax variable;
* :mod:`.streamed`: ``compare_streamed``, the same comparison stage by stage from a checkpoint, for models
  larger than memory, over :mod:`.stages` (a model as a chain of stages) and :mod:`.stream_sides` (each side,
  one stage's weights at a time);
* :mod:`.case`: a model with its inputs and training step (``Case``, ``check_case``, ``check_training``);
* :mod:`.report`: what a comparison found; :mod:`.render`: the report as text and as a chart.

The book's models, torch checkpoints and reference files are run on this engine from
:mod:`flax_ln.book`, which the engine does not import; the ``flax-ln`` command is
:mod:`flax_ln.cli`. torch is imported only when a comparison runs: importing this package
does not import it.
"""

from flax_ln.convert import KeyMap
from flax_ln.parity.case import Case, TrainSpec, check_case, check_training
from flax_ln.parity.compare import assert_parity, compare_modules
from flax_ln.parity.equinox_side import Equinox
from flax_ln.parity.flax_side import Function, Linen
from flax_ln.parity.policy import (
    HALF_PRECISION,
    TOLERANCES,
    TensorResult,
    Tolerance,
    compare_tensors,
    lm_metrics,
    relative_error,
    zero_gradient_names,
)
from flax_ln.parity.report import FirstDivergence, Isolation, ParityReport
from flax_ln.parity.stages import Stage, Stages
from flax_ln.parity.stream_sides import parameters_on_meta
from flax_ln.parity.streamed import compare_streamed

__all__ = [
    "Case",
    "FirstDivergence",
    "Equinox",
    "Function",
    "HALF_PRECISION",
    "Isolation",
    "KeyMap",
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
