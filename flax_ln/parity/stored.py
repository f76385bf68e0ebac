"""The flax side against a stored torch side: :func:`compare_side` (a reference file's :class:`TorchSide`, or one
saved from a live run). Torch-free: a reference file's torch side needs no torch."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from flax import nnx

from flax_ln.parity.compare import load_and_judge, stamp
from flax_ln.parity.core.call import as_inputs
from flax_ln.parity.core.policy import Tolerance, numerics, tolerances_for
from flax_ln.parity.localize.locate import localize
from flax_ln.parity.report.data import ParityReport
from flax_ln.parity.sides.kinds import flax_side_kind
from flax_ln.parity.sides.torch import TorchSide


def compare_side(
    side: TorchSide,
    flax_module: nnx.Module,
    *,
    flax_inputs=None,
    forward: Any = None,
    loss=None,
    tolerances: Mapping[str, Tolerance] | None = None,
    localize_failures: bool = True,
    capture_modules: bool = False,
    lm_logits: str | None = None,
    mesh=None,
) -> ParityReport:
    """The flax side against a stored :class:`TorchSide` (a reference file's, or one saved from a live run).

    The same comparison as :func:`compare_modules` (``forward``, ``loss``, ``flax_inputs``,
    ``tolerances``, ``lm_logits`` and ``mesh`` as there; only the flax function of a
    ``forward`` pair runs), with no torch: localisation uses the side's stored
    ``records``/``calls`` when it has them; attribution runs when ``side.truth`` is set.
    ``mesh``: localisation, isolated mode and the float64 twin of attribution run
    unsharded.
    """
    started = time.perf_counter()
    kind = flax_side_kind(flax_module)
    if kind.needs_key_map:
        raise TypeError(
            "compare_side (a stored reference file) takes an NNX module; Linen and Function flax sides are "
            "compared live, with compare_modules(..., weights=KeyMap(...))"
        )
    tolerances = tolerances_for(side.dtype, tolerances)
    call = side.call(forward, loss)
    flax_inputs = None if flax_inputs is None else as_inputs(flax_inputs)
    stored_zero = set(side.float64_zero or ())  # a reference file carries float64's word on each gradient
    with numerics(side.dtype):
        report, flax, _ = load_and_judge(
            kind, side, flax_module, call, flax_inputs, tolerances, lm_logits, mesh, None, lambda: stored_zero
        )
        if capture_modules or (localize_failures and not report.passed):
            localize(report, side, flax, call, tolerances["output"])
    return stamp(report, started)
