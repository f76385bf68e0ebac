"""One torch key's target in a :class:`~flax_ln.convert.KeyPlan`: :class:`Target`, the flax variable (or region of
one) it fills, from all of the torch tensor or a slab of it (a split rule), with both directions of its layout and
affine change; and :func:`assemble`, a split key's tensor from its slabs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from flax_ln.convert.keymap_syntax import NO_AFFINE, Affine, Region, Rule, region_index, region_name, whole_region
from flax_ln.convert.layouts import ArrayLayout, Shape


@dataclasses.dataclass(frozen=True)
class Target:
    """One flax variable (or region of one) that a torch key fills.

    Args:
      key: the torch key.
      rule: the rule that matched it.
      path: the variable's canonical dotted path (as ``nnx.state`` names it).
      region: the part it fills, one item per axis of the variable (an index, or a ``(start, stop)`` range).
      layout: torch -> flax.
      torch_shape: the torch tensor's shape.
      flax_shape: the shape of what it fills (the region's).
      affine: the value change after the layout (``flax = scale * layout(torch) + offset``).
      variable_shape: the whole variable's shape.
    """

    key: str
    rule: Rule
    path: str
    region: Region
    layout: ArrayLayout
    torch_shape: Shape
    flax_shape: Shape
    affine: Affine = NO_AFFINE
    variable_shape: Shape = ()
    slab: Region | None = None  # the part of the torch tensor it takes (a split rule); None: all of it

    @property
    def slab_shape(self) -> Shape:
        """The shape of what it takes from the torch tensor: the slab's, or the whole tensor's."""
        if self.slab is None:
            return self.torch_shape
        return tuple(b - a for item in self.slab if isinstance(item, tuple) for a, b in (item,))

    @property
    def torch_name(self) -> str:
        """How a comparison names what it takes from torch: the key, or ``key[0:64]`` for a slab of it."""
        return self.key if self.slab is None else region_name(self.key, self.slab, self.torch_shape)

    def torch_part(self, array):
        """Its slab of a whole torch-layout ``array`` (the array itself without a slab)."""
        return array if self.slab is None else array[region_index(self.slab)]

    @property
    def name(self) -> str:
        """``path``, ``path[i]`` for a slice of its leading axis, or ``path[:, 0:768]`` for another region."""
        return region_name(self.path, self.region, self.variable_shape)

    @property
    def at(self) -> tuple[str, Region]:
        """``(path, region)``: what it fills, as a key."""
        return self.path, self.region

    @property
    def index(self) -> int | None:
        """The slice of a variable stacked along its leading axis, or ``None`` for any other region."""
        rest = whole_region(self.variable_shape)[1:]
        if self.region and isinstance(self.region[0], int) and self.region[1:] == rest:
            return self.region[0]
        return None

    # Towards flax, a method takes the whole torch tensor (and takes its slab); towards torch, it gives the slab.

    def to_flax(self, array):
        """A torch-layout value of this key (its slab) in this target's flax layout, its affine change applied."""
        return self.affine.value_to_flax(self.layout.to_flax(self.torch_part(array), self.flax_shape))

    def to_torch(self, array):
        """A flax-layout value of this target (the region) in torch's layout (its slab), its affine change undone."""
        return self.layout.to_torch(self.affine.value_to_torch(array), self.slab_shape)

    def tangent_to_flax(self, array):
        """A torch-layout tangent of this key in flax's layout: ``scale * layout(t)`` (an offset has no tangent)."""
        return self.affine.scaled(self.layout.to_flax(self.torch_part(array), self.flax_shape))

    def gradient_to_torch(self, array):
        """A flax gradient of this target's region under torch's layout (its slab): ``scale * inverse layout(g)``."""
        return self.affine.scaled(self.layout.to_torch(array, self.slab_shape))

    def tangent_to_torch(self, array):
        """The inverse of :meth:`tangent_to_flax`."""
        return self.layout.to_torch(array, self.slab_shape) / np.asarray(self.affine.scale, np.asarray(array).dtype)

    def gradient_to_flax(self, array):
        """The inverse of :meth:`gradient_to_torch`."""
        return self.layout.to_flax(self.torch_part(array), self.flax_shape) / np.asarray(
            self.affine.scale, np.asarray(array).dtype
        )

    def take(self, value):
        """This target's part of the whole variable's ``value``: its region."""
        return value[region_index(self.region)]


def assemble(targets: Sequence[Target], piece: Any) -> np.ndarray:
    """A split torch key's whole tensor from its targets' slabs: ``piece(target)`` each (its slab, torch layout)."""
    parts = [np.asarray(piece(t)) for t in targets]
    whole = np.zeros(targets[0].torch_shape, np.result_type(*parts))
    for t, part in zip(targets, parts):
        assert t.slab is not None
        whole[region_index(t.slab)] = part
    return whole
