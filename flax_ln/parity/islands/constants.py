"""Float32 constants a float64 run meets on the JAX side, told apart by where they were made: held by the port
before the comparison (built at construction: a rebuild under lifting, ``flax_factory=``, makes them float64), or
made by the port's own code while it runs (a NumPy float32 table built in a Linen ``setup`` on every apply, a
module-level float32 global): no rebuild changes those; the port itself computes them in float32.

Imports neither torch nor JAX: arrays are told by their ``dtype`` and ``shape``."""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np

_DEPTH = 64  # how deep attributes and containers are followed (penzai nests its layers past 12 levels)
_LIMIT = 200_000  # objects visited at most: a bound on the walk of a very large model
_ARRAYS = (np.ndarray, np.generic)


def held_float32_arrays(port: Any) -> frozenset[int]:
    """The ids of the float32 (complex64) arrays ``port`` holds now, anywhere: in attributes (private ones too),
    lists, tuples, dicts and sets, a Keras functional model's operation arguments, and the closures, defaults
    and partial arguments of the functions it holds. The objects stay alive as long as the port holds them."""
    narrow = (np.dtype(np.float32), np.dtype(np.complex64))
    found: set[int] = set()
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(port, 0)]
    while stack and len(seen) < _LIMIT:
        obj, depth = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, complex, bool, type, types.ModuleType)):
            continue
        seen.add(id(obj))
        try:  # an object's own properties may raise anything: it is then only not followed
            dtype = getattr(obj, "dtype", None) if isinstance(obj, _ARRAYS) or hasattr(obj, "shape") else None
            if dtype is not None:
                if isinstance(dtype, np.dtype) and dtype in narrow:
                    found.add(id(obj))
                continue  # an array (NumPy's or JAX's): its own attributes are not the port's
            if depth < _DEPTH:
                stack.extend((child, depth + 1) for child in _children(obj))
        except Exception:  # noqa: BLE001, S112 - a value the walk cannot read holds no array it can name
            continue
    return frozenset(found)


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        return [*cells, *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
    held = getattr(obj, "__dict__", None)
    names = [n for k in type(obj).__mro__ for n in _slots(k)]
    slots = [getattr(obj, n) for n in names if hasattr(obj, n)]
    return [*(held.values() if isinstance(held, dict) else ()), *slots]


def _slots(cls: type) -> tuple[str, ...]:
    slots = vars(cls).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def is_held(value: Any, held: frozenset[int]) -> bool:
    """Whether ``value`` (a constant a trace captures), or the array it views (JAX wraps a NumPy constant in a
    view of it), is one of the ``held`` arrays."""
    while value is not None:
        if id(value) in held:
            return True
        value = getattr(value, "base", None)
    return False
