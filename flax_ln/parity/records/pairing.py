"""Torch submodules paired with flax submodules (:class:`Pairs`), whatever the kind of flax side, and activations
moved between the two layouts of a pair. Imports no torch.

How pairs are found from a flax side's module tree is :func:`flax_ln.parity.localize.pair.pair_modules`; the pieces
here know nothing of NNX or Linen: a flax module is a dotted path and an opaque handle.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from einops.parsing import ParsedExpression

from flax_ln.convert import KeyPlan
from flax_ln.convert.layouts import ArrayLayout, Permute, parse_layout
from flax_ln.parity.core.policy import Tolerance
from flax_ln.parity.records.capture import WHOLE_MODEL
from flax_ln.parity.records.layouts import (
    UNDECIDED,
    agreeing_permutation,
    axis_permutations,
    flow_permutation,
    inputs_agree,
    places,
)

NO_HOLDER = "no flax module holds its parameters"  # why a torch module has no pair, when pairs go by parameters
NO_PARAMETERS = (  # why a torch module without parameters (ReLU, a pool) has no pair, when pairs go by parameters
    "it holds no parameters, and pairs are found by the parameters each module holds: pair it with "
    "modules={torch path: flax path}"
)
NO_OUTPUT = "no flax module's output is its output"  # the start of the reason when a pair's values do not flow on


class PairingArgumentError(ValueError):
    """A ``modules=`` entry that names no flax module: the caller's mistake, raised (never caught by localisation)."""


ParameterGroups = dict[frozenset, list[tuple[str, ...]]]  # the filled variables a module holds -> its module paths


@dataclasses.dataclass
class Pairs:
    """Torch submodules paired with flax submodules, for localisation and isolated mode.

    ``modules``: torch path -> the flax module's handle (what the flax side's
    :meth:`~flax_ln.parity.sides.flax.FlaxSide.module_paths` gives: an NNX module, a Linen scope path);
    ``flax_paths``: torch path -> dotted flax path (the root is :data:`WHOLE_MODEL` on both sides); ``layouts``:
    torch path -> the pair's own activation layout (torch -> flax), from ``modules=``; ``skipped``: torch path ->
    why a pair's activations could not be compared; ``by_parameters``: the pairs were found by the parameters
    each module holds (through a key map's plan), not by mirrored paths, so a pair's flax path may differ from its
    torch path; ``unpaired``: torch path -> why a module that holds parameters has no flax twin; ``holders``: the
    torch paths whose modules hold state-dict keys (:meth:`why_unpaired` tells the others apart).

    How a flax activation is put into torch's layout, first rule that applies (structure only: no value decides a
    layout): the pair's own layout (``modules=``); for an output of another shape than torch's, the layout torch's
    own code puts it in downstream (``code_layouts``, from its op trace: ``q_proj(x).view(B, T, n, h)`` makes the
    output's ``n*h`` flax's ``n, h``; it wins over the key map, which may be the bug); the one the key map's einops
    layout of the pair's projection weight says (``derived``: ``"(n h) d -> d n h"``); the flax module type's
    (``type_layouts``: channels-last convolutions); for mirrored pairs, none; else the axis permutation from one
    shape to the other: the only one, or, where several fit (square images, per-head norms), the one evidence gives
    (``decided`` for inputs, ``decided_outputs`` for outputs, see :meth:`decide` and
    :mod:`~flax_ln.parity.records.layouts`), else the model inputs' own axis order where exactly one fits; never
    the identity only because the shapes are equal. Where nothing decides, the pair is skipped with that said
    (``skipped``), so it is neither compared nor blamed.
    """

    modules: dict[str, Any]
    flax_paths: dict[str, str]
    layouts: dict[str, ArrayLayout] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    by_parameters: bool = False
    orders: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # the inputs' torch -> flax axis orders
    type_layouts: dict[str, Permute] = dataclasses.field(default_factory=dict)
    derived: dict[str, dict[str, ArrayLayout]] = dataclasses.field(default_factory=dict)  # "input"/"output"
    decided: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # inputs, flax -> torch, by flow
    unpaired: dict[str, str] = dataclasses.field(default_factory=dict)
    decided_outputs: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # outputs, by flow
    code_layouts: dict[str, list[np.ndarray]] = dataclasses.field(default_factory=dict)  # torch's own code's
    fed_by: dict[str, str] = dataclasses.field(default_factory=dict)  # torch path -> the pair its input came from
    constants: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # flax call -> arguments not activations
    holders: frozenset[str] | None = None  # the torch paths holding some state-dict key (None: not known)
    integers: dict[str, list[tuple[Any, np.ndarray]]] = dataclasses.field(default_factory=dict)  # (flax's, torch's)
    input_orders: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # every model input's, as given

    def why_unpaired(self, torch_path: str) -> str:
        """Why ``torch_path`` has no flax twin: its reason in ``unpaired``, else, when pairs go by parameters,
        :data:`NO_PARAMETERS` for a module that holds none and :data:`NO_HOLDER` for one that does."""
        if torch_path in self.unpaired:
            return self.unpaired[torch_path]
        if not self.by_parameters:
            return "no flax twin at this path"
        return NO_PARAMETERS if self.holders is not None and torch_path not in self.holders else NO_HOLDER

    def assign(self, torch_path: str, flax_path: str, handle: Any, type_layout: Permute | None) -> None:
        """Pair ``torch_path`` with the flax module ``handle`` at ``flax_path`` instead (a layout decided for the
        previous pair is forgotten)."""
        self.modules[torch_path], self.flax_paths[torch_path] = handle, flax_path
        self.decided.pop(torch_path, None)
        self.decided_outputs.pop(torch_path, None)
        self.type_layouts.pop(torch_path, None)
        if type_layout is not None:
            self.type_layouts[torch_path] = type_layout

    def unpair(self, torch_path: str, reason: str) -> None:
        """Take ``torch_path`` out of the pairs, ``reason`` kept in ``unpaired``."""
        for table in (
            self.modules,
            self.flax_paths,
            self.type_layouts,
            self.decided,
            self.derived,
            self.decided_outputs,
        ):
            table.pop(torch_path, None)
        self.unpaired[torch_path] = reason

    def _layout(self, path: str, which: str) -> ArrayLayout | None:
        return self.layouts.get(path) or self.derived.get(path, {}).get(which)

    def _decided(self, path: str, which: str) -> tuple[int, ...] | None:
        if which == "output" and path in self.decided_outputs:
            return self.decided_outputs[path]
        return self.decided.get(path)

    def code_layout(self, path: str, flax_shape, torch_shape) -> np.ndarray | str | None:
        """The index map (flax's shape, into torch's flattened output) of the one layout torch's own code puts the
        pair's output in downstream with flax's shape, when flax's shape is not torch's; the reason when there are
        several; ``None`` when torch's code says nothing about it (or the pair's layout is given)."""
        flax_shape, torch_shape = tuple(flax_shape), tuple(torch_shape)
        if path in self.layouts or not self.by_parameters or flax_shape == torch_shape:
            return None
        found: list[np.ndarray] = []
        for index in self.code_layouts.get(path, ()):
            if index.shape == flax_shape and not any(np.array_equal(index, f) for f in found):
                found.append(index)
        if len(found) > 1:
            return (
                f"torch's own code puts its output {torch_shape} in {len(found)} different layouts of flax's "
                f"{flax_shape}, and structure does not decide which flax's is; give the pair's layout in "
                "modules={torch_path: (flax_path, 'einops pattern')}"
            )
        return found[0] if found else None

    def to_torch(self, path: str, array, torch_shape, which: str = "output") -> np.ndarray | str:
        """A flax activation (an ``"input"`` or ``"output"``) of the pair at ``path`` in torch's layout, or why it
        cannot be put there."""
        array, layout = np.asarray(array), self._layout(path, which)
        code = self.code_layout(path, array.shape, torch_shape) if which == "output" else None
        if isinstance(code, str):
            return code
        if code is not None:
            out = np.empty(int(np.prod(torch_shape)), array.dtype)
            out[code.ravel()] = array.ravel()
            return out.reshape(tuple(torch_shape))
        try:
            if layout is not None:
                return np.asarray(layout.to_torch(array, tuple(torch_shape)))
        except ValueError as err:
            return str(err)
        if path in self.type_layouts:
            return array.transpose(self.type_layouts[path].to_torch(array.ndim))
        if not self.by_parameters:
            return array
        inverse = [tuple(int(i) for i in np.argsort(o)) for o in self.orders]  # flax -> torch
        perm = _permutation(array.shape, torch_shape, self._decided(path, which), inverse)
        if isinstance(perm, str) and regrouped(array.shape, torch_shape):
            return array.reshape(tuple(torch_shape))  # the batch axes merged, split, added or dropped
        return perm if isinstance(perm, str) else np.transpose(array, perm)

    def to_flax(self, path: str, array: np.ndarray, flax_shape, which: str = "input") -> np.ndarray | str:
        """A torch activation of the pair at ``path`` in the flax module's layout, or why it cannot be put there."""
        layout = self._layout(path, which)
        if which == "output" and flax_shape is not None:
            code = self.code_layout(path, flax_shape, np.shape(array))
            if isinstance(code, str):
                return code
            if code is not None:
                return np.asarray(array).ravel()[code]
        try:
            if layout is not None:
                return np.asarray(layout.to_flax(array, tuple(flax_shape)))
        except ValueError as err:
            return str(err)
        if path in self.type_layouts:
            return array.transpose(self.type_layouts[path].to_flax(array.ndim))
        if flax_shape is None or not self.by_parameters:
            return array
        decided = self._decided(path, which)
        inverse = None if decided is None else tuple(int(i) for i in np.argsort(decided))
        perm = _permutation(array.shape, flax_shape, inverse, self.orders)
        if isinstance(perm, str) and regrouped(array.shape, flax_shape):
            return array.reshape(tuple(flax_shape))  # the batch axes merged, split, added or dropped
        return perm if isinstance(perm, str) else np.transpose(array, perm)

    def known_permutation(self, path: str, flax_output, torch_shape) -> tuple[int, ...] | None:
        """The flax -> torch axis permutation of the pair's output where it is known without comparing values: torch's
        own code's (when it only moves axes), the module type's, none for mirrored pairs, the one decided by
        provenance, or the only one the shapes allow."""
        shape = tuple(np.shape(flax_output))
        code = self.code_layout(path, shape, torch_shape)
        if isinstance(code, str):
            return None
        if code is not None:
            index = np.arange(code.size).reshape(tuple(torch_shape))
            fits = axis_permutations(tuple(torch_shape), shape)
            moves = [q for q in fits if np.array_equal(index.transpose(q), code)]
            return tuple(int(i) for i in np.argsort(moves[0])) if moves else None
        if self._layout(path, "output") is not None:
            return None
        ndim = len(shape)
        if path in self.type_layouts:
            return tuple(int(i) for i in self.type_layouts[path].to_torch(ndim))
        if not self.by_parameters:
            return tuple(range(ndim))
        found = axis_permutations(shape, tuple(torch_shape))
        decided = self._decided(path, "output")
        if decided in found:
            return decided
        return found[0] if len(found) == 1 else None

    def output_places(self, path: str, flax_output, torch_shape) -> np.ndarray | None:
        """Where the pair's flax output stands in torch's, when its layout is known from structure: a flax-shaped
        array of the torch output's flat positions (:func:`~flax_ln.parity.records.layouts.places`); ``None``
        where the layout is not known."""
        shape, torch_shape = tuple(np.shape(flax_output)), tuple(torch_shape)
        code = self.code_layout(path, shape, torch_shape)
        if isinstance(code, str):
            return None
        if code is not None:
            return code
        layout = self._layout(path, "output")
        if layout is not None:
            try:
                iota = np.arange(int(np.prod(torch_shape))).reshape(torch_shape)
                found = np.asarray(layout.to_flax(iota, shape))
            except ValueError:
                return None
            return found if found.shape == shape else None
        perm = self.known_permutation(path, flax_output, torch_shape)
        if perm is None or len(perm) != len(torch_shape) or tuple(shape[i] for i in perm) != torch_shape:
            return None  # not known, or not an axis permutation (a mirrored pair's regrouped batch axes)
        return places(perm, shape, torch_shape)

    def input_sources(self, flax_record: Any, torch_record: Any) -> dict[bytes, tuple]:
        """The model's inputs (the whole model's records, ``None`` where not recorded) as sources of provenance for
        :meth:`decide`: each in the axis order the caller gave (``flax_inputs=``), else the same on both sides."""
        found: dict[bytes, tuple] = {}
        if flax_record is None or torch_record is None:
            return found
        for i, (f, t) in enumerate(zip(flax_record[0], torch_record[0])):
            f, t = np.asarray(f), np.asarray(t)
            order = self.input_orders[i] if i < len(self.input_orders) else ()
            order = order if len(order) == t.ndim else tuple(range(t.ndim))
            if tuple(np.shape(t)[k] for k in order) == f.shape:  # flax's input is torch's transposed by ``order``
                found[fingerprint(t)] = (f, t, places(tuple(int(k) for k in np.argsort(order)), f.shape, t.shape))
        return found

    def decide(
        self,
        path: str,
        flax_inputs: Sequence[np.ndarray],
        torch_inputs: Sequence[np.ndarray],
        sources: Mapping[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
        which: str = "input",
        fed: tuple[str, np.ndarray, np.ndarray] | None = None,
        tolerance: Tolerance | None = None,
    ) -> None:
        """Where several axis permutations take the pair's flax ``which`` (its inputs, or its outputs) onto torch's
        shape, keep the one evidence gives (:mod:`~flax_ln.parity.records.layouts`), first that applies:
        provenance, when torch's array holds the values of an earlier pair's torch output (or of a model input)
        and flax's those of that pair's flax output, each rearranged by its side's own code, and that pair's
        layout is known (``sources``: the torch array's :func:`fingerprint` -> the flax array, the torch array and
        :func:`~flax_ln.parity.records.layouts.places` of the flax one in the torch one); with ``fed`` (the path,
        flax output and torch output of the earlier pair whose output torch's code made this array from without
        moving an axis: torch's op trace), that pair's layout where both shapes are its output's; for inputs only,
        with ``tolerance``, the one permutation under which the inputs agree (their values come from upstream). A
        module's own output never decides; where nothing does, nothing is kept."""
        table = self.decided if which == "input" else self.decided_outputs
        if not self.by_parameters or self._layout(path, which) is not None or path in self.type_layouts:
            return
        for f, t in zip(flax_inputs, torch_inputs):
            found = axis_permutations(np.shape(f), np.shape(t))
            if len(found) == 1:  # the only layout the shapes allow: a square output of this pair follows it
                table.setdefault(path, found[0])
            if len(found) < 2:
                continue
            source = None if sources is None else sources.get(fingerprint(t))
            kept = None
            if source is not None:
                kept = flow_permutation(*source, f, t)
            if kept is None and fed is not None and np.shape(f) == np.shape(fed[1]) and np.shape(t) == np.shape(fed[2]):
                kept = self.known_permutation(fed[0], fed[1], np.shape(fed[2]))  # made without moving an axis
            if kept is None and tolerance is not None and which == "input":
                agree = functools.partial(inputs_agree, tolerance=tolerance)
                kept = agreeing_permutation(np.asarray(f), np.asarray(t), agree)
            if kept in found:
                table[path] = kept
            return


def fingerprint(array) -> bytes:
    """The same for two arrays holding the same values, bit for bit, in any layout (any axis order or reshape).

    A hash of the multiset of the values' bit patterns (:func:`_multiset_digest`: one pass, no sort). Localisation
    asks it of the same recorded arrays many times (pairing, the first divergence, isolation's provenance): a
    NumPy array's is kept while the array lives (records are not changed after they are taken)."""
    if not isinstance(array, np.ndarray):
        return _multiset_digest(np.asarray(array))
    key = id(array)
    held = _FINGERPRINTS.get(key)
    if held is not None and held[0]() is array:
        return held[1]
    digest = _multiset_digest(array)
    _FINGERPRINTS[key] = (weakref.ref(array, functools.partial(_forget_fingerprint, key)), digest)
    return digest


def _forget_fingerprint(key: int, _: weakref.ref) -> None:
    _FINGERPRINTS.pop(key, None)


def _multiset_digest(array: np.ndarray) -> bytes:
    """The dtype, the size and two sums of the values' bit patterns, each value through its own 32-bit mixing
    function first (:data:`_MIXES`; an 8-byte value's two words mixed together): equal for equal multisets whatever
    their order, and two different multisets agree with a chance of about 2**-64. No sort: a few passes of 32-bit
    integer arithmetic. A dtype whose items are not 1, 2, 4 or 8 bytes is sorted instead."""
    flat = np.ascontiguousarray(array).reshape(-1)
    itemsize = flat.dtype.itemsize
    if itemsize not in (1, 2, 4, 8) or flat.dtype.hasobject:
        return hashlib.blake2b(np.sort(flat).tobytes(), digest_size=16).digest()
    words = flat.view(np.uint32).reshape(-1, 2) if itemsize == 8 else flat.view(f"u{itemsize}")  # (n, 2) or (n,)
    sums = []
    for first, second in _MIXES:
        if itemsize == 8:
            mixed = _mix(words[:, 1].copy(), first, second)
            mixed ^= words[:, 0]
            mixed = _mix(mixed, second, first)
        else:
            mixed = _mix(words.astype(np.uint32), first, second)  # a copy, mixed in place
        sums.append(int(mixed.sum(dtype=np.uint64)))  # < 2**64 for fewer than 2**32 values: no wrap
    header = f"{flat.dtype.str}:{flat.size}:{sums[0]:x}:{sums[1]:x}".encode()
    return hashlib.blake2b(header, digest_size=16).digest()


_MIXES = ((0x9E3779B9, 0x85EBCA6B), (0x7FEB352D, 0x846CA68B))  # odd multipliers of two 32-bit mixing functions


def _mix(words: np.ndarray, first: int, second: int) -> np.ndarray:
    """``words`` (uint32, changed in place) through a bijective mix: multiply by an odd number, xor-shift, twice."""
    words *= np.uint32(first)
    words ^= words >> np.uint32(16)
    words *= np.uint32(second)
    words ^= words >> np.uint32(15)
    return words


_FINGERPRINTS: dict[int, tuple[weakref.ref, bytes]] = {}  # id of a live array -> (a reference to it, its fingerprint)


def exact_permutation(source: np.ndarray, target: np.ndarray) -> tuple[int, ...] | None:
    """The one ``p`` with ``source.transpose(p)`` equal to ``target`` element for element, else ``None``."""
    found = axis_permutations(np.shape(source), np.shape(target))
    exact = [p for p in found if np.array_equal(np.transpose(source, p), target)]
    return exact[0] if len(exact) == 1 else None


def regrouped(source: Sequence[int], target: Sequence[int]) -> bool:
    """Whether an array of shape ``source`` holds the values of one of shape ``target`` with its leading (batch) axes
    merged or split (``(b t) d`` and ``b t d``) or unit axes added or dropped (a single example against a batch of
    one): the shapes differ, and, unit axes aside, they end alike after leading parts of equal size."""
    if tuple(source) == tuple(target):
        return False
    s, t = [n for n in source if n != 1], [n for n in target if n != 1]
    if s == t:
        return True
    common = 0
    while common < min(len(s), len(t)) and s[len(s) - 1 - common] == t[len(t) - 1 - common]:
        common += 1
    lead_s, lead_t = s[: len(s) - common], t[: len(t) - common]
    return common > 0 and bool(lead_s) and bool(lead_t) and math.prod(lead_s) == math.prod(lead_t)


def projection_layouts(plan: KeyPlan, torch_path: str) -> dict[str, ArrayLayout]:
    """The activation layouts (``"input"``, ``"output"``: torch -> flax) that the key map's einops layout of the
    torch module's 2-D ``weight`` implies: with ``"(n h) d -> d n h"``, torch's output ``(..., n*h)`` is flax's
    ``(..., n, h)``; only where axes are split or merged (a plain transpose keeps activations as they are)."""
    found: dict[str, ArrayLayout] = {}
    for target in plan.targets.get(f"{torch_path}.weight", ()):
        pattern = target.layout.pattern
        if pattern is None or len(target.torch_shape) != 2:
            continue
        lhs, rhs = (ParsedExpression(side) for side in pattern.split("->"))
        if len(lhs.composition) != 2 or lhs.has_ellipsis or rhs.has_ellipsis:
            continue
        for which, group in (("output", lhs.composition[0]), ("input", lhs.composition[1])):
            flax_groups = [g for g in rhs.composition if set(g) <= set(group)]
            if flax_groups == [group] or len(group) == len(flax_groups) == 1:
                continue
            torch_axes = " ".join(group) if len(group) == 1 else f"({' '.join(group)})"
            flax_axes = " ".join(g[0] if len(g) == 1 else f"({' '.join(g)})" for g in flax_groups)
            found[which] = ArrayLayout(pattern=f"... {torch_axes} -> ... {flax_axes}")
        break
    return found


def layer_of(name: str) -> tuple[str, list[int]]:
    """A recorded module name without its layer indices (``layers[3].attn`` -> ``layers.attn``: the module of the
    scanned stack that holds every layer's arrays), and the indices (``[3]``)."""
    return re.sub(r"\[\d+\]", "", name), [int(k) for k in re.findall(r"\[(\d+)\]", name)]


class StackLayers:
    """Which layer of a scanned stack each call of a stacked module holds, in one recording: a module holding
    arrays stacked on a leading layer axis (``whole``) called on one slice of them (``parts``: a scan over layers,
    run as a Python loop under ``jax.disable_jit()``) holds the layer whose values its arrays equal; where values
    cannot tell (equal layers), the count of that module's layers seen so far. A call holding traced arrays (a
    ``vmap`` over the stack, a scan that is not unrolled) is no layer."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.scopes: list[tuple[str, str]] = []  # the layers under way: (the stack's path, the layer's name)

    def name(self, path: str, layer: Callable[[], int | None]) -> tuple[str, bool]:
        """The name of a call of the module at ``path``: inside a layer under way, the layer's name for the stack's
        (``layers[3].attn``); else ``path[k]`` where ``layer()`` finds it is layer ``k`` of a stack (then that
        layer is under way until :meth:`leave`; the second item says so), else ``path``."""
        for base, scoped in self.scopes:
            if path == base or path.startswith(base + "."):
                return scoped + path[len(base) :], False  # a layer's parts are sliced with it
        found = layer()
        if found is None:
            return path, False
        self.scopes.append((path, f"{path}[{found}]"))
        return self.scopes[-1][1], True

    def leave(self) -> None:
        """The end of the innermost layer under way."""
        self.scopes.pop()

    def layer(self, path: str, whole: Sequence[Any], parts: Sequence[Any]) -> int | None:
        """The layer of the stacked module at ``path`` that a call holding ``parts`` runs; ``None`` when ``parts``
        are not one slice of ``whole`` (a plain call, or a module that is no stack)."""
        depths = {np.shape(w)[0] if np.ndim(w) else -1 for w in whole}
        if not whole or len(whole) != len(parts) or len(depths) != 1 or -1 in depths:
            return None
        if any(np.shape(p) != np.shape(w)[1:] for p, w in zip(parts, whole)):
            return None
        try:
            values, stacked = [_readable(p) for p in parts], [_readable(w) for w in whole]
        except Exception:  # noqa: BLE001 - traced (a vmap over the stack, a scan not unrolled): no layer's values
            return None
        count = self.counts.get(path, 0)
        self.counts[path] = count + 1
        found = [k for k in range(depths.pop()) if all(np.array_equal(v, w[k]) for v, w in zip(values, stacked))]
        return found[0] if len(found) == 1 else count


def _readable(array: Any) -> np.ndarray:
    """``array``'s values as NumPy: a typed PRNG key's key data (raises for a tracer)."""
    dtype = getattr(array, "dtype", None)
    if dtype is not None and not isinstance(dtype, np.dtype) and "key" in str(dtype):
        return np.asarray(jax.random.key_data(array))
    return np.asarray(array)


def layer_groups(filled: set[str], recorded: Iterable[str]) -> ParameterGroups:
    """The parameter groups of the recorded layers of scanned stacks: ``layers[3].attn`` holds layer 3 of each
    ``filled`` variable under ``layers.attn`` (the key map's stacked rules name it ``layers.attn.kernel[3]``), so
    torch's ``layers.3.attn`` pairs with it. ``recorded``: the recorded module names; one index each."""
    groups: ParameterGroups = {}
    for name in recorded:
        base, layers = layer_of(name)
        if len(layers) != 1:
            continue
        own = frozenset(f"{n}[{layers[0]}]" for n in filled if "[" not in n and n.startswith(base + "."))
        if own:
            groups.setdefault(own, []).append((name,))
    return groups


def filled_variables(plan: KeyPlan) -> set[str]:
    """The flax variables (canonical paths) that ``plan`` fills."""
    return {t.path for ts in plan.targets.values() for t in ts}


def _region_names(plan: KeyPlan) -> dict[str, set[str]]:
    """The names (``path[i]``, ``path[:, 0:768]``) of the regions that fill each variable ``plan`` fills by parts."""
    names: dict[str, set[str]] = {}
    for targets in plan.targets.values():
        for target in targets:
            if target.name != target.path:
                names.setdefault(target.path, set()).add(target.name)
    return names


def _whole(names: frozenset, parts: Mapping[str, set[str]]) -> frozenset:
    """Flax variable names with the regions of a variable filled by parts (``path[i]`` of a stack, ``path[:, 0:768]``
    of a fused kernel) collapsed into ``path`` when all its parts are there (a fused kernel filled from several
    torch keys); a part of a variable stays named as the part."""
    out = set(names)
    for base, regions in parts.items():
        if regions <= out:
            out -= regions
            out.add(base)
    return frozenset(out)


def pairs_by_parameters(
    flax_groups: ParameterGroups, plan: KeyPlan, torch_keys: Sequence[str], modules: Mapping[str, Any] | None
) -> dict[str, list[str]]:
    """torch path -> the flax paths of the submodules whose parameters map exactly onto its own (see
    :func:`~flax_ln.parity.localize.pair.pair_modules`), the likeliest first: where several modules on a side hold the
    same parameters (a wrapper and its only child), the k-th innermost torch module lists the k-th innermost flax
    module first. ``flax_groups``: each flax module's filled variables -> the modules' paths; a torch module that
    ``modules=`` removes (``None``) takes no part."""
    removed = {t for t, given in (modules or {}).items() if given is None}
    parts = _region_names(plan)
    prefixes = {".".join(key.split(".")[:i]) for key in torch_keys for i in range(1, key.count(".") + 1)}
    torch_groups: dict[frozenset, list[str]] = {}
    for prefix in sorted(prefixes - removed):
        names = _whole(plan.flax_names(k for k in torch_keys if k.startswith(prefix + ".")), parts)
        if names:
            torch_groups.setdefault(names, []).append(prefix)
    found: dict[str, list[str]] = {}
    for names, torch_paths in torch_groups.items():
        flax_paths = [".".join(f) or WHOLE_MODEL for f in sorted(flax_groups.get(names, []), key=len, reverse=True)]
        for k, t in enumerate(sorted(torch_paths, key=lambda p: p.count("."), reverse=True)):
            if flax_paths:
                first = flax_paths[min(k, len(flax_paths) - 1)]
                found[t] = [first] + [f for f in flax_paths if f != first]
    return found


def complete_pairs(
    flax_paths: dict[str, str],
    by_flax_path: Mapping[str, Any],
    modules: Mapping[str, Any] | None,
    orders: Sequence[tuple[int, ...]],
    by_parameters: bool,
    named: str,
    type_layout: Callable[[Any], Permute | None],
) -> Pairs:
    """The automatic pairs ``flax_paths`` (torch path -> flax path), the roots and ``modules=`` added;
    ``by_flax_path`` holds the flax modules' handles, ``named`` says how their paths are named (for errors),
    ``type_layout`` gives a handle's activation layout by its module type (channels-last convolutions)."""
    flax_paths[WHOLE_MODEL] = WHOLE_MODEL
    layouts: dict[str, ArrayLayout] = {}
    for torch_path, given in (modules or {}).items():
        if given is None:
            flax_paths.pop(torch_path, None)
            continue
        path, layout = given if isinstance(given, tuple) else (given, None)
        if path not in by_flax_path:
            raise PairingArgumentError(
                f"modules={{{torch_path!r}: {path!r}}}: the flax model has no module at {path!r}; its modules: "
                f"{sorted(p for p in by_flax_path if p != WHOLE_MODEL)[:12]} ... (dotted paths, {named})"
            )
        flax_paths[torch_path] = path
        if layout is not None:
            layouts[torch_path] = parse_layout(layout)
    paired = {t: by_flax_path[f] for t, f in flax_paths.items() if f in by_flax_path}
    hints = [tuple(o) for o in orders if tuple(o) != tuple(range(len(o)))]
    pairs = Pairs(paired, flax_paths, layouts, {}, by_parameters, hints)
    pairs.input_orders = [tuple(o) for o in orders]
    for torch_path, handle in paired.items():
        if (layout := type_layout(handle)) is not None:
            pairs.type_layouts[torch_path] = layout
    return pairs


def _permutation(
    source: tuple, target: tuple, decided: tuple[int, ...] | None, hints: Sequence[tuple[int, ...]] = ()
) -> tuple[int, ...] | str:
    """The unique ``p`` with ``source[p] == target``, else the reason there is none.

    Among several (repeated sizes): the one ``decided`` by evidence (:mod:`~flax_ln.parity.records.layouts`), else
    the one of ``hints`` (the model inputs' own axis orders, as the caller gave them) if exactly one is there; never
    the identity only because the shapes are equal.
    """
    source, target = tuple(source), tuple(target)
    found = set(axis_permutations(source, target))
    if decided is not None and decided in found:
        return decided
    hinted = found & set(hints)
    if len(found) == 1 or len(hinted) == 1:
        return (found if len(found) == 1 else hinted).pop()
    if not found:
        return f"shapes {source} and {target} are not one axis permutation apart"
    return UNDECIDED.format(source=source, target=target, count=len(found))
