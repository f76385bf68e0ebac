"""One torch tensor split across several flax variables (a split rule of a :class:`~flax_ln.convert.KeyMap`,
:meth:`~flax_ln.convert.KeyPlan.split`): its gradient is compared slab by slab, each slab under its own name
(``in_proj_weight[0:64]``), so a wrong v projection is not blamed on q. Imports no torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from flax_ln.convert import KeyPlan
from flax_ln.parity.sides.torch import TorchSide


def as_split(
    side: TorchSide, plan: KeyPlan, zero_evidence: Callable[[], set[str]]
) -> tuple[TorchSide, Callable[[], set[str]]]:
    """``side`` with each split key's parameter gradient (and float64 truth) cut into its slabs, each named
    ``key[slab]`` as :meth:`~flax_ln.convert.KeyPlan.torch_gradients` names the flax side's; and
    ``zero_evidence`` (gradients float64 shows are zero) with the slabs of a zero gradient zero too. Outputs,
    tangents and other gradients are unchanged."""
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
        return out

    names = {k: [t.torch_name for t in split[k]] for k in cut_keys}
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

    def zero() -> set[str]:
        whole = zero_evidence()
        return whole | {n for k in cut_keys if k in whole for n in names[k]}

    return side, zero
