"""How one array's axes differ between torch and flax.

:class:`Permute` is the rule table's layout: the same axes, reordered, named on each side.
:class:`ArrayLayout` is a key map's: an einops rearrange pattern or a ``(permutation,
reshape, reshape_first)`` triple, parsed from a rule by :func:`parse_layout`, run both ways.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import einops
import numpy as np
from einops.parsing import ParsedExpression

Shape = tuple[int, ...]

_SPATIAL = "..."


@dataclasses.dataclass(frozen=True)
class Permute:
    """How one array's axes are ordered in torch and in flax, as space-separated axis names.

    ``...`` stands for any number of axes kept in their order (a conv kernel's spatial
    axes, an activation's length/height/width), so one entry covers every rank:
    ``Permute("out in ...", "... in out")`` is the kernel of Conv1d, Conv2d and Conv3d alike.
    With ``perm = p.to_flax(ndim)``, ``flax_array = torch_array.transpose(perm)``.

    Args:
      torch: the axis names in torch's order, e.g. ``"out in"``.
      flax: the same names in flax's order, e.g. ``"in out"``.
    """

    torch: str
    flax: str

    def __post_init__(self):
        t, f = self.torch.split(), self.flax.split()
        if sorted(t) != sorted(f) or len(set(t)) != len(t) or t.count(_SPATIAL) > 1:
            raise ValueError(
                f"Permute({self.torch!r}, {self.flax!r}): both sides must list the same distinct axis "
                f"names, with at most one {_SPATIAL!r}; e.g. Permute('out in ...', '... in out')"
            )

    def _names(self, spec: str, ndim: int) -> list[str]:
        names = spec.split()
        fixed = len(names) - (_SPATIAL in names)
        if ndim < fixed or (_SPATIAL not in names and ndim != fixed):
            raise ValueError(
                f"Permute({self.torch!r}, {self.flax!r}) describes arrays of "
                f"{'at least ' if _SPATIAL in names else ''}{fixed} axes, got an array of {ndim}"
            )
        if _SPATIAL in names:
            at = names.index(_SPATIAL)
            names[at : at + 1] = [f"{_SPATIAL}{i}" for i in range(ndim - fixed)]
        return names

    def to_flax(self, ndim: int) -> tuple[int, ...]:
        """The permutation that takes a torch-layout array of ``ndim`` axes to flax layout."""
        t = self._names(self.torch, ndim)
        return tuple(t.index(name) for name in self._names(self.flax, ndim))

    def to_torch(self, ndim: int) -> tuple[int, ...]:
        """The permutation that takes a flax-layout array of ``ndim`` axes to torch layout."""
        f = self._names(self.flax, ndim)
        return tuple(f.index(name) for name in self._names(self.torch, ndim))


class NeedsTorchShape(ValueError):
    """A layout cannot be inverted from the flax shape alone; torch's shape (``like=``) fixes it."""


def shape_only(shape: Shape) -> np.ndarray:
    """A zero-stride array of ``shape``: layouts run on it to find shapes without touching data."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), shape, (0,) * len(shape))


def _single_axis_sizes(expression: ParsedExpression, shape: Shape) -> dict[str, int]:
    """``{axis: size}`` for every group of ``expression`` that is one named axis, read from ``shape``."""
    groups = expression.composition
    n_ellipsis = len(shape) - (len(groups) - expression.has_ellipsis)
    sizes, at = {}, 0
    for group in groups:
        if isinstance(group, str):  # the ellipsis
            at += max(n_ellipsis, 0)
            continue
        names = [a for a in group if isinstance(a, str)]
        if len(group) == 1 and len(names) == 1 and at < len(shape):
            sizes[names[0]] = int(shape[at])
        at += 1
    return sizes


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """One array's layout change from torch to flax, normalised from a rule's layout.

    ``pattern`` is an einops rearrange pattern, or ``permutation`` / ``reshape`` /
    ``reshape_first`` the parts of a triple; all empty is the identity.
    """

    pattern: str | None = None
    permutation: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None
    reshape_first: bool = False

    def __str__(self) -> str:
        if self.pattern is not None:
            return repr(self.pattern)
        if self.permutation is None and self.reshape is None:
            return "identity"
        return repr((self.permutation, self.reshape, self.reshape_first))

    @property
    def needs_torch_shape(self) -> bool:
        """Whether :meth:`to_torch` needs torch's shape: a reshape, or axes merged on the flax side."""
        if self.pattern is not None:
            flax_side = ParsedExpression(split_sizes(self.pattern)[0].split("->")[1])
            return any(len([a for a in g if isinstance(a, str)]) > 1 for g in flax_side.composition if g != "…")
        return self.reshape is not None

    def to_flax(self, array, flax_shape: Shape):
        """``array`` (torch layout) in flax layout; ``flax_shape`` gives the sizes a pattern leaves open.

        Raises ``ValueError`` when the sizes do not fit. Works on NumPy and JAX arrays.
        """
        if self.pattern is not None:
            expression, sizes = split_sizes(self.pattern)
            try:
                rhs = ParsedExpression(expression.split("->")[1])
                out = einops.rearrange(array, expression, **{**_single_axis_sizes(rhs, flax_shape), **sizes})
            except einops.EinopsError as error:
                raise ValueError(f"layout {self.pattern!r} does not fit: {_einops_reason(error)}") from None
        else:
            out = array
            if self.reshape_first and self.reshape is not None:
                out = out.reshape(self.reshape)
            if self.permutation is not None:
                if len(self.permutation) != out.ndim:
                    raise ValueError(
                        f"permutation {self.permutation} is for {len(self.permutation)} axes, got {out.ndim}"
                    )
                out = out.transpose(self.permutation)
            if not self.reshape_first and self.reshape is not None:
                out = out.reshape(self.reshape)
        if tuple(out.shape) != tuple(flax_shape):
            raise ValueError(f"layout {self} turns torch shape {tuple(array.shape)} into {tuple(out.shape)}")
        return out

    def to_torch(self, array, torch_shape: Shape | None = None):
        """The inverse of :meth:`to_flax`: ``array`` (flax layout) in torch layout.

        ``torch_shape`` is needed only where :attr:`needs_torch_shape`; without it those
        raise :class:`NeedsTorchShape`.
        """
        if self.needs_torch_shape and torch_shape is None:
            raise NeedsTorchShape(f"layout {self} cannot be inverted from the flax shape alone")
        if self.pattern is not None:
            expression, given = split_sizes(self.pattern)
            lhs, rhs = expression.split("->")
            sizes = _single_axis_sizes(ParsedExpression(lhs), torch_shape) if torch_shape is not None else {}
            try:
                out = einops.rearrange(array, f"{rhs} -> {lhs}", **{**sizes, **given})
            except einops.EinopsError as error:
                raise ValueError(f"layout {self.pattern!r} does not invert: {_einops_reason(error)}") from None
        elif self.reshape is None:
            out = array if self.permutation is None else array.transpose(np.argsort(self.permutation))
        else:
            assert torch_shape is not None
            if self.reshape_first:  # flax = transpose(reshape(torch)): undo the transpose, then the reshape
                mid = shape_only(torch_shape).reshape(self.reshape).shape
                if self.permutation is not None:
                    mid = tuple(mid[p] for p in self.permutation)
                out = array.reshape(mid)
                if self.permutation is not None:
                    out = out.transpose(np.argsort(self.permutation))
                out = out.reshape(torch_shape)
            else:  # flax = reshape(transpose(torch)): undo the reshape, then the transpose
                mid = torch_shape if self.permutation is None else tuple(torch_shape[p] for p in self.permutation)
                out = array.reshape(mid)
                if self.permutation is not None:
                    out = out.transpose(np.argsort(self.permutation))
        if torch_shape is not None and tuple(out.shape) != tuple(torch_shape):
            raise ValueError(f"layout {self} turns flax shape {tuple(array.shape)} into {tuple(out.shape)}")
        return out

    def torch_shape(self, flax_shape: Shape) -> Shape:
        """The torch shape of a flax array of ``flax_shape`` (raises :class:`NeedsTorchShape` where unknown)."""
        return tuple(self.to_torch(shape_only(flax_shape)).shape)


IDENTITY = ArrayLayout()


def split_sizes(pattern: str) -> tuple[str, dict[str, int]]:
    """An einops pattern with the sizes of split axes after a semicolon, ``"(h two d) i -> i (h d two); two=2, d=64"``,
    as ``(pattern, {axis: size})``: the sizes einops cannot read from the shapes (several unknown axes in one group).
    ``ValueError`` for a size that is not ``name=positive integer``."""
    expression, _, given = pattern.partition(";")
    sizes = {}
    for item in given.replace(",", " ").split():
        name, equals, value = item.partition("=")
        if not equals or not name.isidentifier() or not value.isdigit() or int(value) < 1:
            raise ValueError(f"layout {pattern!r}: {item!r} is not an axis size such as 'd=64'")
        sizes[name] = int(value)
    return expression.strip(), sizes


def _einops_reason(error: Exception) -> str:
    return " ".join(str(error).split())


def parse_layout(layout: Any) -> ArrayLayout:
    """A rule's layout (None, einops pattern, triple, Enum member) as an :class:`ArrayLayout`; ``ValueError`` if bad."""
    if isinstance(layout, enum.Enum):
        if isinstance(layout.value, enum.Enum):
            raise ValueError(f"the Enum member {layout!r} has an Enum value; its value must be a layout")
        return parse_layout(layout.value)
    if layout is None:
        return IDENTITY
    if isinstance(layout, str):
        if layout.count("->") != 1:
            raise ValueError(f"layout {layout!r} must be an einops rearrange pattern 'torch axes -> flax axes'")
        expression, sizes = split_sizes(layout)
        try:
            lhs, rhs = (ParsedExpression(side) for side in expression.split("->"))
        except einops.EinopsError as error:
            raise ValueError(f"layout {layout!r} is not a rearrange pattern: {_einops_reason(error)}") from None
        if lhs.identifiers != rhs.identifiers:
            raise ValueError(f"layout {layout!r} must name the same axes on both sides")
        if not sizes.keys() <= lhs.identifiers:
            raise ValueError(
                f"layout {layout!r} gives sizes of axes it does not name: {sorted(sizes.keys() - lhs.identifiers)}"
            )
        return ArrayLayout(pattern=layout.strip())
    if isinstance(layout, (tuple, list)) and len(layout) == 3:
        permutation, reshape, reshape_first = layout
        if permutation is not None:
            permutation = tuple(int(p) for p in permutation)
            if sorted(permutation) != list(range(len(permutation))):
                raise ValueError(f"permutation {permutation} in layout {layout!r} is not a permutation of 0..n-1")
        if reshape is not None:
            reshape = tuple(int(s) for s in reshape)
        if reshape_first not in (True, False):  # bool, 0/1 or numpy's bool
            raise ValueError(f"reshape_first in layout {layout!r} must be a bool, got {reshape_first!r}")
        return ArrayLayout(permutation=permutation, reshape=reshape, reshape_first=bool(reshape_first))
    raise ValueError(
        f"layout {layout!r} is not a layout: expected None, an einops pattern such as '(n h) d -> d n h', "
        "a (permutation, reshape, reshape_first) triple, or an Enum member whose value is one"
    )
