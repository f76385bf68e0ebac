"""How localisation compares one recorded activation of a pair with torch's (:func:`compare_activation`), and a pair's
activations in torch's layout (:func:`in_torch_layout`, :func:`compare_activations`). Imports no torch.

Localisation asks a different question from the verdict: not whether a tensor is within tolerance in every element,
but whether the module that produced it differs. So, here only (the verdict keeps its own rules, where an Inf
against a number fails as ``inf``):

- **Integer and boolean activations** (bucket ids, positions, indices) are compared exactly: equal or not, no
  tolerance, since an id that is off by one looks up another row, however small its relative error.
- **Masked values are equal.** A value at or below half the most negative number of the narrowest floating dtype in
  play (each side's dtype, and float32: a port's constant mask built in float32 stays float32's minimum in the
  float64 check), or ``-inf``, on *both* sides is masked: an additive mask at ``finfo(float64).min`` in torch and at
  ``finfo(float32).min`` in the port mean the same, and both are left out of the error.
- **Norms cannot overflow.** The values are scaled by their largest magnitude before their squares are summed
  (a mask on one side only is a difference of about ``1e308``, whose square is past float64's range), and the
  errors scaled back.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from flax_ln.parity.core.call import is_float
from flax_ln.parity.core.policy import TensorResult, Tolerance, compare_tensors
from flax_ln.parity.core.tensor_stats import pair_stats
from flax_ln.parity.records.pairing import Pairs

EXACT = Tolerance(rtol=0.0)  # integers: equal or not (an id off by one looks up another row)
SAFE_MAGNITUDE = 1e150  # above this, a square or a sum of squares may pass float64's range (1.8e308): scale first


def mask_threshold(*arrays: Any) -> float:
    """Half the most negative finite number of the narrowest floating dtype among ``arrays``' and float32; a value at
    or below it (or ``-inf``) is a masked position."""
    dtypes = [np.float32] + [np.asarray(x).dtype for x in arrays if is_float(x) and not np.iscomplexobj(x)]
    return 0.5 * max(float(jnp.finfo(d).min) for d in dtypes)


def _integral(x: Any) -> bool:
    try:
        return np.dtype(getattr(x, "dtype", np.asarray(x).dtype)).kind in "iub"
    except TypeError:  # a dtype NumPy does not know (a typed PRNG key)
        return False


def compare_activation(name: str, kind: str, flax: Any, torch: Any, tolerance: Tolerance) -> TensorResult:
    """Flax's activation against torch's (of one shape: the caller puts flax's into torch's layout), as localisation
    compares them (the module docstring): integers exactly, positions masked on both sides equal, norms scaled."""
    a, b = np.asarray(flax), np.asarray(torch)
    if a.shape != b.shape or b.size == 0:
        return compare_tensors(name, kind, a, b, tolerance)  # the verdict's own words for what cannot be compared
    if _integral(a) and _integral(b):
        return compare_tensors(name, kind, a.astype(np.float64), b.astype(np.float64), EXACT)
    if not (is_float(a) and is_float(b)) or np.iscomplexobj(a) or np.iscomplexobj(b):
        return compare_tensors(name, kind, a, b, tolerance)
    threshold = mask_threshold(flax, torch)
    lows, highs = (
        [float(np.fmin.reduce(x, axis=None)) for x in (a, b)],
        [float(np.fmax.reduce(x, axis=None)) for x in (a, b)],
    )
    if not all(low <= threshold for low in lows) and max(map(abs, lows + highs)) <= SAFE_MAGNITUDE:
        return compare_tensors(name, kind, a, b, tolerance)  # nothing masked on both sides, no square out of range
    a, b = a.astype(np.float64), b.astype(np.float64)
    masked = (a <= threshold) & (b <= threshold)
    if masked.any():
        a, b = np.where(masked, 0.0, a), np.where(masked, 0.0, b)
    finite = np.isfinite(a) & np.isfinite(b)
    scale = float(max(np.abs(a[finite]).max(initial=0.0), np.abs(b[finite]).max(initial=0.0)))
    if scale <= SAFE_MAGNITUDE:
        return compare_tensors(name, kind, a, b, tolerance)
    stats = pair_stats(a / scale, b / scale)
    stats.max_abs, stats.diff_norm = stats.max_abs * scale, stats.diff_norm * scale
    stats.actual_norm, stats.expected_norm = stats.actual_norm * scale, stats.expected_norm * scale
    if not math.isfinite(stats.relative):  # different non-finite positions: as the verdict says it
        stats.relative = math.inf
    return compare_tensors(name, kind, a, b, tolerance, stats=stats)


def in_torch_layout(label: str, flax_arrays: list, torch_arrays: list, pairs: Pairs, path: str):
    """The pair's flax activations put into torch's layout, pairwise with torch's: (index, moved, torch's) for
    each that fits, and the first reason one does not (``None`` when all fit)."""
    fitted, reason = [], None
    for i, (f, t) in enumerate(zip(flax_arrays, torch_arrays)):
        moved = pairs.to_torch(path, f, t.shape, "output" if label == "output" else "input")
        if isinstance(moved, str):
            reason = reason or f"{label} {i}: {moved}"
        elif moved.shape == t.shape:
            fitted.append((i, moved, t))
        else:
            reason = reason or f"{label} {i}: flax's {moved.shape} in torch's layout is not torch's {t.shape}"
    return fitted, reason


def compare_activations(
    label: str, flax_arrays: list, torch_arrays: list, tolerance: Tolerance, pairs: Pairs, path: str
) -> list[TensorResult]:
    """Flax activations (put into torch's layout) against torch's, pairwise (:func:`compare_activation`); pairs that
    do not fit are skipped, the reason kept in ``pairs.skipped``."""
    fitted, reason = in_torch_layout(label, flax_arrays, torch_arrays, pairs, path)
    if reason is not None:
        pairs.skipped.setdefault(path, reason)
    return [compare_activation(f"{label} {i}", f"module {label}", f, t, tolerance) for i, f, t in fitted]
