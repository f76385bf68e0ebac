"""Integer arguments of each paired call (bucket ids, positions, indices), flax's beside torch's
(:func:`integer_arguments`), compared exactly as inputs of the pair (:func:`integer_inputs`). Imports no torch.

Records hold floating activations only; integer ids computed inside a model would be compared by nobody, and a
module that looks up wrong ids (a relative-position embedding fed wrong buckets) would look like the culprit.
With them compared, its inputs differ, so the first divergence goes up to the code that computed them; and run
alone, the module takes torch's ids (:mod:`flax_ln.parity.records.replay`), so it is not blamed for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from flax_ln.parity.core.policy import TensorResult, Tolerance
from flax_ln.parity.localize.activations import compare_activation
from flax_ln.parity.records.capture import Calls
from flax_ln.parity.records.pairing import Pairs
from flax_ln.parity.records.replay import PortCall, integer_leaves


def integer_arguments(
    pairs: Pairs, torch_calls: Calls | None, port_calls: Mapping[str, PortCall]
) -> dict[str, list[tuple[Any, np.ndarray]]]:
    """By torch path, the integer array arguments of the pair's recorded calls, flax's and torch's, in call order
    (positional, then keyword; containers opened): only where both calls have the same number of them, each pair of
    one shape, so that the n-th of each stands for the same value. Booleans are masks, not ids: not taken."""
    found: dict[str, list[tuple[Any, np.ndarray]]] = {}
    for path, flax_path in pairs.flax_paths.items():
        torch_call, port_call = (torch_calls or {}).get(path), port_calls.get(flax_path)
        if torch_call is None or port_call is None:
            continue
        theirs = integer_leaves(*torch_call)
        ours = integer_leaves(port_call.args, port_call.kwargs)
        if ours and len(ours) == len(theirs) and all(np.shape(f) == np.shape(t) for f, t in zip(ours, theirs)):
            found[path] = [(f, np.asarray(t)) for f, t in zip(ours, theirs)]
    return found


def integer_inputs(pairs: Pairs, path: str, tolerance: Tolerance) -> list[TensorResult]:
    """The pair's integer arguments (:attr:`Pairs.integers`) compared exactly (``integer input i``)."""
    return [
        compare_activation(f"integer input {i}", "module input", f, t, tolerance)
        for i, (f, t) in enumerate(pairs.integers.get(path, []))
    ]
