"""What both sides run: calling a module through a forward, and naming its outputs. Imports no torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


def named_outputs(tree: Any, name: str | None = None) -> list[tuple[str, Any]]:
    """Array leaves of a forward's result with names: ``output`` for one array, ``output[i]``
    for a tuple's items, the keys of a dict (nested: ``key.sub``, ``key[i]``); ``None`` leaves are dropped."""
    if tree is None:
        return []
    if isinstance(tree, Mapping):
        return [leaf for k, v in tree.items() for leaf in named_outputs(v, str(k) if name is None else f"{name}.{k}")]
    if isinstance(tree, (tuple, list)):
        base = "output" if name is None else name
        return [leaf for i, v in enumerate(tree) for leaf in named_outputs(v, f"{base}[{i}]")]
    return [("output" if name is None else name, tree)]


def _call(forward: Callable | None, module, args, kwargs):
    return module(*args, **kwargs) if forward is None else forward(module, *args, **kwargs)


def _is_float(x) -> bool:
    return np.issubdtype(np.asarray(x).dtype, np.floating)


def _as_tuple(inputs) -> tuple[np.ndarray, ...]:
    items = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    return tuple(np.asarray(x) for x in items)
