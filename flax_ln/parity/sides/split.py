"""One torch tensor split across several flax variables (a split rule of a :class:`~flax_ln.convert.KeyMap`,
:meth:`~flax_ln.convert.KeyPlan.split`): its gradient is compared slab by slab, each slab under its own name
(``in_proj_weight[0:64]``), so a wrong v projection is not blamed on q. Imports no torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from flax_ln.convert import KeyPlan
from flax_ln.convert.keymap_syntax import region_index
from flax_ln.parity.core.policy import zero_gradient_names
from flax_ln.parity.sides.torch import TorchSide


def as_split(
    side: TorchSide,
    plan: KeyPlan,
    zero_evidence: Callable[[], set[str]],
    float64_gradients: Callable[[], Mapping[str, np.ndarray]] | None = None,
) -> tuple[TorchSide, Callable[[], set[str]]]:
    """``side`` with each split key's parameter gradient (and float64 truth) cut into its slabs, each named
    ``key[slab]`` as :meth:`~flax_ln.convert.KeyPlan.torch_gradients` names the flax side's; and
    ``zero_evidence`` (gradients float64 shows are zero) with the slabs of a zero gradient zero too, and, given
    ``float64_gradients`` (torch's float64 parameter gradients by torch name, asked only when the evidence is),
    each slab float64 shows is zero on its own (the key slab of ``in_proj_bias``, whose gradient is zero in the
    mathematics while q's and v's are not): float64's word slab by slab. Outputs, tangents and other gradients are
    unchanged."""
    split = plan.split()
    cut_keys = [k for k in split if side.kinds.get(k) == "param grad"]
    if not cut_keys:
        return side, zero_evidence

    def cut(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for k, v in values.items():
            if k not in cut_keys:
                out[k] = v
                continue
            for t in split[k]:
                out[t.torch_name] = np.ascontiguousarray(t.torch_part(v))
            for name, region in plan.dropped_slabs.get(k, ()):  # read by no variable: a dropped parameter
                out[name] = np.ascontiguousarray(np.asarray(v)[region_index(region)])
        return out

    names = {k: [t.torch_name for t in split[k]] + [n for n, _ in plan.dropped_slabs.get(k, ())] for k in cut_keys}
    expected = cut(side.expected)
    kinds = {n: kind for k, kind in side.kinds.items() for n in names.get(k, [k])}
    param_names = [n for k in side.param_names for n in names.get(k, [k])]
    side = dataclasses.replace(
        side,
        expected=expected,
        kinds=kinds,
        param_names=param_names,
        truth=None if side.truth is None else cut(side.truth),
    )

    slabs = {n for k in cut_keys for n in names[k]}

    def zero() -> set[str]:
        whole = zero_evidence()
        found = whole | {n for k in cut_keys if k in whole for n in names[k]}
        if float64_gradients is not None:
            found |= slabs & zero_gradient_names(cut(float64_gradients()))
        return found

    return side, zero
