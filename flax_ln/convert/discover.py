r"""Measure a port's own weight loader and return the key map it implements (:meth:`KeyMap.discover`).

A loader from a torch checkpoint is, nearly always, a gather: each element of each flax
variable is one element of one torch tensor, moved, reshaped, copied (ties), cast, perhaps
scaled and offset. :func:`measure` feeds the loader state dicts whose values name their
elements and reads back where each value landed:

* three constant loads (every element 2, then 3, then 5, and 2 again) give each flax
  element's affine ``scale * torch + offset`` and show the elements no load changes (left at
  init) and those that change between two equal loads (initialised at random each call);
* ``K`` digit loads, element ``g`` (its global id over the unique tensors) as ``digit + 2``
  in base ``b`` (digits never 0 or 1, so a variable left at zeros or ones is never id 0);
  ``b`` keeps every value and its image exact integers in the narrowest float seen;
* one check load (``(g * 7919 + 13) % b + 2``) that every decoded element must agree with.

Each variable's ids are then explained by :mod:`flax_ln.convert.discover_layout` (which
tensor fills which slab, through which einops pattern) and written as rules in the key map's
syntax. Everything wrong is listed in one :class:`~flax_ln.convert.ConversionError`. This
module does not import the key map: :meth:`~flax_ln.convert.KeyMap.discover` builds it from
the rules returned here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert.assign import as_numpy
from flax_ln.convert.discover_layout import Region, describe_part, fold_families, layout_of, regions
from flax_ln.convert.errors import ConversionError
from flax_ln.convert.ties import find_ties
from flax_ln.convert.trees import LinenTree, NNXTree, PytreeTree, VariableTree

# The largest integer each float holds exactly, with every integer below it.
_EXACT = {"bfloat16": 2**8, "float16": 2**11, "float32": 2**24, "float64": 2**53}
_MAX_BASE = 2**20  # ids combine in int64: a digit this wide keeps every product far from overflow


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What :meth:`~flax_ln.convert.KeyMap.discover` saw the loader do, beside the rules it wrote.

    Args:
      dropped: torch key -> ``"all"`` or the part the loader never read (e.g. ``"rows 8:16 of 32"``).
      unfilled: flax path -> what it holds, left at init (``"constant 0.0"``, ``"array (64,) -1.2..3.4"``).
      offsets: flax path (with its slice) -> ``(scale, offset)`` where the loader wrote ``scale * torch + offset``
        with other than ``(1, 0)``.
      ties: torch key -> the flax paths its one tensor fills, where it fills more than one.
      loads: how many times the loader ran.
      comments: rule index -> why the rule is there (for ``to_source(comments=...)``).
    """

    dropped: dict[str, str] = dataclasses.field(default_factory=dict)
    unfilled: dict[str, str] = dataclasses.field(default_factory=dict)
    offsets: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    ties: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    loads: int = 0
    comments: dict[int, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"discovered from {self.loads} loads of the loader"]
        lines += [f"  dropped by the loader: {k} ({why})" for k, why in self.dropped.items()]
        lines += [f"  left at init: {p} ({what})" for p, what in self.unfilled.items()]
        lines += [
            f"  written as scale * torch + offset: {p} (scale {s:g}, offset {o:g})"
            for p, (s, o) in self.offsets.items()
        ]
        lines += [f"  tie: {k} -> {', '.join(paths)}" for k, paths in self.ties.items()]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Measured:
    """The rules, constants and :class:`Discovery` that :func:`measure` found."""

    rules: list[tuple]
    constants: dict[str, Any]
    discovery: Discovery


@dataclasses.dataclass
class _Var:
    """One flax variable under measurement: its affine, then its decoded ids (-1 where left at init)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    required: bool
    first: Any  # the value of the first constant load, in the variable's dtype; None once not needed
    scale: Any = None  # float64 arrays of the variable's shape once measured
    offset: Any = None
    ids: Any = None
    problem: str | None = None
    random: bool = False  # a different value at each load: initialised at random, never read from torch


def _tree(loaded: Any, kind: str | None) -> VariableTree:
    if isinstance(loaded, nnx.Module):
        return NNXTree(loaded)
    if isinstance(loaded, Mapping):
        if kind == "linen":
            return LinenTree(dict(loaded))
        if kind == "function":
            return PytreeTree(dict(loaded))
        raise TypeError(
            f"KeyMap.discover: the loader returned a dict but kind={kind!r}; pass kind='linen' for Linen variables "
            "(collections at the top: {'params': ...}) or kind='function' for a parameter pytree"
        )
    raise TypeError(
        f"KeyMap.discover: the loader must return an nnx.Module or a dict (with kind='linen' or 'function'), "
        f"got {type(loaded).__name__}"
    )


def _floating(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


class _Probe:
    """Runs the loader on probe state dicts and reads back every floating variable."""

    def __init__(self, loader: Callable, like: Any, takes: str, kind: str | None):
        if takes not in ("state_dict", "folder"):
            raise ValueError(f"KeyMap.discover: takes= is 'state_dict' or 'folder', got {takes!r}")
        self.loader, self.like, self.takes, self.kind = loader, like, takes, kind
        state = {k: as_numpy(v) for k, v in like.state_dict().items()}
        self.aliases = {a: name for name, keys in find_ties(like).items() for a in keys if a != name}
        self.keys = [k for k in state if k not in self.aliases]  # one per tensor
        self.shapes = {k: tuple(state[k].shape) for k in self.keys}
        self.dtypes = {k: state[k].dtype for k in state}
        self.originals = state
        self.probed = [k for k in self.keys if np.issubdtype(self.dtypes[k], np.number) or _floating(self.dtypes[k])]
        sizes = [int(np.prod(self.shapes[k], dtype=np.int64)) for k in self.probed]
        self.starts = np.cumsum([0, *sizes])  # tensor i holds ids starts[i]:starts[i+1]
        self.total = int(self.starts[-1])
        self.trainable = {n for n, _ in like.named_parameters()}
        self.loads = 0

    def run(self, values: Callable[[np.ndarray], np.ndarray]) -> VariableTree:
        """Load a state dict whose element ``g`` is ``values(g)``; the loaded flax side as a variable tree."""
        index = np.int32 if self.total < 2**31 else np.int64
        state = {}
        for i, key in enumerate(self.probed):
            ids = np.arange(self.starts[i], self.starts[i + 1], dtype=index).reshape(self.shapes[key])
            state[key] = values(ids).astype(self.dtypes[key])
        for key, array in self.originals.items():
            if key in self.aliases:
                state[key] = state.get(self.aliases[key], array)
            elif key not in state:
                state[key] = array
        self.loads += 1
        if self.takes == "state_dict":
            return _tree(self.loader(state), self.kind)
        with tempfile.TemporaryDirectory() as folder:
            import safetensors.numpy

            safetensors.numpy.save_file(
                {k: np.ascontiguousarray(v) for k, v in state.items()}, f"{folder}/model.safetensors"
            )
            del state  # the loader reads the file: the probe arrays need not stay
            config = getattr(self.like, "config", None)
            if config is not None and hasattr(config, "to_json_file"):
                config.to_json_file(str(Path(folder) / "config.json"))
            return _tree(self.loader(folder), self.kind)


def _compact(a: np.ndarray) -> np.ndarray:
    """``a``, as one number broadcast to its shape (no memory) where all its elements are equal."""
    return np.broadcast_to(np.float64(a.flat[0]), a.shape) if a.size and (a == a.flat[0]).all() else a


def _summary(value: np.ndarray) -> str:
    flat = value.ravel()
    if flat.size and (flat == flat[0]).all():
        return f"constant {float(flat[0])!r}"
    return f"array {tuple(value.shape)} {float(flat.min()):.4g}..{float(flat.max()):.4g}"


def _uniform(a: np.ndarray) -> float | None:
    return float(a.flat[0]) if a.size and (a == a.flat[0]).all() else None


def measure(
    loader: Callable,
    like: Any,
    *,
    takes: str = "state_dict",
    kind: str | None = None,
    allow_unfilled: Iterable[str] = (),
    allow_dropped: Iterable[str] = (),
) -> Measured:
    """The rules (key map syntax), constants and :class:`Discovery` of ``loader``; see the module docstring and
    :meth:`~flax_ln.convert.KeyMap.discover` for the arguments. One :class:`ConversionError` lists every problem."""
    probe = _Probe(loader, like, takes, kind)
    allow_unfilled, allow_dropped = list(allow_unfilled), list(allow_dropped)
    # Memory: one loaded model at a time, read a variable at a time; each variable's first value (its own dtype)
    # until its affine is known, kept only where some element is left at init; scale and offset as one number
    # broadcast where uniform; then the ids (int32 below 2**31 elements).
    tree = probe.run(functools.partial(_constant, 2))
    info = {p: spec for p, spec in tree.variables().items() if _floating(spec[1])}
    variables = {
        p: _Var(shape, np.dtype(dtype), required, tree.read(p)) for p, (shape, dtype, required) in info.items()
    }
    del tree
    again = probe.run(functools.partial(_constant, 2))
    for path, var in variables.items():
        if not np.array_equal(var.first, again.read(path), equal_nan=True):
            var.random = True  # reported as left at init: no torch element explains a value that moves by itself
            var.scale = var.offset = _compact(np.zeros(var.shape))
    del again
    three = probe.run(functools.partial(_constant, 3))
    for path, var in variables.items():
        if not var.random:
            v2 = var.first.astype(np.float64)
            scale = three.read(path).astype(np.float64) - v2
            var.scale, var.offset = _compact(scale), _compact(v2 - 2 * scale)
    del three
    five = probe.run(functools.partial(_constant, 5))
    for path, var in variables.items():
        if var.random:
            continue
        v5 = five.read(path).astype(np.float64)
        tol = 4 * float(jnp.finfo(var.dtype).eps) * np.maximum(1.0, np.abs(v5))
        if not (np.abs(v5 - (5 * var.scale + var.offset)) <= tol).all():
            var.problem = (
                "is not a gather: its values for constant loads 2, 3, 5 are not scale * torch + offset "
                "(not a function of one torch element)"
            )
            var.scale = var.offset = None
        if var.scale is None or (var.scale != 0).all():
            var.first = None  # needed only to report what a load leaves at init
    del five
    digits = [v for v in variables.values() if v.scale is not None]
    limit = min(
        [_EXACT.get(np.dtype(v.dtype).name, 2**24) for v in digits]
        + [_EXACT.get(np.dtype(d).name, 2**53) for d in probe.dtypes.values() if _floating(d)]
        + [_MAX_BASE]
    )
    reach = max([float(np.abs(v.scale).max(initial=0)) for v in digits] + [1.0])
    shift = max([float(np.abs(v.offset[v.scale != 0]).max(initial=0)) for v in digits] + [0.0])
    base = int((limit - shift) // reach) - 2  # the largest digit + 2, scaled and offset, stays exact
    if base < 2:
        raise ConversionError(
            header="KeyMap.discover: the loader's scales leave no exact probe values",
            hint=f"narrowest float holds integers to {limit}; the largest scale seen is {reach:g}",
        )
    k_loads = max(1, math.ceil(math.log(max(probe.total, 2)) / math.log(base)))
    index_dtype = np.int32 if probe.total < 2**31 else np.int64
    for var in digits:
        var.ids = np.zeros(var.shape, index_dtype)
    for k in range(k_loads):
        loaded = probe.run(functools.partial(_digit, base**k, base))
        for path, var in variables.items():
            if var.ids is not None:
                _decode(var, loaded.read(path), base, base**k)
        del loaded
    check = probe.run(lambda g: (g.astype(np.int64) * 7919 + 13) % base + 2)
    for path, var in variables.items():
        if var.ids is None:
            continue
        if not _agrees(var, check.read(path), base):
            var.problem = var.problem or "not a function of one torch element: its digits do not agree across loads"
            var.ids = None
    del check
    return _explain(probe, variables, allow_unfilled, allow_dropped)


def _constant(c: int, g: np.ndarray) -> np.ndarray:
    return np.full(g.shape, c)


def _digit(place: int, base: int, g: np.ndarray) -> np.ndarray:
    """Digit ``log_base(place)`` of each id, plus 2: never 0 or 1."""
    return (g // place) % base + 2


_CHUNK = 1 << 22  # elements decoded at once: float64 temporaries of 32 MiB, whatever the variable's size


def _scalar_or_flat(a: np.ndarray) -> Any:
    """A broadcast number (all strides 0) as that number, else ``a`` flattened."""
    return np.float64(a.flat[0]) if not any(a.strides) else a.reshape(-1)


def _ratios(var: _Var, value: np.ndarray) -> Iterator[tuple[slice, Any, np.ndarray]]:
    """``(part, filled, (value - offset) / scale)`` over the flat variable, a chunk at a time."""
    value = value.reshape(-1)
    scale, offset = _scalar_or_flat(var.scale), _scalar_or_flat(var.offset)
    for start in range(0, value.size, _CHUNK):
        part = slice(start, start + _CHUNK)
        s = scale if np.ndim(scale) == 0 else scale[part]
        o = offset if np.ndim(offset) == 0 else offset[part]
        filled = s != 0
        yield part, filled, (value[part].astype(np.float64) - o) / np.where(filled, s, 1)


def _decode(var: _Var, value: np.ndarray, base: int, place: int) -> None:
    assert var.ids is not None
    ids = var.ids.reshape(-1)  # a view: ids is contiguous
    for part, filled, ratio in _ratios(var, value):
        digit = ratio - 2
        exact = np.rint(digit)
        if np.any(filled & ((np.abs(digit - exact) > 1e-6) | (exact < 0) | (exact >= base))):
            var.problem = "not a function of one torch element: a probe value came back as no digit"
            var.ids = None
            return
        ids[part] += np.where(filled, exact * place, 0).astype(ids.dtype)


def _agrees(var: _Var, value: np.ndarray, base: int) -> bool:
    """Whether the check load's ``value`` is ``(g * 7919 + 13) % base + 2`` of every decoded id ``g``."""
    assert var.ids is not None
    ids = var.ids.reshape(-1)
    for part, filled, ratio in _ratios(var, value):
        want = (ids[part].astype(np.int64) * 7919 + 13) % base + 2
        if not np.all((np.rint(ratio) == want) | ~filled):
            return False
    return True


def _admitted(name: str, patterns: list[str]) -> bool:
    return any(re.fullmatch(p, name) for p in patterns)


def _explain(probe: _Probe, variables: dict[str, _Var], allow_unfilled, allow_dropped) -> Measured:
    mismatched: list[tuple[str, str]] = []
    unfilled_errors: list[tuple[str, str]] = []
    unfilled: dict[str, str] = {}
    constants: dict[str, Any] = {}
    offsets: dict[str, tuple[float, float]] = {}
    targets: dict[int, list[tuple[str, str, str, tuple[float, float]]]] = {}  # tensor -> (path, index, layout, affine)
    read = np.zeros(probe.total, bool)
    for path, var in variables.items():
        if var.problem is not None:
            unfilled_errors.append((path, var.problem))
            continue
        assert var.ids is not None and var.scale is not None and var.offset is not None
        filled = var.scale != 0
        if not filled.any():
            if not var.required and not _admitted(path, allow_unfilled):
                continue  # an RNG key, a cache: no one asks a loader to fill it
            unfilled[path] = _summary(var.first) + (", a different value at each load" if var.random else "")
            if _admitted(path, allow_unfilled):
                value = var.first
                constants[re.escape(path)] = float(value.flat[0]) if _uniform(value) is not None else value
            else:
                unfilled_errors.append(
                    (
                        path,
                        f"left at init by the loader ({unfilled[path]}); "
                        f"admit it with allow_unfilled=[{re.escape(path)!r}]",
                    )
                )
            continue
        if not filled.all():
            unfilled_errors.append((path, f"partly filled: {describe_part(~filled, 'left at init')}"))
            continue
        tensor_of = np.searchsorted(probe.starts, var.ids, side="right") - 1
        found = regions(tensor_of, np.diff(probe.starts))
        if found is None:
            unfilled_errors.append((path, "filled from several torch tensors, not in slabs along one axis"))
            continue
        for region in found:
            problem = _region(probe, path, var, region, targets, offsets, read)
            if problem:
                unfilled_errors.append((path + region.index, problem))
        var.ids = var.scale = var.offset = None  # explained: free them
    for tensor, ts in targets.items():
        layouts: dict[str, str] = {}
        for p, _, layout, _ in ts:
            if layouts.setdefault(p, layout) != layout:
                unfilled_errors.append(
                    (
                        p,
                        f"filled by {probe.probed[tensor]!r} through two layouts ({layouts[p]!r} and {layout!r}); "
                        "a key map copies one tensor into a variable through one layout",
                    )
                )
    dropped, rules, comments = {}, [], {}
    for i, key in enumerate(probe.probed):
        got = read[probe.starts[i] : probe.starts[i + 1]].reshape(probe.shapes[key])
        if got.all():
            continue
        dropped[key] = "all" if not got.any() else describe_part(~got, "never read")
        if got.any():
            mismatched.append((key, f"only part read by the loader: {dropped[key]}"))
        elif key in probe.trainable and not _admitted(key, allow_dropped):
            mismatched.append(
                (key, f"a parameter the loader never reads; admit it with allow_dropped=[{re.escape(key)!r}]")
            )
    if mismatched or unfilled_errors:
        raise ConversionError(
            mismatched=mismatched,
            unfilled=unfilled_errors,
            header="KeyMap.discover: the loader is not a key map",
            hint="fix the loader, or admit a parameter it leaves at init (allow_unfilled=) or a key it drops "
            "(allow_dropped=), regexes matched in full",
        )
    ties: dict[str, list[str]] = {}
    for i, key in enumerate(probe.probed):
        ts = targets.get(i, [])
        if not ts:
            continue
        names = [p + index for p, index, _, _ in ts]
        if len(ts) > 1:
            ties[key] = names
        affine = ts[0][3]
        layouts_of = [None if t[2] == "identity" else t[2] for t in ts]
        template: Any = names[0] if len(ts) == 1 else tuple(names)
        rule: tuple = (re.escape(key), template, layouts_of[0] if len(ts) == 1 else tuple(layouts_of))
        if affine != (1.0, 0.0):
            rule += ({"scale": affine[0], "offset": affine[1]},)
        rules.append(rule)
    rules = fold_families(rules, probe.probed)
    for key in probe.keys:
        if key in dropped or key not in probe.probed:
            comments[len(rules)] = "dropped by the loader" if key in dropped else "not a number: not probed"
            rules.append((re.escape(key), None, None))
    for alias, name in probe.aliases.items():
        comments[len(rules)] = f"one tensor with {name!r}"
        rules.append((re.escape(alias), None, None))
    for i, rule in enumerate(rules):
        if rule[1] is not None and any(k in ties for k in probe.probed if re.fullmatch(rule[0], k)):
            comments[i] = "a tie: one torch tensor copied into " + ", ".join(
                rule[1] if isinstance(rule[1], tuple) else (rule[1],)
            )
    discovery = Discovery(dropped, unfilled, offsets, ties, probe.loads, comments)
    return Measured(rules, constants, discovery)


def _region(probe: _Probe, path: str, var: _Var, region: Region, targets, offsets, read) -> str | None:
    """Explain one slab: its tensor, layout and affine, recorded in ``targets`` / ``offsets`` / ``read``; or why not."""
    assert var.ids is not None and var.scale is not None and var.offset is not None
    tensor = region.tensor
    key = probe.probed[tensor]
    ids = np.asarray(var.ids[region.selector]).astype(np.int64) - probe.starts[tensor]
    size = int(probe.starts[tensor + 1] - probe.starts[tensor])
    counts = np.bincount(ids.ravel(), minlength=size)
    if (counts > 1).any():
        return f"repeats elements of {key!r} (a broadcast or non-strided gather), not a permutation of it"
    if ids.size != size:
        return f"holds {ids.size} of the {size} elements of {key!r}: the tensor is only partly read"
    scale, offset = _uniform(np.asarray(var.scale[region.selector])), _uniform(np.asarray(var.offset[region.selector]))
    if scale is None or offset is None:
        return f"scale and offset vary within what {key!r} fills: not one affine per tensor"
    layout = layout_of(ids, probe.shapes[key])
    if layout is None:
        return (
            f"holds the elements of {key!r} (shape {probe.shapes[key]}) in an order no einops rearrange of it "
            "gives (a flip, a roll, a gather)"
        )
    read[probe.starts[tensor] : probe.starts[tensor + 1]] = True
    affine = (scale, offset)
    if affine != (1.0, 0.0):
        offsets[path + region.index] = affine
    for other in targets.get(tensor, []):
        if other[3] != affine:
            return f"{key!r} fills it with scale/offset {affine} but {other[0]}{other[1]} with {other[3]}"
    targets.setdefault(tensor, []).append((path, region.index, layout, affine))
    return None
