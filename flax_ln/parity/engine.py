"""Cross-framework parity: run a torch module and its NNX twin on the same weights and compare.

:func:`compare_modules` copies the torch weights through the strict converter
(:func:`flax_ln.convert.load_torch_state_dict`), runs both modules in eval mode, and
compares every output and the gradient of a scalar loss with respect to every floating
input and every parameter (keyed by torch name), each against the one tolerance policy
:data:`TOLERANCES`. When anything is out of tolerance it replays the forward pass with
every submodule's inputs and outputs recorded on both sides (:mod:`.capture`) and names
the first submodule, in execution order, whose output diverges. :func:`assert_parity`
is the same for pytest. The book's cases and ``flax-ln parity`` run on the same function.

The torch side of a run is a :class:`TorchSide` (every array the comparison needs), made
live by :func:`run_torch_side` or read from a reference file; :func:`compare_side` puts
the flax side against it. Options: forward mode (``mode="jvp"``: ``torch.func.jvp``
against ``jax.jvp``), attribution against float64 truth (``attribute=True``), LM
metrics (``lm_logits``) and, on failure, isolated localisation (:func:`isolate`).

The engine, by concern (this module gathers their public names):

* :mod:`.policy`: the metrics and the tolerance policy (``relative_error``, ``Tolerance``,
  ``TOLERANCES``, ``compare_tensors``, ``TensorResult``, ``numerics``, ``lm_metrics``);
* :mod:`.call`: what both sides run (``Call``: inputs, names, kwargs, each side's forward,
  the loss) and the outputs as named leaves, the same on both sides;
* :mod:`.torch_side`: the torch run, into a ``TorchSide``; :mod:`.flax_side`: the flax run
  (an NNX module, ``NNXSide``); :mod:`.localize`: the first divergence and isolated mode;
* :mod:`.compare`: ``compare_modules``, ``assert_parity`` and ``compare_side``;
* :mod:`.case`: the book's cases and training steps (``Case``, ``check_case``, ``check_training``).

torch is imported lazily: importing this module does not import it.
"""

from __future__ import annotations

from flax_ln.parity.call import Call, named_outputs
from flax_ln.parity.case import Case, TrainSpec, check_case, check_training, torch_side_of_case
from flax_ln.parity.compare import assert_parity, compare_modules, compare_side
from flax_ln.parity.localize import isolate, localize
from flax_ln.parity.policy import (
    HALF_PRECISION,
    TOLERANCES,
    Tolerance,
    compare_tensors,
    lm_metrics,
    numerics,
    relative_error,
    zero_gradient_names,
)
from flax_ln.parity.report import TensorResult
from flax_ln.parity.torch_side import MODES, TorchSide, record_torch_side, run_torch_side

__all__ = [
    "HALF_PRECISION",
    "MODES",
    "TOLERANCES",
    "Call",
    "Case",
    "TensorResult",
    "Tolerance",
    "TorchSide",
    "TrainSpec",
    "assert_parity",
    "check_case",
    "check_training",
    "compare_modules",
    "compare_side",
    "compare_tensors",
    "isolate",
    "lm_metrics",
    "localize",
    "named_outputs",
    "numerics",
    "record_torch_side",
    "relative_error",
    "run_torch_side",
    "torch_side_of_case",
    "zero_gradient_names",
]
