r"""The parts of a :class:`~flax_ln.convert.KeyMap` rule past its regex: affine changes, regions, constants, source.

* :class:`Affine`: ``flax = scale * layout(torch) + offset``, from a rule's ``{"scale": s, "offset": o}``.
* Regions: a template's index suffix ``path[item, ...]`` (``:``, ``start:stop``, an integer or a group
  reference such as ``\1``) names the part of a variable one torch key fills (:func:`parse_region`,
  :func:`region_index`, :func:`region_name`), and :func:`tiling_problems` checks that the parts tile it.
* :func:`constant_value` and :func:`describe_value`: a flax-only constant, as loaded and as a report shows it.
* :func:`key_map_source`: a map as the Python source that rebuilds it (:meth:`KeyMap.to_source`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from flax_ln.convert.layouts import IDENTITY, ArrayLayout, Shape, parse_layout

# One axis of a region: an index (the axis is dropped) or a (start, stop) range.
Item = int | tuple[int, int]
Region = tuple[Item, ...]

_SUFFIX = re.compile(r"(?P<path>[^\[\]]*)\[(?P<items>[^\[\]]*)\]")
_REFERENCE = re.compile(r"\\(\d+)|\\g<(\w+)>")
_RANGE = re.compile(r"(\d*):(\d*)")
_SLAB = re.compile(r"\[(?P<items>[^\[\]]*)\]")


@dataclasses.dataclass(frozen=True)
class Affine:
    """A rule's value change on top of its layout: ``flax = scale * layout(torch) + offset``.

    Values are computed in float64 (the caller casts to the variable's dtype); gradients and tangents
    only scale (an offset has no derivative). ``round``: a narrower float type (``"float16"``, ``"bfloat16"``)
    each loaded value is rounded to, last, as a loader that casts on the way does (export and gradients are
    unchanged by it: the values it gives are already that type's).
    """

    scale: float = 1.0
    offset: float = 0.0
    round: str | None = None

    @property
    def identity(self) -> bool:
        """Whether it changes nothing."""
        return self.scale == 1.0 and self.offset == 0.0 and self.round is None

    def __str__(self) -> str:
        return "identity" if self.identity else repr(self.as_dict())

    def as_dict(self) -> dict[str, float | str] | None:
        """The rule's spelling: ``None`` for the identity, else only the keys that differ from the default."""
        if self.identity:
            return None
        out: dict[str, float | str] = {}
        if self.scale != 1.0:
            out["scale"] = self.scale
        if self.offset != 0.0:
            out["offset"] = self.offset
        if self.round is not None:
            out["round"] = self.round
        return out

    def value_to_flax(self, array):
        """A value after its layout, on the flax side: ``scale * array + offset`` (float64; rounded to ``round``
        when set), or ``array``."""
        if self.identity:
            return array
        out = np.asarray(array, np.float64) * self.scale + self.offset
        return out if self.round is None else out.astype(ROUNDS[self.round]).astype(np.float64)

    def value_to_torch(self, array):
        """The inverse of :meth:`value_to_flax`: ``(array - offset) / scale`` (float64), or ``array``."""
        if self.identity:
            return array
        return (np.asarray(array, np.float64) - self.offset) / self.scale

    def scaled(self, array):
        """A tangent or gradient times ``scale``, in its own dtype (the chain rule's factor)."""
        if self.scale == 1.0:
            return array
        return array * np.asarray(self.scale, np.asarray(array).dtype)


NO_AFFINE = Affine()
ROUNDS = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
"""The float types a rule's ``round`` may name, each as the NumPy dtype values are rounded through."""


def parse_affine(spec: Any) -> Affine:
    """A rule's affine part (``None`` or ``{"scale": s, "offset": o}``, either key optional) as an :class:`Affine`."""
    if spec is None:
        return NO_AFFINE
    if isinstance(spec, Affine):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"the affine part must be None or a dict {{'scale': s, 'offset': o}}, got {spec!r}")
    bad = sorted(map(str, set(spec) - {"scale", "offset", "round"}))
    if bad:
        raise ValueError(f"affine {dict(spec)!r} has unknown key(s) {bad}; it takes only 'scale', 'offset' and 'round'")
    rounds = spec.get("round")
    if rounds is not None and rounds not in ROUNDS:
        raise ValueError(
            f"affine round must be one of {sorted(ROUNDS)} (the type values are rounded to), got {rounds!r}"
        )
    values = {}
    for name, default in (("scale", 1.0), ("offset", 0.0)):
        value = spec.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"affine {name} must be a number, got {value!r}")
        if not math.isfinite(float(value)):
            raise ValueError(f"affine {name} must be finite, got {value!r}")
        values[name] = float(value)
    if values["scale"] == 0.0:
        raise ValueError("affine scale must be nonzero (the map is inverted for export and gradients), got 0")
    return Affine(**values, round=rounds)


def split_template(template: str) -> tuple[str, str | None]:
    """``("path", "items")`` of a template (expanded or not) ending in ``[items]``; ``(template, None)`` otherwise."""
    m = _SUFFIX.fullmatch(template)
    return (template, None) if m is None else (m.group("path"), m.group("items"))


def check_suffix(items: str) -> None:
    """A ``ValueError`` unless each item of an unexpanded suffix is ``:``, ``start:stop``, an integer or a reference."""
    for item in (i.strip() for i in items.split(",")):
        if _REFERENCE.fullmatch(item) or item.isdigit():
            continue
        m = _RANGE.fullmatch(item)
        if m and (m.group(1) == m.group(2) == "" or (m.group(1) and m.group(2) and int(m.group(2)) > int(m.group(1)))):
            continue
        raise ValueError(
            f"slice item {item!r} in [{items}] is not ':', 'start:stop' (non-negative integers, stop > start), "
            r"an integer or a group reference such as \1"
        )


def parse_region(items: str, shape: Shape) -> tuple[Region, Shape]:
    """An expanded suffix's items against a variable of ``shape``: the region (one item per axis, missing trailing
    items the whole axis) and its shape (axes with an index dropped). ``ValueError`` when out of range."""
    texts = [i.strip() for i in items.split(",")]
    if len(texts) > len(shape):
        raise ValueError(f"[{items}] has {len(texts)} items for a variable of {len(shape)} axes (shape {shape})")
    region: list[Item] = []
    for axis, size in enumerate(shape):
        text = texts[axis] if axis < len(texts) else ":"
        m = _RANGE.fullmatch(text)
        if text.isdigit():
            if int(text) >= size:
                raise ValueError(f"slice {text!r} is not an index of axis {axis} (shape {shape})")
            region.append(int(text))
        elif m is not None:
            start = int(m.group(1) or 0)
            stop = int(m.group(2)) if m.group(2) else size
            if stop > size or stop <= start:
                raise ValueError(
                    f"slice {text!r} does not fit axis {axis} (shape {shape}): need 0 <= start < stop <= {size}"
                )
            region.append((start, stop))
        else:
            raise ValueError(f"slice {text!r} is not an index of axis {axis} (shape {shape})")
    return tuple(region), tuple(b - a for item in region if isinstance(item, tuple) for a, b in (item,))


def whole_region(shape: Shape) -> Region:
    """The region of a whole variable."""
    return tuple((0, size) for size in shape)


def region_index(region: Region) -> tuple:
    """A NumPy index for ``region``: ``array[region_index(region)]`` is its part."""
    return tuple(item if isinstance(item, int) else slice(*item) for item in region)


def region_name(path: str, region: Region, shape: Shape) -> str:
    """``path`` for a whole variable, ``path[i]`` for slice i of its leading axis, else ``path[:, 0:768]``."""
    items = [
        "" if item == (0, size) else str(item) if isinstance(item, int) else f"{item[0]}:{item[1]}"
        for item, size in zip(region, shape)
    ]
    while items and items[-1] == "":
        items.pop()
    return path if not items else f"{path}[{', '.join(i or ':' for i in items)}]"


def _box(mask: np.ndarray) -> str:
    """The bounding box of a mask's true elements, as a region suffix."""
    where = np.nonzero(mask)
    return "[" + ", ".join(f"{int(ax.min())}:{int(ax.max()) + 1}" for ax in where) + "]"


def tiling_problems(path: str, shape: Shape, regions: Mapping[Region, str], strict: bool) -> list[str]:
    """What is wrong with how distinct ``regions`` (each with a label naming its keys) fill a variable of ``shape``:
    an overlap of two regions; with ``strict``, elements no region fills (their bounding box). ``[]`` when they
    tile it."""
    rest = whole_region(shape)[1:]
    if shape and all(r and isinstance(r[0], int) and r[1:] == rest for r in regions):  # slices of a stack
        missing = sorted(set(range(shape[0])) - {r[0] for r in regions})
        if strict and missing:
            return [f"slices {missing} of this stacked variable (shape {shape}) are filled by no rule"]
        return []
    filled = np.zeros(shape, bool)
    problems = []
    seen: list[tuple[Region, str]] = []
    for region, label in regions.items():
        if np.any(filled[region_index(region)]):
            mine = np.zeros(shape, bool)
            mine[region_index(region)] = True
            for other, other_label in seen:
                both = np.zeros(shape, bool)
                both[region_index(other)] = True
                both &= mine
                if np.any(both):
                    problems.append(
                        f"{region_name(path, region, shape)} from {label} overlaps "
                        f"{region_name(path, other, shape)} from {other_label} at {_box(both)}"
                    )
        filled[region_index(region)] = True
        seen.append((region, label))
    if strict and not np.all(filled):
        problems.append(
            f"a gap: elements {_box(~filled)} of this variable (shape {shape}) are filled by no rule's region"
        )
    return problems


def constant_value(value: Any, shape: Shape, dtype: np.dtype) -> np.ndarray:
    """A constant for a variable of ``shape`` and ``dtype``: a number broadcast, or an array of that shape;
    ``ValueError`` naming both shapes otherwise."""
    array = np.asarray(value)
    if array.ndim and tuple(array.shape) != tuple(shape):
        raise ValueError(
            f"the constant has shape {tuple(array.shape)}, the variable {tuple(shape)}; "
            "give a number or an array of the variable's shape"
        )
    return np.broadcast_to(array, shape).astype(dtype)


def describe_value(value: Any) -> str:
    """A constant in a few words: ``"0.0"`` (every element), or ``"array (64,) float32, min -1 .. max 1"``."""
    array = np.asarray(value)
    if array.ndim == 0:
        return repr(array.item())
    if array.size and np.all(array == array.flat[0]):  # a number, broadcast
        return repr(array.flat[0].item())
    low, high = (f"{array.min():.4g}", f"{array.max():.4g}") if array.size else ("-", "-")
    return f"array {tuple(array.shape)} {array.dtype}, min {low} .. max {high}"


# ---------------------------------------------------------------------------------------------
# Rules


@dataclasses.dataclass(frozen=True)
class Rule:
    """One parsed rule of a :class:`~flax_ln.convert.KeyMap`: ``pattern`` (matched in full) to ``templates``, each
    with its layout and :class:`Affine`. ``templates`` is empty for a rule that ignores its keys; ``index`` is the
    rule's position in the map."""

    index: int
    pattern: str
    templates: tuple[str, ...]
    layouts: tuple[ArrayLayout, ...]
    affines: tuple[Affine, ...] = ()
    slabs: tuple[str | None, ...] = ()  # per template, the torch slab it takes (``"[0:64]"``); None: all of it
    dropped: tuple[str, ...] = ()  # the torch slabs no variable takes (``{"[0:2]": None}``): unread, admitted

    def __post_init__(self):
        if len(self.affines) != len(self.templates):  # rules built without affines: none
            object.__setattr__(self, "affines", (NO_AFFINE,) * len(self.templates))
        if len(self.slabs) != len(self.templates):  # rules built without slabs: whole tensors
            object.__setattr__(self, "slabs", (None,) * len(self.templates))

    @property
    def splits(self) -> bool:
        """Whether the rule sends slabs of one torch tensor to several variables (a dict template)."""
        return any(s is not None for s in self.slabs)

    @property
    def regex(self) -> re.Pattern:
        """The compiled ``pattern``."""
        return re.compile(self.pattern)

    @property
    def label(self) -> str:
        """How errors name the rule: ``rule 3 r'model\\.norm\\.weight'``."""
        return f"rule {self.index} r'{self.pattern}'"


def parse_slab(slab: Any) -> str:
    """A torch slab of a split rule, ``"[items]"`` (the region syntax, on the torch tensor), checked; ``ValueError``
    naming the slab otherwise."""
    if not isinstance(slab, str):
        raise ValueError(f"a torch slab is a str like '[0:64]' or '[:, 64:128]', got {slab!r}")
    m = _SLAB.fullmatch(slab.strip())
    if m is None:
        raise ValueError(
            f"torch slab {slab!r} is not '[items]': write the part of the torch tensor as a region, e.g. '[0:64]' "
            "(rows 0 to 63), '[:, 64:128]' (columns 64 to 127) or '[3]' (slice 3 of a stacked tensor)"
        )
    check_suffix(m.group(1))
    return slab.strip()


def slab_items(slab: str) -> str:
    """The items of a torch slab ``"[items]"``."""
    m = _SLAB.fullmatch(slab)
    assert m is not None  # parse_slab
    return m.group(1)


def parse_rule(index: int, item: Any) -> Rule:
    """One rule, ``(regex, template, layout)`` or ``(regex, template, layout, affine)``, parsed (``ValueError``).

    A dict template, ``{torch slab: template}``, splits the torch tensor: each slab (``"[0:64]"``, the region
    syntax on the torch side) fills its template's variable; its layout and affine are as a tuple template's. A
    slab whose template is ``None`` is read by no variable (a loader that reads rows ``2:`` of a table): dropped."""
    if not (isinstance(item, tuple) and len(item) in (3, 4)):
        raise ValueError("a rule is a (regex, template, layout) triple or a (regex, template, layout, affine) tuple")
    pattern, template, layout, affine = item if len(item) == 4 else (*item, None)
    if not isinstance(pattern, str):
        raise ValueError(f"the regex must be a str, got {type(pattern).__name__}")
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"the regex does not compile: {error}") from None
    if template is None:
        if layout is not None or affine is not None:
            raise ValueError("an ignored key (template None) takes no layout or affine; write (regex, None, None)")
        return Rule(index, pattern, (), (), ())
    templates: tuple[str, ...]
    layouts: tuple[ArrayLayout, ...]
    affines: tuple[Affine, ...]
    slabs: tuple[str | None, ...] = ()
    dropped: tuple[str, ...] = ()
    if isinstance(template, Mapping):
        kept = {k: t for k, t in template.items() if t is not None}
        if not kept or not all(isinstance(t, str) for t in kept.values()):
            raise ValueError(
                "a split rule's template is a {torch slab: template} dict with at least one template (None: a slab "
                f"no variable reads), got {template!r}"
            )
        dropped = tuple(parse_slab(k) for k, t in template.items() if t is None)
        slabs = tuple(parse_slab(k) for k in kept)
        template = tuple(kept.values())
        if layout is not None and not isinstance(layout, tuple):
            layout = (layout,) * len(template)  # one layout for every slab
    if isinstance(template, str):
        templates, layouts, affines = (template,), (parse_layout(layout),), (parse_affine(affine),)
    elif isinstance(template, tuple) and template and all(isinstance(t, str) for t in template):
        templates, n = template, len(template)
        if layout is None:
            layouts = (IDENTITY,) * n
        elif isinstance(layout, tuple) and len(layout) == n:
            layouts = tuple(parse_layout(one) for one in layout)
        else:
            raise ValueError(f"a tuple of {n} templates takes None or a tuple of {n} layouts, got {layout!r}")
        if isinstance(affine, tuple):
            if len(affine) != n:
                raise ValueError(
                    f"a tuple of {n} templates takes None, one affine dict or a tuple of {n}, got {affine!r}"
                )
            affines = tuple(parse_affine(one) for one in affine)
        else:
            affines = (parse_affine(affine),) * n
    else:
        raise ValueError(f"the template must be a str, None or a non-empty tuple of str, got {template!r}")
    for t in templates:
        path, items = split_template(t)
        if not path or path.startswith(".") or path.endswith(".") or "[" in path or "]" in path:
            raise ValueError(f"template {t!r} is not a dotted path (with at most one [items] suffix)")
        if items is not None:
            check_suffix(items)
        check_template(pattern, t)
    for slab in (*slabs, *dropped):
        assert slab is not None  # parse_slab
        check_template(pattern, slab_items(slab))  # a slab may name the regex's groups
    return Rule(index, pattern, tuple(templates), layouts, affines, slabs, dropped)


def check_template(pattern: str, template: str) -> None:
    """A ``ValueError`` unless ``template`` expands with ``pattern``'s groups (``\\1``, ``\\g<name>``, escapes).

    ``pattern|`` has the same groups as ``pattern`` and matches the empty string, so its match
    expands ``template`` exactly as a key's match will (unmatched groups give ``""``).
    """
    regex = re.compile(pattern + "|")
    match = regex.match("")
    assert match is not None  # the empty alternative always matches
    try:
        match.expand(template)
    except (re.error, IndexError) as error:
        groups = [str(i) for i in range(1, regex.groups + 1)] + [f"<{name}>" for name in regex.groupindex]
        has = f"its groups are {', '.join(groups)}" if groups else "the regex has no groups"
        raise ValueError(
            f"template {template!r} does not expand with the regex: {error} ({has}); name only the regex's groups"
        ) from None


# ---------------------------------------------------------------------------------------------
# Source


def _raw(text: str) -> str:
    """``text`` as a Python string literal, raw where it can be (a regex's backslashes kept as typed)."""
    if not text.endswith("\\") and "\n" not in text and "\r" not in text:
        for quote in ('"', "'"):
            if quote not in text:
                return f"r{quote}{text}{quote}"
    return repr(text)


def _layout_source(layout: ArrayLayout) -> str:
    if layout.pattern is not None:
        return f'"{layout.pattern}"' if '"' not in layout.pattern else repr(layout.pattern)
    if layout.permutation is None and layout.reshape is None:
        return "None"
    return repr((layout.permutation, layout.reshape, layout.reshape_first))


def _affine_source(affine: Affine) -> str:
    return repr(affine.as_dict())


def _number_source(x: Any) -> str:
    """A Python number as source: ``float("nan")`` and ``float("inf")`` where ``repr`` gives a bare name."""
    if isinstance(x, list):
        return "[" + ", ".join(_number_source(v) for v in x) + "]"
    if isinstance(x, float) and not math.isfinite(x):
        return f'{"-" if x < 0 else ""}float("{"nan" if math.isnan(x) else "inf"}")'
    return repr(x)


def _value_source(value: Any) -> str:
    array = np.asarray(value)
    if array.ndim == 0:
        return _number_source(array.item())
    return f"np.array({_number_source(array.tolist())}, dtype={str(array.dtype)!r})"


def key_map_source(rules: Sequence, constants: Mapping[str, Any], comments: Mapping[int, str] | None = None) -> str:
    """The source of ``KeyMap([...], constants={...})`` for parsed ``rules`` (see :meth:`KeyMap.to_source`)."""
    lines = ["KeyMap("]
    lines.append("    [")
    for rule in rules:
        note = (comments or {}).get(rule.index)
        for text in str(note).splitlines() if note else ():
            lines.append(f"        # {text}")
        if not rule.templates:
            lines.append(f"        ({_raw(rule.pattern)}, None, None),")
            continue
        if rule.splits:
            items = [f"{_raw(slab)}: None" for slab in rule.dropped]
            items += [f"{_raw(slab)}: {_raw(t)}" for slab, t in zip(rule.slabs, rule.templates)]
            template = "{" + ", ".join(items) + "}"
            shown = [_layout_source(x) for x in rule.layouts]
            layout = shown[0] if len(set(shown)) == 1 else "(" + ", ".join(shown) + ")"
            if all(a.identity for a in rule.affines):
                affine = "None"
            else:
                affine = "(" + ", ".join(_affine_source(a) for a in rule.affines) + ")"
        elif len(rule.templates) == 1:
            template = _raw(rule.templates[0])
            layout = _layout_source(rule.layouts[0])
            affine = _affine_source(rule.affines[0])
        else:
            template = "(" + ", ".join(_raw(t) for t in rule.templates) + ")"
            layout = "(" + ", ".join(_layout_source(x) for x in rule.layouts) + ")"
            if all(a.identity for a in rule.affines):
                affine = "None"
            else:
                affine = "(" + ", ".join(_affine_source(a) for a in rule.affines) + ")"
        tail = "" if affine == "None" else f", {affine}"
        lines.append(f"        ({_raw(rule.pattern)}, {template}, {layout}{tail}),")
    lines.append("    ],")
    if constants:
        lines.append("    constants={")
        for regex, value in constants.items():
            lines.append(f"        {_raw(regex)}: {_value_source(value)},")
        lines.append("    },")
    lines.append(")")
    return "\n".join(lines) + "\n"
