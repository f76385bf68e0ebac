"""The statistics a verdict reads from two arrays, in float64, one block of elements at a time.

:func:`~flax_ln.parity.core.policy.compare_tensors` judges a tensor by its NaN and Inf counts, its largest absolute
error and where it is, its relative Frobenius error and the norm of its error, all in float64 (complex128 for
complex arrays). Converting a whole gradient to float64 costs two float64 copies of it per side and a pass over
memory per statistic: for a 50257 x 1600 embedding gradient, gigabytes and seconds. Here the two arrays are read
in blocks of :data:`BLOCK` elements, each block widened once and every statistic taken from it while it is in
cache; the results are the same quantities (sums of squares are added block by block, so a norm can differ from
``np.linalg.norm`` of the whole in its last bits).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Literal

import numpy as np

BLOCK = 1 << 18  # elements per block: 2 MiB in float64, a few of them fit in a core's cache


def widest(x) -> np.ndarray:
    """``x`` as float64, or as complex128 when it is complex (its imaginary part compared too, never dropped)."""
    x = np.asarray(x)
    return x.astype(np.complex128) if np.iscomplexobj(x) else x.astype(np.float64)


def _wide(x: np.ndarray) -> np.dtype:
    return np.dtype(np.complex128 if np.iscomplexobj(x) else np.float64)


def _blocks(*arrays: np.ndarray, order: Literal["C", "K"] = "C"):
    """The arrays (of one shape) side by side in blocks of at most :data:`BLOCK` elements, each widened
    (:func:`widest`'s dtype), in ``order`` (``"C"``: the same elements of each at once, whatever their strides;
    ``"K"``: memory order). A transposed view is read where it lies: no copy of the whole."""
    if arrays[0].size == 0:
        return
    it = np.nditer(
        arrays,
        flags=["external_loop", "buffered", "zerosize_ok"],
        op_flags=[["readonly"]] * len(arrays),
        op_dtypes=[_wide(x) for x in arrays],
        casting="unsafe",
        buffersize=BLOCK,
        order=order,
    )
    with it:
        for blocks in it:
            yield (blocks,) if len(arrays) == 1 else blocks


def _squares(block: np.ndarray) -> float:
    """``sum(|block|^2)``, summed by NumPy (pairwise), not by a BLAS dot: OpenBLAS runs a long dot on threads
    that spin on a busy machine, which costs more than the sum."""
    if np.iscomplexobj(block):
        return float(np.sum(np.square(block.real)) + np.sum(np.square(block.imag)))
    return float(np.sum(np.square(block)))


def sum_of_squares(x) -> float:
    """``sum(|x|^2)`` in float64, block by block (no float64 copy of the whole of ``x``)."""
    total = 0.0
    with np.errstate(over="ignore"):  # a square past float64's range is inf, as np.linalg.norm's
        for (block,) in _blocks(np.asarray(x), order="K"):
            total += _squares(block)
    return total


def norm(x) -> float:
    """The Frobenius norm of ``x`` in float64 (complex128 for complex arrays), block by block."""
    return math.sqrt(sum_of_squares(x))


@dataclasses.dataclass
class PairStats:
    """What a verdict reads from ``actual`` (flax) against ``expected`` (torch), of one shape.

    ``nan``/``inf``: counts per side (``"flax"``, ``"torch"``); ``max_abs``/``index``: the largest absolute error
    over the positions finite on both sides and its first position (``None`` when no position is finite on
    both); ``relative``: ``||a - b|| / ||b||`` over the finite positions (``||a - b||`` when ``||b||`` is 0),
    ``inf`` when the two have non-finite values at different positions or of different values (NaN matching
    NaN); ``diff_norm``: the norm of the error over the positions finite on both sides; ``actual_norm`` and
    ``expected_norm``: each side's norm over those positions."""

    nan: dict[str, int]
    inf: dict[str, int]
    max_abs: float
    index: tuple[int, ...] | None
    relative: float
    diff_norm: float
    actual_norm: float
    expected_norm: float


def pair_stats(actual: np.ndarray, expected: np.ndarray) -> PairStats:
    """:class:`PairStats` of two arrays of one shape, read block by block (see the module docstring)."""
    nan = {"flax": 0, "torch": 0}
    inf = {"flax": 0, "torch": 0}
    best, best_at, any_finite = -1.0, 0, False
    diff_squares = scale_squares = actual_squares = 0.0
    same_nonfinite = True
    at = 0
    for a, b in _blocks(np.asarray(actual), np.asarray(expected)):
        with np.errstate(invalid="ignore", over="ignore"):  # Inf - Inf, a square past range: the slow path sees them
            diff = a - b
            diff_block, scale_block, actual_block = _squares(diff), _squares(b), _squares(a)
        if math.isfinite(diff_block) and math.isfinite(scale_block):  # every element finite (NaN and Inf propagate)
            diff = np.abs(diff, out=diff) if diff.dtype.kind == "f" else np.abs(diff)
            any_finite = any_finite or diff.size > 0
        else:  # a NaN or an Inf (or a square past float64's range): mask them, as the sums say nothing then
            finite_a, finite_b = np.isfinite(a), np.isfinite(b)
            for label, x in (("flax", a), ("torch", b)):
                nan[label] += int(np.isnan(x).sum())
                inf[label] += int(np.isinf(x).sum())
            if not np.array_equal(finite_a, finite_b) or not np.array_equal(a[~finite_a], b[~finite_b], equal_nan=True):
                same_nonfinite = False
            finite = finite_a & finite_b
            any_finite = any_finite or bool(finite.any())
            diff = np.abs(np.where(finite, a, 0.0) - np.where(finite, b, 0.0))
            scale, actual_finite = np.where(finite, b, 0.0), np.where(finite, a, 0.0)
            with np.errstate(over="ignore"):  # a square past float64's range is inf, as np.linalg.norm's
                diff_block, scale_block, actual_block = _squares(diff), _squares(scale), _squares(actual_finite)
        if diff.size:
            i = int(np.argmax(diff))
            if diff[i] > best:  # strictly: the first position of the largest error, as one argmax would give
                best, best_at = float(diff[i]), at + i
        diff_squares += diff_block
        scale_squares += scale_block
        actual_squares += actual_block
        at += a.size
    diff_norm = math.sqrt(diff_squares)
    if any_finite:
        index: tuple[int, ...] | None = tuple(int(i) for i in np.unravel_index(best_at, np.shape(expected)))
        max_abs = best
    else:
        index, max_abs = None, 0.0
    if not same_nonfinite:
        relative = math.inf
    else:
        scale_norm = math.sqrt(scale_squares)
        relative = diff_norm / scale_norm if scale_norm > 0 else diff_norm
    return PairStats(nan, inf, max_abs, index, relative, diff_norm, math.sqrt(actual_squares), math.sqrt(scale_squares))


READERS = min(4, os.cpu_count() or 1)  # threads that read pairs at once: NumPy's loops release the GIL


def many_pair_stats(pairs: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, PairStats | None]:
    """:func:`pair_stats` of each ``(actual, expected)`` pair by name, :data:`READERS` pairs at a time; ``None``
    for a pair it cannot read (the caller's own checks say why)."""

    def read(pair: tuple[np.ndarray, np.ndarray]) -> PairStats | None:
        try:
            return pair_stats(*pair)
        except Exception:  # noqa: BLE001 - the caller judges this pair again, and meets the error where it did
            return None

    with concurrent.futures.ThreadPoolExecutor(READERS) as pool:
        return dict(zip(pairs, pool.map(read, pairs.values())))
