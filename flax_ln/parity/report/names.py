"""Tensor names cut to a table's column, each row's name distinct from the others' (two layers' ``k_lin.weight``
cut to the same start and end would print identically)."""

from __future__ import annotations

import os
from collections.abc import Sequence

_WINDOW = 12  # characters kept around the place where a name first differs from the one it would be taken for


def cut(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters: a longer one keeps its start and its end, ``...`` between."""
    if len(name) <= width:
        return name
    head = (width - 3) // 2
    return name[:head] + "..." + name[len(name) - (width - 3 - head) :]


def distinct_cuts(names: Sequence[str], width: int) -> list[str]:
    """Each of ``names`` cut to ``width`` (:func:`cut`); where two different names would print the same, each keeps
    its start, the place where it first differs from the nearest of them, and its end, ``...`` between."""
    cuts = [cut(n, width) for n in names]  # (a name within width is never cut, so never collides)
    groups: dict[str, set[str]] = {}
    for name, short in zip(names, cuts, strict=True):
        groups.setdefault(short, set()).add(name)
    for i, name in enumerate(names):
        others = groups[cuts[i]] - {name}
        if others:
            at = max(len(os.path.commonprefix([name, o])) for o in others)
            cuts[i] = _cut_keeping(name, width, at)
    return cuts


def _cut_keeping(name: str, width: int, at: int) -> str:
    """``name`` in ``width`` characters keeping its start, its end and the characters around position ``at``."""
    room = width - 6 - _WINDOW  # with two cuts, the head and the end share what the window leaves
    head, end = room // 3, room - room // 3
    start = max(head, at - _WINDOW // 2)
    if len(name) - start <= width - 3 - head:  # the window runs into the end: one cut, before it
        return name[: width - 3 - (len(name) - start)] + "..." + name[start:]
    return name[:head] + "..." + name[start : start + _WINDOW] + "..." + name[len(name) - end :]
