"""The arithmetic of :mod:`flax_ln.convert.discover`'s probe loads: the values each load puts in (constants, digits),
each variable's affine ``scale * torch + offset`` measured from them, the narrower float a loader rounds to, and
the ids decoded and checked, a chunk of elements at a time. A variable under measurement is any object with
``dtype``, ``scale``, ``offset``, ``ids`` and ``problem`` attributes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from flax_ln.convert.discover_layout import compact, equal_or_nan

CHUNK = 1 << 22  # elements made, decoded or checked at once: float64 temporaries of 32 MiB, whatever the size


def constant(c: float, g: np.ndarray) -> np.ndarray:
    """Load ``c`` everywhere."""
    return np.full(g.shape, c)


def digit(place: int, base: int, g: np.ndarray) -> np.ndarray:
    """Digit ``log_base(place)`` of each id, plus 2: never 0 or 1."""
    return (g // place) % base + 2


def chunks(size: int) -> Iterator[slice]:
    """The slices of ``size`` flat elements, ``CHUNK`` at a time."""
    return (slice(start, start + CHUNK) for start in range(0, size, CHUNK))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal(a, b, equal_nan=True)``, a chunk at a time."""
    a, b = a.reshape(-1), b.reshape(-1)
    return a.shape == b.shape and all(np.array_equal(a[part], b[part], equal_nan=True) for part in chunks(a.size))


def measured_affine(v2: np.ndarray, v3: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, offset)`` (float64, the variable's shape) from its values for constant loads 2 and 3, each one
    number broadcast (no memory) where uniform; uniformity is found a chunk at a time, and only a variable whose
    scale or offset varies gets full float64 arrays. An element NaN in either load (a loader that fills what it
    does not read with NaN) has scale 0 and offset NaN: left at init, never filled from torch."""
    a, b = v2.reshape(-1), v3.reshape(-1)
    first: tuple[np.float64, np.float64] | None = None
    for part in chunks(a.size):
        low = a[part].astype(np.float64)
        scale = b[part].astype(np.float64) - low
        scale[np.isnan(scale)] = 0  # NaN in either load: never filled
        offset = low - 2 * scale
        first = first or (scale[0], offset[0])
        if not ((scale == first[0]).all() and equal_or_nan(offset, first[1]).all()):
            scale = v3.astype(np.float64) - v2.astype(np.float64)
            scale[np.isnan(scale)] = 0
            return compact(scale), compact(v2.astype(np.float64) - 2 * scale)
    if first is None:  # no elements
        return np.zeros(v2.shape), np.zeros(v2.shape)
    return np.broadcast_to(first[0], v2.shape), np.broadcast_to(first[1], v2.shape)


def all_nonzero(a: np.ndarray) -> bool:
    """Whether every element of ``a`` (a broadcast number looked at once) is nonzero."""
    return bool(a.flat[0] != 0) if a.size and not any(a.strides) else bool((a != 0).all())


FIVE = 5 + 2**-7 + 2**-13  # exact in float32; float16 keeps 5 + 2**-7, bfloat16 keeps 5
NARROW = ("float16", "bfloat16")  # the rounding a loader may apply on the way, each told by load 5


def affine_holds(var: Any, v5: np.ndarray, five: float = 5.0, rounds: str | None = None) -> bool:
    """Whether the variable's values for constant load ``five`` are ``five * scale + offset``, to 4 ulp of its dtype;
    with ``rounds`` (a float type), whether they are that value rounded to ``rounds`` (the loader casts the torch
    value, or its image, to it on the way)."""
    tol = 4 * float(jnp.finfo(var.dtype).eps)  # the loader's cast and its own scale/offset arithmetic round
    narrow = None if rounds is None else jnp.dtype(rounds)
    flat = v5.reshape(-1)
    scale, offset = scalar_or_flat(var.scale), scalar_or_flat(var.offset)
    for part in chunks(flat.size):
        got = flat[part].astype(np.float64)
        s = scale if np.ndim(scale) == 0 else scale[part]
        o = offset if np.ndim(offset) == 0 else offset[part]
        wants = [five * s + o]
        if narrow is not None:  # rounded before the affine, or after it
            wants = [float(np.float64(five).astype(narrow)) * s + o, rounded(five * s + o, narrow)]
        ok = np.zeros(got.shape, bool)
        for want in wants:
            ok |= (np.abs(got - want) <= tol * np.maximum(1.0, np.abs(got))) | (np.isnan(got) & np.isnan(want))
        if not ok.all():
            return False
    return True


def rounded(values: Any, dtype: np.dtype) -> np.ndarray:
    """``values`` rounded to ``dtype``, as float64."""
    return np.asarray(values, np.float64).astype(dtype).astype(np.float64)


def rounding(var: Any, v5: np.ndarray, five: float) -> str | None:
    """The narrower float type the loader rounds this variable's values to, seen in load ``five``, else ``None``."""
    return next(
        (
            name
            for name in NARROW
            if jnp.finfo(jnp.dtype(name)).bits < jnp.finfo(var.dtype).bits and affine_holds(var, v5, five, name)
        ),
        None,
    )


def largest_reach(var: Any) -> tuple[float, float]:
    """The largest ``|scale|`` of a variable, and the largest ``|offset|`` where its scale is not 0."""
    scale, offset = var.scale, var.offset
    if scale.size and not any(scale.strides) and not any(offset.strides):
        s = float(scale.flat[0])
        return abs(s), abs(float(offset.flat[0])) if s != 0 else 0.0
    return float(np.abs(scale).max(initial=0)), float(np.abs(offset[scale != 0]).max(initial=0))


def scalar_or_flat(a: np.ndarray) -> Any:
    """A broadcast number (all strides 0) as that number, else ``a`` flattened."""
    return np.float64(a.flat[0]) if not any(a.strides) else a.reshape(-1)


def ratios(var: Any, value: np.ndarray) -> Iterator[tuple[slice, Any, np.ndarray]]:
    """``(part, filled, (value - offset) / scale)`` over the flat variable, a chunk at a time."""
    value = value.reshape(-1)
    scale, offset = scalar_or_flat(var.scale), scalar_or_flat(var.offset)
    for start in range(0, value.size, CHUNK):
        part = slice(start, start + CHUNK)
        s = scale if np.ndim(scale) == 0 else scale[part]
        o = offset if np.ndim(offset) == 0 else offset[part]
        filled = s != 0
        yield part, filled, (value[part].astype(np.float64) - o) / np.where(filled, s, 1)


def decode(var: Any, value: np.ndarray, base: int, place: int) -> None:
    """Add digit ``place`` (in ``base``) of each element's id, read from load ``value``, to ``var.ids``; a value
    that is no digit sets ``var.problem`` and drops the ids."""
    assert var.ids is not None
    ids = var.ids.reshape(-1)  # a view: ids is contiguous
    for part, filled, ratio in ratios(var, value):
        digit = ratio - 2
        exact = np.rint(digit)
        if np.any(filled & ((np.abs(digit - exact) > 1e-6) | (exact < 0) | (exact >= base))):
            var.problem = "not a function of one torch element: a probe value came back as no digit"
            var.ids = None
            return
        ids[part] += np.where(filled, exact * place, 0).astype(ids.dtype)


def agrees(var: Any, value: np.ndarray, base: int, unit: float = 1.0) -> bool:
    """Whether the check load's ``value`` is ``((g * 7919 + 13) % base + 2) * unit`` of every decoded id ``g``."""
    assert var.ids is not None
    ids = var.ids.reshape(-1)
    for part, filled, ratio in ratios(var, value):
        want = (ids[part].astype(np.int64) * 7919 + 13) % base + 2
        if not np.all((np.rint(ratio / unit) == want) | ~filled):
            return False
    return True
