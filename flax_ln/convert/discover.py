r"""Measure a port's own weight loader and return the key map it implements (:meth:`KeyMap.discover`).

A loader from a torch checkpoint is, nearly always, a gather: each element of each flax
variable is one element of one torch tensor, moved, reshaped, copied (ties), cast, perhaps
scaled and offset. :func:`measure` feeds the loader state dicts whose values name their
elements and reads back where each value landed:

* three constant loads (every element 2, then 3, then 5, and 2 again) give each flax
  element's affine ``scale * torch + offset`` and show the elements no load changes (left at
  init) and those that change between two equal loads (initialised at random each call); the load
  of 5 is ``5 + 2**-7 + 2**-13`` where every probed tensor is float32 or float64, which a loader
  rounding each value to float16 (bfloat16) gives back as ``5 + 2**-7`` (``5``): the rounding is
  named, written as the rule's ``round``, and the digits kept within what that type holds exactly;
* ``K`` digit loads, element ``g`` (its global id over the unique tensors) as ``digit + 2``
  in base ``b`` (digits never 0 or 1, so a variable left at zeros or ones is never id 0);
  ``b`` keeps every value and its image exact integers in the narrowest float seen;
* one check load (``(g * 7919 + 13) % b + 2``) that every decoded element must agree with; where
  every probed tensor is floating and no variable is offset its values are scaled below 1 (by a
  power of two, so still exact), the size of real weights, so that a loader whose layout depends on the values it is
  given (it transposes only when the mean is large) lands them elsewhere and is refused rather
  than described by the branch the other loads took. A map found by probing assumes a loader whose
  layout is a function of the keys and shapes alone; a branch no probe takes stays unseen.

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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from flax_ln.convert.assign import as_numpy, is_floating
from flax_ln.convert.discover_layout import (
    CHUNK,
    FIVE,
    Region,
    affine_holds,
    agrees,
    all_nonzero,
    chunks,
    compact,
    constant,
    decode,
    describe_part,
    digit,
    fold_families,
    largest_reach,
    layout_of,
    measured_affine,
    regions,
    rounding,
    same,
    slab_of,
    uniform_value,
    unread_slabs,
    value_summary,
)
from flax_ln.convert.errors import ConversionError
from flax_ln.convert.tensor_files import saved_names, write_streamed
from flax_ln.convert.ties import find_ties
from flax_ln.convert.trees import VariableTree, loaded_tree, read_values

# The largest integer each float holds exactly, with every integer below it.
_EXACT = {"bfloat16": 2**8, "float16": 2**11, "float32": 2**24, "float64": 2**53}
_MAX_BASE = 2**20  # ids combine in int64: a digit this wide keeps every product far from overflow
NOT_ONE_ELEMENT = "not a function of one torch element: its digits do not agree across loads"
VALUE_DEPENDENT = (
    "not a function of one torch element, or depends on the values it is given: the check's ids, scaled below 1 "
    "(the size of real weights), landed elsewhere; a loader that branches on its inputs' values has no key map: "
    "make its layout a function of the keys and shapes"
)


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What :meth:`~flax_ln.convert.KeyMap.discover` saw the loader do, beside the rules it wrote.

    Args:
      dropped: torch key -> ``"all"``: a tensor the loader never read; or the slabs of it the loader does not read
        (``"[0:2]"``), where ``allow_dropped=`` admits them as ``key[0:2]`` (a slab read unadmitted is an error).
      unfilled: flax path -> what it holds, left at init (``"constant 0.0"``, ``"array (64,) -1.2..3.4"``).
      offsets: flax path (with its slice) -> ``(scale, offset)`` where the loader wrote ``scale * torch + offset``
        with other than ``(1, 0)``.
      ties: torch key -> the flax paths its one tensor fills, where it fills more than one.
      loads: how many times the loader ran.
      comments: rule index -> why the rule is there (for ``to_source(comments=...)``).
      rounded: flax path -> the narrower float type the loader rounds its values to on the way (``"float16"``),
        written as its rule's ``round`` (the affine dict's ``"round"`` key).
    """

    dropped: dict[str, str] = dataclasses.field(default_factory=dict)
    unfilled: dict[str, str] = dataclasses.field(default_factory=dict)
    offsets: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    ties: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    loads: int = 0
    comments: dict[int, str] = dataclasses.field(default_factory=dict)
    rounded: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"discovered from {self.loads} loads of the loader"]
        for narrow in sorted(set(self.rounded.values())):
            paths = [p for p, n in self.rounded.items() if n == narrow]
            shown = ", ".join(paths[:3]) + (f", ... ({len(paths)})" if len(paths) > 3 else "")
            lines.append(
                f"  the loader rounds weights to {narrow}: {shown} (written as the rules' round; the port gets "
                f"what its own loader gives, so a comparison in a wider dtype shows the rounding: compare in "
                f"{narrow}, or admit it)"
            )
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
    rounds: str | None = None  # the narrower float type the loader rounds its values to (float16), if any
    abstract: bool = False  # never filled: the loader left it a jax.ShapeDtypeStruct (no values)


class _Probe:
    """Runs the loader on probe state dicts and reads back every floating variable."""

    def __init__(self, loader: Callable, like: Any, takes: str, kind: str | None):
        if takes not in ("state_dict", "folder"):
            raise ValueError(f"KeyMap.discover: takes= is 'state_dict' or 'folder', got {takes!r}")
        self.loader, self.like, self.takes, self.kind = loader, like, takes, kind
        state = {k: as_numpy(v) for k, v in like.state_dict().items()}
        self.aliases = {a: name for name, keys in find_ties(like).items() for a in keys if a != name}
        self.keys = [k for k in state if k not in self.aliases]  # one per tensor
        self.shapes = {k: tuple(state[k].shape) for k in state}
        self.dtypes = {k: state[k].dtype for k in state}
        self.originals = state
        self.probed = [k for k in self.keys if np.issubdtype(self.dtypes[k], np.number) or is_floating(self.dtypes[k])]
        sizes = [int(np.prod(self.shapes[k], dtype=np.int64)) for k in self.probed]
        self.starts = np.cumsum([0, *sizes])  # tensor i holds ids starts[i]:starts[i+1]
        self.total = int(self.starts[-1])
        self.trainable = {n for n, _ in like.named_parameters()}
        self.loads = 0
        self.slabs: dict[tuple[int, str], str] = {}  # (tensor, flax name) -> the torch slab it holds (a split)
        self.slab_sizes: dict[tuple[int, str], int] = {}  # and its element count

    def run(self, values: Callable[[np.ndarray], np.ndarray]) -> VariableTree:
        """Load a state dict whose element ``g`` is ``values(g)``; the loaded flax side as a variable tree.

        The probe values are made a block of ids at a time: a folder's file is written block by block (no probe
        tensor is ever whole in memory), a state dict is filled tensor by tensor and dropped when the loader returns.
        """
        order = [*self.probed, *(k for k in self.originals if k not in self.probed)]
        self.loads += 1
        if self.takes == "state_dict":
            state: dict[str, np.ndarray] = {}
            for key in order:  # an alias is its tensor's array, as in the torch state dict: one copy of the tie
                source = self.aliases.get(key, key)
                state[key] = state[source] if source in state else self._array(key, values)
            return loaded_tree(self.loader(state), self.kind)
        saved = saved_names(self.like)  # the names a transformers folder gives the tensors transformers 5 renames
        with tempfile.TemporaryDirectory() as folder:
            write_streamed(
                Path(folder) / "model.safetensors",
                [
                    (
                        saved.get(key, key),
                        self.shapes[key],
                        self.dtypes[key],
                        functools.partial(self._blocks, key, values),
                    )
                    for key in order
                ],
                metadata={"format": "pt"},  # as torch's save_file writes it: transformers' from_pt loaders ask
            )
            config = getattr(self.like, "config", None)
            if config is not None and hasattr(config, "to_json_file"):
                config.to_json_file(str(Path(folder) / "config.json"))
            return loaded_tree(self.loader(folder), self.kind)

    def _blocks(self, key: str, values: Callable[[np.ndarray], np.ndarray]) -> Iterator[np.ndarray]:
        """``key``'s probe values (an alias: its tensor's; not probed: its original), flat, a block at a time."""
        source = self.aliases.get(key, key)
        if source not in self.probed:
            yield self.originals[key].reshape(-1)
            return
        i = self.probed.index(source)
        index = np.int32 if self.total < 2**31 else np.int64
        for start in range(int(self.starts[i]), int(self.starts[i + 1]), CHUNK):
            stop = min(start + CHUNK, int(self.starts[i + 1]))
            yield values(np.arange(start, stop, dtype=index)).astype(self.dtypes[key])

    def _array(self, key: str, values: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """``key``'s probe tensor, whole (for a loader that takes a state dict)."""
        source = self.aliases.get(key, key)
        if source not in self.probed:
            return self.originals[key]
        out = np.empty(self.shapes[key], self.dtypes[key])
        flat, at = out.reshape(-1), 0  # a view: out is contiguous
        for block in self._blocks(key, values):
            flat[at : at + block.size] = block
            at += block.size
        return out


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
    # Memory: one loaded model at a time, read a variable at a time and compared, decoded or checked a chunk at a
    # time (float64 temporaries of CHUNK elements); each variable's first value (its own dtype) until its affine is
    # known, kept only where some element is left at init; scale and offset as one number broadcast where uniform;
    # then the ids (int32 below 2**31 elements).
    tree = probe.run(functools.partial(constant, 2))
    info = {p: spec for p, spec in tree.variables().items() if is_floating(spec[1])}
    variables = {
        p: _Var(shape, np.dtype(dtype), required, read_values(tree, p)) for p, (shape, dtype, required) in info.items()
    }
    for var in variables.values():
        if var.first is None:
            var.abstract = var.random = True  # skipped by every load below
    del tree
    again = probe.run(functools.partial(constant, 2))
    for path, var in variables.items():
        if not var.abstract and not same(var.first, again.read(path)):
            var.random = True  # reported as left at init: no torch element explains a value that moves by itself
            var.scale = var.offset = compact(np.zeros(var.shape))
    del again
    three = probe.run(functools.partial(constant, 3))
    for path, var in variables.items():
        if not var.random:
            var.scale, var.offset = measured_affine(var.first, three.read(path))
            if all_nonzero(var.scale):
                var.first = None  # needed only to report what a load leaves at init
    del three
    # load 5 carries bits float32 holds and float16 (and bfloat16) do not, where every probed tensor holds them: a
    # loader that rounds each value to a narrower float (keras-hub's Mistral converter: float16) is seen, and named
    wide = all(np.dtype(probe.dtypes[k]) in (np.dtype(np.float32), np.dtype(np.float64)) for k in probe.probed)
    five_value = FIVE if wide else 5.0
    five = probe.run(functools.partial(constant, five_value))
    for path, var in variables.items():
        if var.random:
            continue
        value = five.read(path)
        if not affine_holds(var, value, five_value):
            var.rounds = rounding(var, value, five_value) if wide else None
        if var.rounds is None and not affine_holds(var, value, five_value):
            var.problem = (
                "is not a gather: its values for constant loads 2, 3, 5 are not scale * torch + offset "
                "(not a function of one torch element)"
            )
            var.scale = var.offset = None
        if var.scale is None or all_nonzero(var.scale):
            var.first = None
    del five
    digits = [v for v in variables.values() if v.scale is not None and not v.abstract]
    limit = min(
        [_EXACT.get(np.dtype(v.dtype).name, 2**24) for v in digits]
        + [_EXACT[v.rounds] for v in digits if v.rounds is not None]  # the loader's own rounding keeps this many
        + [_EXACT.get(np.dtype(d).name, 2**53) for d in probe.dtypes.values() if is_floating(d)]
        + [_MAX_BASE]
    )
    reach = max([largest_reach(v)[0] for v in digits] + [1.0])
    shift = max([largest_reach(v)[1] for v in digits] + [0.0])
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
        loaded = probe.run(functools.partial(digit, base**k, base))
        for path, var in variables.items():
            if var.ids is not None:
                decode(var, loaded.read(path), base, base**k)
        del loaded
    # the check's values below 1, as real weights are, where every probed tensor is floating (a power-of-two scale
    # keeps them exact) and no variable is offset (1 + a small value would lose its digits): a loader whose layout
    # depends on the values lands them elsewhere
    scaled = all(is_floating(probe.dtypes[k]) for k in probe.probed) and shift == 0
    unit = 2.0 ** -math.ceil(math.log2(base + 2)) if scaled else 1.0
    check = probe.run(lambda g: ((g.astype(np.int64) * 7919 + 13) % base + 2) * unit)
    for path, var in variables.items():
        if var.ids is None:
            continue
        if not agrees(var, check.read(path), base, unit):
            var.problem = var.problem or (VALUE_DEPENDENT if scaled else NOT_ONE_ELEMENT)
            var.ids = None
    del check
    return _explain(probe, variables, allow_unfilled, allow_dropped)


def _tensor_of(starts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each id's torch tensor (its position among the probed tensors), in the smallest integer dtype that holds it,
    found a chunk at a time (no int64 array of the variable's size)."""
    dtype = np.int16 if len(starts) < 2**15 else np.int32
    out = np.empty(ids.shape, dtype)
    flat, source = out.reshape(-1), ids.reshape(-1)  # views: both contiguous
    for part in chunks(source.size):
        flat[part] = np.searchsorted(starts, source[part], side="right") - 1
    return out


def _admitted(name: str, patterns: list[str]) -> bool:
    return any(re.fullmatch(p, name) for p in patterns)


def _explain(probe: _Probe, variables: dict[str, _Var], allow_unfilled, allow_dropped) -> Measured:
    mismatched: list[tuple[str, str]] = []
    dropped: dict[str, str] = {}
    unfilled_errors: list[tuple[str, str]] = []
    unfilled: dict[str, str] = {}
    constants: dict[str, Any] = {}
    offsets: dict[str, tuple[float, float]] = {}
    targets: dict[int, list[tuple[str, str, str, tuple[float, float]]]] = {}  # tensor -> (path, index, layout, affine)
    read = np.zeros(len(probe.probed), bool)  # per torch tensor: whether any variable holds its elements
    for path, var in variables.items():
        if var.problem is not None:
            unfilled_errors.append((path, var.problem))
            continue
        if var.abstract:
            what = "never filled: the loader left it abstract (a jax.ShapeDtypeStruct, as nnx.eval_shape builds it)"
            if _admitted(path, allow_unfilled):
                unfilled[path] = what
            else:
                unfilled_errors.append((path, f"{what}; admit it with allow_unfilled=[{re.escape(path)!r}]"))
            continue
        assert var.ids is not None and var.scale is not None and var.offset is not None
        filled = var.scale != 0
        if not filled.any():
            if not var.required and not _admitted(path, allow_unfilled):
                continue  # an RNG key, a cache: no one asks a loader to fill it
            if var.first.size and np.isnan(var.first).all():  # a loader's filler for a variable it has no key for
                unfilled[path] = what = "never filled: the loader filled it with NaN"
            else:
                unfilled[path] = value_summary(var.first) + (", a different value at each load" if var.random else "")
                what = f"left at init by the loader ({unfilled[path]})"
            if _admitted(path, allow_unfilled):
                value = var.first
                constants[re.escape(path)] = float(value.flat[0]) if uniform_value(value) is not None else value
            else:
                unfilled_errors.append((path, f"{what}; admit it with allow_unfilled=[{re.escape(path)!r}]"))
            continue
        if not filled.all():
            unfilled_errors.append((path, f"partly filled: {describe_part(~filled, 'left at init')}"))
            continue
        found = regions(_tensor_of(probe.starts, var.ids), np.diff(probe.starts))
        if found is None:
            unfilled_errors.append((path, "filled from several torch tensors, not in slabs along one axis"))
            continue
        for region in found:
            problem = _region(probe, path, var, region, targets, offsets, read)
            if problem:
                unfilled_errors.append((path + region.index, problem))
        var.ids = var.scale = var.offset = None  # explained: free them
    unread: dict[int, list[str]] = {}  # tensor -> the slabs of it no variable reads, admitted by allow_dropped=
    for tensor, ts in targets.items():
        split = [probe.slab_sizes.get((tensor, p + index)) for p, index, _, _ in ts]
        size = int(probe.starts[tensor + 1] - probe.starts[tensor])
        if any(split) and (not all(split) or sum(n or 0 for n in split) != size):
            key = probe.probed[tensor]
            read_part = sum(n or 0 for n in split)
            left = None
            if all(split):
                read_slabs = [probe.slabs[(tensor, p + index)] for p, index, _, _ in ts]
                left = unread_slabs(read_slabs, probe.shapes[key])
            # a slab is admitted by a pattern written for it: one that takes key[slab] and not the key (".*" is no
            # word on which part of a tensor a loader may leave unread)
            for_slabs = [p for p in allow_dropped if not re.fullmatch(p, key)]
            if left and all(_admitted(key + slab, for_slabs) for slab in left):
                unread[tensor] = left
                dropped[key] = ", ".join(left)
                continue
            admit = (
                ""
                if not left
                else "; admit the unread part with allow_dropped=["
                + ", ".join(repr(re.escape(key + s)) for s in left)
                + "]"
            )
            mismatched.append(
                (
                    key,
                    f"the loader reads {read_part} of its {size} elements, in slabs: the tensor is only partly "
                    f"read{admit}",
                )
            )
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
    rules, comments = [], {}
    for i, key in enumerate(probe.probed):
        if read[i] or probe.starts[i] == probe.starts[i + 1]:  # read, or no elements to read
            continue
        dropped[key] = "all"
        if key in probe.trainable and not _admitted(key, allow_dropped):
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
        slabs = [probe.slabs.get((i, name)) for name in names]
        affine = ts[0][3]
        layouts_of = [None if t[2] == "identity" else t[2] for t in ts]
        template: Any = names[0] if len(ts) == 1 else tuple(names)
        if any(slabs):  # a split: each variable a slab of the tensor (a slab no variable reads: None)
            template = {**dict.fromkeys(unread.get(i, [])), **dict(zip(slabs, names))}
        elif len(ts) > 1:
            ties[key] = names
        one_layout = len(ts) == 1 or (isinstance(template, dict) and len(set(layouts_of)) == 1)  # written once
        rule: tuple = (re.escape(key), template, layouts_of[0] if one_layout else tuple(layouts_of))
        rounds = next((variables[p].rounds for p, _, _, _ in ts if variables[p].rounds is not None), None)
        if affine != (1.0, 0.0) or rounds is not None:
            spelled: dict[str, Any] = {"scale": affine[0], "offset": affine[1]} if affine != (1.0, 0.0) else {}
            rule += ({**spelled, "round": rounds} if rounds is not None else spelled,)
        rules.append(rule)
    every_key = list(probe.originals)
    rules = fold_families(rules, every_key)
    for why, drops in (
        ("dropped by the loader", [k for k in probe.keys if dropped.get(k) == "all"]),
        ("not a number: not probed", [k for k in probe.keys if k not in dropped and k not in probe.probed]),
    ):
        for rule in fold_families([(re.escape(k), None, None) for k in drops], every_key):  # one per family
            comments[len(rules)] = why
            rules.append(rule)
    for alias, name in probe.aliases.items():
        comments[len(rules)] = f"one tensor with {name!r}"
        rules.append((re.escape(alias), None, None))
    for i, rule in enumerate(rules):
        if rule[1] is not None and any(k in ties for k in probe.probed if re.fullmatch(rule[0], k)):
            comments[i] = "a tie: one torch tensor copied into " + ", ".join(
                rule[1] if isinstance(rule[1], tuple) else (rule[1],)
            )
    rounded = {p: v.rounds for p, v in variables.items() if v.rounds is not None}
    discovery = Discovery(dropped, unfilled, offsets, ties, probe.loads, comments, rounded)
    return Measured(rules, constants, discovery)


def _region(probe: _Probe, path: str, var: _Var, region: Region, targets, offsets, read) -> str | None:
    """Explain one slab: its tensor, layout and affine, recorded in ``targets`` / ``offsets`` / ``read``; or why not."""
    assert var.ids is not None and var.scale is not None and var.offset is not None
    tensor = region.tensor
    key = probe.probed[tensor]
    read[tensor] = True  # the loader reads it, whether or not what it does is explained
    ids = var.ids[region.selector]  # a view (basic indexing): made relative to the tensor in place, no copy
    ids -= ids.dtype.type(probe.starts[tensor])
    size = int(probe.starts[tensor + 1] - probe.starts[tensor])
    seen = np.zeros(size, bool)  # a mark per element of the tensor, not a count: duplicates show as fewer marks
    seen[ids] = True
    if np.count_nonzero(seen) < ids.size:
        return f"repeats elements of {key!r} (a broadcast or non-strided gather), not a permutation of it"
    del seen
    torch_shape = probe.shapes[key]
    if ids.size != size:  # a slab of the tensor (a split: q of a fused in_proj_weight), or truly a part
        found = slab_of(ids, torch_shape)
        if found is None:
            return (
                f"holds {ids.size} of the {size} elements of {key!r}, not a slab of it: the tensor is only partly read"
            )
        slab, ids, torch_shape = found
        probe.slabs[(tensor, path + region.index)] = slab
        probe.slab_sizes[(tensor, path + region.index)] = ids.size
    scale, offset = (
        uniform_value(np.asarray(var.scale[region.selector])),
        uniform_value(np.asarray(var.offset[region.selector])),
    )
    if scale is None or offset is None:
        return f"scale and offset vary within what {key!r} fills: not one affine per tensor"
    layout = layout_of(ids, torch_shape)
    if layout is None:
        return (
            f"holds the elements of {key!r} (shape {torch_shape}) in an order no einops rearrange of it "
            "gives (a flip, a roll, a gather)"
        )
    affine = (scale, offset)
    if affine != (1.0, 0.0):
        offsets[path + region.index] = affine
    for other in targets.get(tensor, []):
        if other[3] != affine:
            return f"{key!r} fills it with scale/offset {affine} but {other[0]}{other[1]} with {other[3]}"
    targets.setdefault(tensor, []).append((path, region.index, layout, affine))
    return None
