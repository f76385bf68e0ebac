r"""What a loader did to one flax variable, read from the torch element ids it holds.

:func:`regions` splits a variable's id array into the slabs each torch tensor fills (a
fused q/k/v kernel, a stacked scan axis); :func:`layout_of` names, as an einops pattern
torch -> flax, the permutation and reshape that puts a whole tensor's elements where the
ids say; :func:`fold_families` writes keys that differ only by layer number as one rule.
Nothing here loads anything: :mod:`flax_ln.convert.discover` measures, this explains.

The probe loads' arithmetic is here too: the values each load puts in (:func:`constant`, :func:`digit`), each
variable's affine ``scale * torch + offset`` measured from them, the narrower float a loader rounds to, and the ids
decoded and checked, a chunk of elements at a time. A variable under measurement is any object with ``dtype``,
``scale``, ``offset``, ``ids`` and ``problem`` attributes.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from flax_ln.convert.assign import is_floating
from flax_ln.convert.layouts import parse_layout

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Region:
    """One slab of a flax variable that one torch tensor fills: ``index`` (the slice suffix, ``""`` for the whole
    variable), ``selector`` (the NumPy index of the slab) and ``tensor`` (its position among the torch tensors)."""

    index: str
    selector: tuple
    tensor: int


def regions(tensor_of: np.ndarray, sizes: np.ndarray) -> list[Region] | None:
    """The slabs of a variable, from ``tensor_of`` (each element's torch tensor, flax shape) and ``sizes`` (each
    tensor's element count).

    One tensor of the variable's size or larger (a slab of it fills the variable): the whole variable. Otherwise
    the first axis along which every index holds one tensor, cut into runs of equal tensors, and a run that holds a
    tensor more than once into runs of one copy (a tensor copied twice into a stack); a run of length one drops the
    axis (``[:, 2]``), a longer one is a slice (``[:, 0:768]``). ``None`` when no axis separates them.
    """
    first = tensor_of.flat[0]
    if (tensor_of == first).all() and tensor_of.size <= sizes[first]:  # smaller: a slab of it (a split)
        return [Region("", (), int(first))]
    for axis in range(tensor_of.ndim):
        rows = np.moveaxis(tensor_of, axis, 0).reshape(tensor_of.shape[axis], -1)  # (n, rest)
        if not (rows == rows[:, :1]).all():
            continue
        along, rest = rows[:, 0], rows.shape[1]
        cuts = [0, *(np.flatnonzero(along[1:] != along[:-1]) + 1).tolist(), len(along)]
        spans = []
        for start, stop in zip(cuts[:-1], cuts[1:]):
            size = int(sizes[along[start]])
            step = size // rest if size % rest == 0 and size // rest else stop - start
            if (stop - start) % step:
                step = stop - start
            spans += [(at, at + step) for at in range(start, stop, step)]
        out = []
        lead = ":, " * axis
        for start, stop in spans:
            at: Any = start if stop - start == 1 else slice(start, stop)
            text = str(start) if stop - start == 1 else f"{start}:{stop}"
            out.append(Region(f"[{lead}{text}]", (slice(None),) * axis + (at,), int(along[start])))
        return out
    return None


def slab_of(ids: np.ndarray, shape: tuple[int, ...]) -> tuple[str, np.ndarray, tuple[int, ...]] | None:
    """The slab of a torch tensor of ``shape`` that ``ids`` (distinct flat positions in it) are, when they are a box
    of it: its text (``"[0:64]"``, ``"[:, 64:128]"``, ``"[3]"`` where one index of a longer axis is taken), the ids
    made positions in the slab, and the slab's shape (an indexed axis dropped). ``None`` when they are no box."""
    index = np.unravel_index(ids.reshape(-1), shape)  # per torch axis, each element's position
    low = [int(a.min()) for a in index]
    high = [int(a.max()) + 1 for a in index]
    if int(np.prod([h - lo for lo, h in zip(low, high)], dtype=np.int64)) != ids.size:
        return None
    kept = [k for k in range(len(shape)) if not (high[k] - low[k] == 1 and shape[k] > 1)]
    box = tuple(high[k] - low[k] for k in kept)
    inner = np.ravel_multi_index([index[k] - low[k] for k in kept], box) if kept else np.zeros(ids.size, np.int64)
    items = [
        str(low[k]) if k not in kept else ":" if (low[k], high[k]) == (0, shape[k]) else f"{low[k]}:{high[k]}"
        for k in range(len(shape))
    ]
    while items and items[-1] == ":":
        items.pop()
    return "[" + ", ".join(items) + "]", inner.reshape(ids.shape).astype(ids.dtype), box


def unread_slabs(read: Sequence[str], shape: tuple[int, ...]) -> list[str] | None:
    """The slabs of a torch tensor of ``shape`` that none of the ``read`` slabs (:func:`slab_of`'s texts, all
    ranges along one axis, the others whole) covers, as slab texts (``["[0:2]"]``); ``None`` where the read
    slabs are not such ranges (an index, two cut axes): no slab rule says what is left."""
    spans: list[tuple[int, int]] = []
    axis: int | None = None
    for text in read:
        items = [i.strip() for i in text[1:-1].split(",")]
        cut = [k for k, item in enumerate(items) if item != ":"]
        if len(cut) != 1 or ":" not in items[cut[0]] or axis not in (None, cut[0]):
            return None
        axis = cut[0]
        start, stop = items[axis].split(":")
        spans.append((int(start or 0), int(stop) if stop else shape[axis]))
    if axis is None:
        return None
    gaps: list[tuple[int, int]] = []
    at = 0
    for low, high in sorted(spans):
        if low > at:
            gaps.append((at, low))
        at = max(at, high)
    if at < shape[axis]:
        gaps.append((at, shape[axis]))
    return ["[" + ", ".join([":"] * axis + [f"{low}:{high}"]) + "]" for low, high in gaps]


def _factors(profile: np.ndarray) -> list[tuple[int, int]] | None:
    """``profile`` (ids along one flax axis, less the first) as elementary axes ``(size, stride)``, outer first:
    runs of one stride, the axis split where the stride breaks. ``None`` when it is no such product."""
    n = len(profile)
    if n == 1:
        return []
    stride = int(profile[1])
    run = 1
    while run < n and profile[run] == run * stride:
        run += 1
    while n % run:  # the run must tile the axis
        run -= 1
    if run < 2:
        return None
    tiles = profile.reshape(n // run, run)  # (outer, run)
    if not (tiles == tiles[:, :1] + np.arange(run) * stride).all():
        return None
    outer = _factors(tiles[:, 0])
    return None if outer is None else [*outer, (run, stride)]


def layout_of(ids: np.ndarray, torch_shape: Shape) -> str | None:
    """The einops pattern ``torch -> flax`` that takes an array of ``torch_shape`` to ``ids`` (each element's
    flat position in the tensor), ``"identity"`` for none; ``None`` when no permutation-and-reshape does."""
    flax_shape = ids.shape
    if ids.size == 0 or ids.flat[0] != ids.min():
        return None
    axes: list[list[tuple[int, int]]] = []  # per flax axis: its elementary (size, stride), outer first
    for j in range(len(flax_shape)):
        at_origin = (0,) * j + (slice(None),) + (0,) * (ids.ndim - j - 1)  # along axis j, every other index 0
        profile = ids[at_origin].astype(np.int64) - ids.flat[0]  # (n,)
        found = _factors(profile)
        if found is None:
            return None
        axes.append(found)
    strides = [int(np.prod(torch_shape[k + 1 :], dtype=np.int64)) for k in range(len(torch_shape))]
    owner: dict[tuple[int, int], int] = {}  # (flax axis, factor) -> torch axis
    per_torch: list[list[tuple[int, int, int, int]]] = [[] for _ in torch_shape]  # (stride, size, j, f)
    for j, found in enumerate(axes):
        for f, (size, stride) in enumerate(found):
            k = next((k for k in range(len(torch_shape)) if torch_shape[k] > 1 and strides[k] <= stride), None)
            if k is None or stride % strides[k]:
                return None
            owner[(j, f)] = k
            per_torch[k].append((stride, size, j, f))
    letters = iter(string.ascii_lowercase)
    name: dict[tuple[int, int], str] = {}
    size_of: dict[str, int] = {}
    # unit axes named too, torch's to the module's in order, where both have as many (a 1x1 kernel's pattern is the
    # 3x3 kernel's: "a b c d -> c d b a", which holds for every kernel size); else written 1
    torch_units = [k for k, parts in enumerate(per_torch) if not parts]
    flax_units = [j for j, found in enumerate(axes) if not found]
    paired = len(torch_units) == len(flax_units)
    unit_of = dict(zip(flax_units, torch_units)) if paired else {}
    unit_name: dict[int, str] = {}
    left = []
    for k, parts in enumerate(per_torch):
        parts.sort(reverse=True)  # outer (largest stride) first
        expect = strides[k]
        for stride, size, _, _ in reversed(parts):  # inner first: each stride the product of the ones inside
            if stride != expect:
                return None
            expect *= size
        if expect != strides[k] * torch_shape[k]:
            return None
        if not parts:
            left.append(unit_name.setdefault(k, next(letters)) if paired else "1")
            continue
        names = [name.setdefault((j, f), next(letters)) for _, _, j, f in parts]
        size_of.update((name[(j, f)], size) for _, size, j, f in parts)
        left.append(names[0] if len(names) == 1 else f"({' '.join(names)})")
    right = []
    for j, found in enumerate(axes):
        names = [name[(j, f)] for f in range(len(found))]
        unit = unit_name[unit_of[j]] if j in unit_of else "1"
        right.append(unit if not names else names[0] if len(names) == 1 else f"({' '.join(names)})")
    lhs, rhs = " ".join(left), " ".join(right)
    pattern = "identity" if lhs == rhs else f"{lhs} -> {rhs}"
    if pattern != "identity" and not _sizes_known(left, right):  # "(a b c) d -> d (a c b)": einops needs sizes
        grouped = [n for group in left + right if group.startswith("(") for n in group.strip("()").split()]
        pattern += "; " + ", ".join(f"{n}={size_of[n]}" for n in sorted(set(grouped)))
    return pattern if reproduces(pattern, ids, torch_shape) else None


def _sizes_known(left: list[str], right: list[str]) -> bool:
    """Whether einops reads every axis size of ``left -> right`` (and back) from the two shapes: each axis of a
    group stands alone on the other side."""
    singles = [{g for g in side if not g.startswith("(")} for side in (left, right)]
    return all(
        n in singles[1 - s]
        for s, side in enumerate((left, right))
        for g in side
        if g.startswith("(")
        for n in g.strip("()").split()
    )


def reproduces(pattern: str, ids: np.ndarray, torch_shape: Shape) -> bool:
    """Whether ``pattern`` (or ``"identity"``) takes ``np.arange`` of ``torch_shape`` to exactly ``ids``."""
    size = int(np.prod(torch_shape, dtype=np.int64))
    source = np.arange(size, dtype=np.int32 if size < 2**31 else np.int64).reshape(torch_shape)
    if pattern == "identity":
        return source.shape == ids.shape and bool((source == ids).all())
    try:
        out = parse_layout(pattern).to_flax(source, ids.shape)
    except ValueError:
        return False
    return bool((np.asarray(out) == ids).all())


def describe_part(mask: np.ndarray, what: str) -> str:
    """Which part of an array ``mask`` marks: ``"rows 8:16 of 32"`` or ``"index 2:4 of axis 1 (size 6)"`` for a
    slab, else ``"12 of 64 elements"``; ``what`` says what the part is (``"read"``, ``"left at init"``)."""
    for axis in range(mask.ndim):
        rows = np.moveaxis(mask, axis, 0).reshape(mask.shape[axis], -1)  # (n, rest)
        if not (rows == rows[:, :1]).all():
            continue
        on = np.flatnonzero(rows[:, 0])
        if len(on) and on[-1] - on[0] + 1 == len(on):
            n = mask.shape[axis]
            span = f"{on[0]}:{on[-1] + 1}"
            return f"rows {span} of {n} {what}" if axis == 0 else f"index {span} of axis {axis} (size {n}) {what}"
    return f"{int(mask.sum())} of {mask.size} elements {what}"


_NUMBER = re.compile(r"(?<![0-9])\d+(?![0-9])")  # a number, glued to letters or not (layer2, bn1, blocks.3)


def _unescape(regex: str) -> str:
    return re.sub(r"\\(.)", r"\1", regex)


def _skeleton(key: str, literal: Sequence[int] = ()) -> str:
    """``key`` as a regex with every number (``layers.3.``, ``blocks_3``, ``bn1``) a group, but those at the
    positions ``literal`` (counted from 0) kept as they are: ``layers\\.(\\d+)\\.``."""
    parts = _NUMBER.split(key)
    numbers = _NUMBER.findall(key)
    out = re.escape(parts[0])
    for i, (number, part) in enumerate(zip(numbers, parts[1:])):
        out += (re.escape(number) if i in literal else r"(\d+)") + re.escape(part)
    return out


def fold_families(rules: list[tuple], keys: Sequence[str]) -> list[tuple]:
    r"""Rules whose keys differ only by numbers, with one layout and affine (drop rules: with nothing else), as
    one rule with ``(\d+)`` groups.

    ``rules`` are ``(escaped key, template, layout[, affine])``, one per key, in ``keys``' order (``keys``: every
    key of the state dict). A family folds when a regex matches it and no other key of ``keys``: every number a
    group, else the numbers its members share kept as they are (``downsample\.0\.weight`` beside
    ``downsample\.1\.weight``); and when every number of its templates is one of the key's groups, the same for
    every member, or the same in every member.
    """
    groups: dict[tuple, list[int]] = {}
    for i, rule in enumerate(rules):
        groups.setdefault((_skeleton(_unescape(rule[0])), repr(rule[2:]), rule[1] is None), []).append(i)
    out: list[tuple] = []
    done: set[int] = set()
    for i, rule in enumerate(rules):
        if i in done:
            continue
        members = groups[(_skeleton(_unescape(rule[0])), repr(rule[2:]), rule[1] is None)]
        folded = _fold([rules[m] for m in members], keys) if len(members) > 1 else None
        if folded is None:
            out.append(rule)
            done.add(i)
        else:
            out.append(folded)
            done.update(members)
    return out


def _templates(template: Any) -> tuple[str, ...]:
    """A rule's templates: none (a drop rule), one, a tuple's, or a split's (a dict's values)."""
    if template is None:
        return ()
    if isinstance(template, dict):
        return tuple(template.values())
    return template if isinstance(template, tuple) else (template,)


def _family_regex(raw: list[str], keys: Sequence[str]) -> re.Pattern | None:
    """The regex of a family of keys (``raw``, one skeleton): every number a group, else the numbers all members
    share kept as they are; ``None`` when both also match a key outside it."""
    numbers = [_NUMBER.findall(k) for k in raw]
    shared = [i for i in range(len(numbers[0])) if len({n[i] for n in numbers}) == 1]
    for literal in ((), shared) if shared else ((),):
        regex = re.compile(_skeleton(raw[0], literal))
        if sum(1 for k in keys if regex.fullmatch(k)) == len(raw):
            return regex
    return None


def _general_template(regex: re.Pattern, raw: list[str], templates: list[str]) -> str | None:
    r"""One template that ``regex`` expands, for each member key of ``raw``, to its template of ``templates``: each
    number a group (``\1``) whose value it is in every member, else kept where every member has it; ``None`` when
    the members' templates differ otherwise."""
    groups = [regex.fullmatch(k).groups() for k in raw]  # type: ignore[union-attr]
    parts = [_NUMBER.split(t) for t in templates]
    numbers = [_NUMBER.findall(t) for t in templates]
    if any(p != parts[0] for p in parts):
        return None  # the words around the numbers differ
    out = parts[0][0]
    for slot, part in enumerate(parts[0][1:]):
        values = [n[slot] for n in numbers]
        group = next((g for g in range(len(groups[0])) if all(gs[g] == v for gs, v in zip(groups, values))), None)
        if group is not None:
            out += f"\\{group + 1}"
        elif len(set(values)) == 1:
            out += values[0]
        else:
            return None
        out += part
    return out


def _fold(members: list[tuple], keys: Sequence[str]) -> tuple | None:
    raw = [_unescape(m[0]) for m in members]
    regex = _family_regex(raw, keys)
    if regex is None:
        return None  # the family's regex would take a key outside it
    source = members[0]
    if source[1] is None:
        return (regex.pattern, None, None)
    if isinstance(source[1], dict) and any(list(m[1]) != list(source[1]) for m in members):
        return None  # a split's torch slabs differ between members
    per_member = [_templates(m[1]) for m in members]
    general = []
    for t in range(len(per_member[0])):
        found = _general_template(regex, raw, [templates[t] for templates in per_member])
        if found is None:
            return None
        general.append(found)
    if isinstance(source[1], dict):
        return (regex.pattern, dict(zip(source[1], general)), *source[2:])
    return (regex.pattern, tuple(general) if isinstance(source[1], tuple) else general[0], *source[2:])


def equal_or_nan(a: np.ndarray, value: Any) -> np.ndarray:
    """``a == value`` element-wise, NaN equal to NaN (a loader's filler for what it does not read)."""
    return (a == value) | (np.isnan(a) & np.isnan(value)) if is_floating(np.result_type(a, value)) else a == value


def compact(a: np.ndarray) -> np.ndarray:
    """``a``, as one number broadcast to its shape (no memory) where all its elements are equal."""
    return np.broadcast_to(np.float64(a.flat[0]), a.shape) if a.size and equal_or_nan(a, a.flat[0]).all() else a


def value_summary(value: np.ndarray) -> str:
    """A variable's values in words: a constant, or an array's shape and range."""
    flat = value.ravel()
    if flat.size and equal_or_nan(flat, flat[0]).all():
        return f"constant {float(flat[0])!r}"
    return f"array {tuple(value.shape)} {float(np.nanmin(flat)):.4g}..{float(np.nanmax(flat)):.4g}"


def uniform_value(a: np.ndarray) -> float | None:
    """The one number every element of ``a`` holds; ``None`` where they differ."""
    if a.size and not any(a.strides):  # one number broadcast
        return float(a.flat[0])
    return float(a.flat[0]) if a.size and equal_or_nan(a, a.flat[0]).all() else None


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
