"""Error metrics for cross-framework parity."""

from __future__ import annotations

import numpy as np


def relative_error(actual, expected) -> float:
    """Relative Frobenius error ``||actual - expected|| / ||expected||`` in float64.

    NaN or Inf anywhere in either array gives ``inf`` unless both arrays have them at
    the same positions with the same values (NaN matching NaN), in which case the error
    of the finite entries is returned. ``expected == 0`` falls back to the absolute norm.
    """
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: actual {a.shape} vs expected {b.shape}")
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(finite_a, finite_b):
        return float("inf")
    nonfinite = ~finite_a
    if nonfinite.any() and not np.array_equal(a[nonfinite], b[nonfinite], equal_nan=True):
        return float("inf")
    diff = np.linalg.norm((a - b)[finite_a])
    scale = np.linalg.norm(b[finite_b])
    return float(diff / scale) if scale > 0 else float(diff)
