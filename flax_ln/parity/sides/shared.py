"""Distinct torch tensors that fill one flax variable (:meth:`~flax_ln.convert.KeyPlan.shared`): how a
comparison matches them, one tangent and one gradient for all of them. Imports no torch."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np

from flax_ln.convert import KeyPlan, Tie
from flax_ln.parity.core.policy import TensorResult, Tolerance
from flax_ln.parity.sides.torch import TorchSide


def one_variable_for_distinct_parameters(
    side: TorchSide, shared: Mapping[str, Tie], tolerance: Tolerance
) -> list[TensorResult]:
    """A failing result for each torch parameter that fills a flax variable another distinct torch parameter fills
    too (under every member but the first): the port then computes another model, which equal values at
    initialisation (every norm weight 1) hide. Buffers of equal value are not parameters, and a tie of one torch
    tensor under several names is not in ``shared``."""
    parameters = {*side.param_names, *side.frozen}
    results = []
    for tie in shared.values():
        members = [k for k in tie.torch_aliases if k in parameters]
        for key in members[1:]:
            held = "one variable" if len(tie.flax_paths) == 1 else "one set of variables"  # a split fills several
            problem = (
                f"the port holds {held} ({', '.join(tie.flax_paths)}) where torch keeps "
                f"{len(members)} parameters ({', '.join(members)}): equal now, as at initialisation, they move "
                "apart in training; give the port a variable for each"
            )
            shape = tuple(np.shape(side.state_dict[key]))
            kind = "param grad" if side.mode == "grad" else "param"
            results.append(
                TensorResult(key, kind, shape, math.inf, None, math.inf, tolerance, None, False, problem=problem)
            )
    return results


def zero_shared(zero: set[str], shared: Mapping[str, Tie]) -> set[str]:
    """``zero`` (gradients float64 shows are zero) with each group of :meth:`~flax_ln.convert.KeyPlan.shared` keys
    as its summed gradient, under the first key: zero when every one of them is."""
    members = {k for tie in shared.values() for k in tie.torch_aliases}
    return {k for k in zero if k not in members} | {
        first for first, tie in shared.items() if all(k in zero for k in tie.torch_aliases)
    }


def as_shared(side: TorchSide, plan: KeyPlan, rerun: Callable[[dict[str, np.ndarray]], TorchSide] | None) -> TorchSide:
    """``side`` as the flax side can match it where distinct torch tensors fill one flax variable
    (:meth:`~flax_ln.convert.KeyPlan.shared`), which takes one tangent and one gradient for all of them.

    ``"jvp"``: every one of them takes the tangent of the first that has one, carried through the layouts
    (:meth:`~flax_ln.convert.KeyPlan.carry`), and torch runs again with them (``rerun``). ``"grad"``: their
    gradients (and float64 truths) are summed, in the first one's layout, under its name."""
    shared = plan.shared()
    if side.mode == "jvp":
        tangents = dict(side.tangents)
        for tie in shared.values():
            source = next((k for k in tie.torch_aliases if k in tangents), "")
            for k in tie.torch_aliases if source else ():
                if k != source:
                    tangents[k] = np.asarray(
                        plan.carry(source, k, tangents[source], "tangent"), side.state_dict[k].dtype
                    )
        if all(k in side.tangents and np.array_equal(v, side.tangents[k]) for k, v in tangents.items()):
            return side
        if rerun is None:
            raise ValueError(
                "distinct torch tensors fill one flax variable ("
                + "; ".join(", ".join(tie.torch_aliases) for tie in shared.values())
                + "): a stored torch side's independent tangents cannot be compared; run compare_modules"
            )
        return rerun(tangents)

    def summed(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(values)
        for first, tie in shared.items():
            for k in tie.torch_aliases[1:] if first in out else ():
                if k in out:
                    out[first] = out[first] + np.asarray(plan.carry(k, first, out.pop(k), "gradient"), out[first].dtype)
        return out

    expected = summed(side.expected)
    return dataclasses.replace(
        side,
        expected=expected,
        kinds={k: kind for k, kind in side.kinds.items() if k in expected},
        param_names=[k for k in side.param_names if k in expected],
        truth=None if side.truth is None else summed(side.truth),
    )
