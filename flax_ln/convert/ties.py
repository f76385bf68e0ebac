"""Ties: torch keys that hold one tensor (:func:`find_ties`), and where a plan puts their copies (:class:`Tie`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from flax_ln.convert.assign import as_numpy


def find_ties(tensors: Any, named: Iterable[str] = ()) -> dict[str, tuple[str, ...]]:
    """Torch keys that hold one tensor: ``{canonical: (canonical, *aliases)}``, ``{}`` when none.

    ``tensors`` is a ``torch.nn.Module`` (its ``state_dict(keep_vars=True)``; the
    canonical name is the one ``named_parameters()`` / ``named_buffers()`` lists) or a
    state dict of tensors or arrays (keys sharing memory: the same data pointer, shape,
    strides and dtype; the canonical name is the first of ``named`` among them, else the
    first key, as ``state_dict()`` orders them, which is ``named_parameters()``'s choice).
    """
    named = set(named)
    if hasattr(tensors, "state_dict") and hasattr(tensors, "named_parameters"):
        named = {n for n, _ in tensors.named_parameters()} | {n for n, _ in tensors.named_buffers()}
        tensors = tensors.state_dict(keep_vars=True)
    groups: dict[tuple, list[str]] = {}
    for key, value in tensors.items():
        array = as_numpy(value)
        if array.size == 0:
            continue
        address = (array.__array_interface__["data"][0], array.shape, array.strides, array.dtype.str)
        groups.setdefault(address, []).append(key)
    ties = {}
    for keys in groups.values():
        if len(keys) > 1:
            canonical = next((k for k in keys if k in named), keys[0])
            ties[canonical] = (canonical, *[k for k in keys if k != canonical])
    return ties


@dataclasses.dataclass(frozen=True)
class Tie:
    """Torch keys that hold one tensor, and the flax variables that hold its copies.

    Args:
      torch_aliases: the torch keys, the canonical one (``named_parameters()``'s) first.
      flax_paths: the dotted flax paths of every copy (``path[i]`` for a slice of a stacked variable).
    """

    torch_aliases: tuple[str, ...]
    flax_paths: tuple[str, ...]

    def to_json(self) -> dict[str, list[str]]:
        """``{"torch_aliases": [...], "flax_paths": [...]}``."""
        return {"torch_aliases": list(self.torch_aliases), "flax_paths": list(self.flax_paths)}
