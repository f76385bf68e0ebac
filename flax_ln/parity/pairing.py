"""Torch submodules paired with flax submodules (:class:`Pairs`), whatever the kind of flax side, and activations
moved between the two layouts of a pair. Imports no torch.

How pairs are found from a flax side's module tree is :func:`flax_ln.parity.localize.pair_modules`; the pieces
here know nothing of NNX or Linen: a flax module is a dotted path and an opaque handle.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flax_ln.convert import KeyPlan, rules
from flax_ln.convert.layouts import ArrayLayout, parse_layout
from flax_ln.parity.capture import WHOLE_MODEL

NO_HOLDER = "no flax module holds its parameters"  # why a torch module has no pair, when pairs go by parameters

ParameterGroups = dict[frozenset, list[tuple[str, ...]]]  # the filled variables a module holds -> its module paths


@dataclasses.dataclass
class Pairs:
    """Torch submodules paired with flax submodules, for localisation and isolated mode.

    ``modules``: torch path -> the flax module's handle (what the flax side's
    :meth:`~flax_ln.parity.flax_side.FlaxSide.module_paths` gives: an NNX module, a Linen scope path);
    ``flax_paths``: torch path -> dotted flax path (the root is :data:`WHOLE_MODEL` on both sides); ``layouts``:
    torch path -> the pair's own activation layout (torch -> flax), from ``modules=``; ``skipped``: torch path ->
    why a pair's activations could not be compared; ``by_parameters``: the pairs were found by the parameters
    each module holds (through a key map's plan), not by mirrored paths, so a pair's flax path may differ from its
    torch path.
    """

    modules: dict[str, Any]
    flax_paths: dict[str, str]
    layouts: dict[str, ArrayLayout] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    by_parameters: bool = False
    orders: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # the inputs' torch -> flax axis orders

    def to_torch(self, path: str, array, torch_shape) -> np.ndarray | str:
        """A flax activation of the pair at ``path`` in torch's layout, or why it cannot be put there."""
        module, layout = self.modules[path], self.layouts.get(path)
        try:
            if layout is not None:
                return np.asarray(layout.to_torch(np.asarray(array), tuple(torch_shape)))
        except ValueError as err:
            return str(err)
        if not self.by_parameters or rules.activation_layout(module) is not None:
            return np.asarray(rules.torch_activation(module, array))
        inverse = [tuple(int(i) for i in np.argsort(o)) for o in self.orders]  # flax -> torch
        perm = _permutation(np.shape(array), torch_shape, inverse)
        return perm if isinstance(perm, str) else np.transpose(np.asarray(array), perm)

    def to_flax(self, path: str, array: np.ndarray, flax_shape) -> np.ndarray | str:
        """A torch activation of the pair at ``path`` in the flax module's layout, or why it cannot be put there."""
        module, layout = self.modules[path], self.layouts.get(path)
        try:
            if layout is not None:
                return np.asarray(layout.to_flax(array, tuple(flax_shape)))
        except ValueError as err:
            return str(err)
        if flax_shape is None or rules.activation_layout(module) is not None:
            return np.asarray(rules.flax_activation(module, array))
        perm = _permutation(array.shape, flax_shape, self.orders)
        return perm if isinstance(perm, str) else np.transpose(array, perm)


def filled_variables(plan: KeyPlan) -> set[str]:
    """The flax variables (canonical paths) that ``plan`` fills."""
    return {t.path for ts in plan.targets.values() for t in ts}


def _stack_sizes(plan: KeyPlan) -> dict[str, int]:
    """The number of slices of each stacked variable ``plan`` fills."""
    sizes: dict[str, int] = {}
    for targets in plan.targets.values():
        for target in targets:
            if target.index is not None:
                sizes[target.path] = max(sizes.get(target.path, 0), target.index + 1)
    return sizes


def _whole(names: frozenset, sizes: Mapping[str, int]) -> frozenset:
    """Flax variable names with every slice ``path[i]`` of a stacked variable collapsed into ``path`` when all
    its slices are there (a fused kernel filled from several torch keys); a part of a stack stays sliced."""
    slices: dict[str, set[str]] = {}
    for name in names:
        if name.endswith("]") and "[" in name:
            base, index = name[:-1].rsplit("[", 1)
            slices.setdefault(base, set()).add(index)
    out = set(names)
    for base, indices in slices.items():
        if len(indices) == sizes.get(base, -1):
            out -= {f"{base}[{i}]" for i in indices}
            out.add(base)
    return frozenset(out)


def pairs_by_parameters(
    flax_groups: ParameterGroups, plan: KeyPlan, torch_keys: Sequence[str], modules: Mapping[str, Any] | None
) -> dict[str, str]:
    """torch path -> flax path of the submodules whose parameters map exactly onto each other's (see
    :func:`~flax_ln.parity.localize.pair_modules`); ``flax_groups``: each flax module's filled variables ->
    the modules' paths; a torch module that ``modules=`` removes (``None``) takes no part."""
    removed = {t for t, given in (modules or {}).items() if given is None}
    sizes = _stack_sizes(plan)
    prefixes = {".".join(key.split(".")[:i]) for key in torch_keys for i in range(1, key.count(".") + 1)}
    torch_groups: dict[frozenset, list[str]] = {}
    for prefix in sorted(prefixes - removed):
        names = _whole(plan.flax_names(k for k in torch_keys if k.startswith(prefix + ".")), sizes)
        if names:
            torch_groups.setdefault(names, []).append(prefix)
    found: dict[str, str] = {}
    for names, torch_paths in torch_groups.items():
        flax_paths = sorted(flax_groups.get(names, []), key=len, reverse=True)  # innermost first
        for t, f in zip(sorted(torch_paths, key=lambda p: p.count("."), reverse=True), flax_paths):
            found[t] = ".".join(f) if f else WHOLE_MODEL
    return found


def complete_pairs(
    flax_paths: dict[str, str],
    by_flax_path: Mapping[str, Any],
    modules: Mapping[str, Any] | None,
    orders: Sequence[tuple[int, ...]],
    by_parameters: bool,
    named: str,
) -> Pairs:
    """The automatic pairs ``flax_paths`` (torch path -> flax path), the roots and ``modules=`` added;
    ``by_flax_path`` holds the flax modules' handles, ``named`` says how their paths are named (for errors)."""
    flax_paths[WHOLE_MODEL] = WHOLE_MODEL
    layouts: dict[str, ArrayLayout] = {}
    for torch_path, given in (modules or {}).items():
        if given is None:
            flax_paths.pop(torch_path, None)
            continue
        path, layout = given if isinstance(given, tuple) else (given, None)
        if path not in by_flax_path:
            raise ValueError(
                f"modules={{{torch_path!r}: {path!r}}}: the flax model has no module at {path!r}; its modules: "
                f"{sorted(p for p in by_flax_path if p != WHOLE_MODEL)[:12]} ... (dotted paths, {named})"
            )
        flax_paths[torch_path] = path
        if layout is not None:
            layouts[torch_path] = parse_layout(layout)
    paired = {t: by_flax_path[f] for t, f in flax_paths.items() if f in by_flax_path}
    hints = [tuple(o) for o in orders if tuple(o) != tuple(range(len(o)))]
    return Pairs(paired, flax_paths, layouts, {}, by_parameters, hints)


def _permutation(source: tuple, target: tuple, hints: Sequence[tuple[int, ...]] = ()) -> tuple[int, ...] | str:
    """The unique ``p`` with ``source[p] == target``, else the reason there is none.

    Among several (repeated sizes), the one of ``hints`` (the inputs' own axis orders) if exactly one
    is there, else the identity if the shapes are equal and no hint has this many axes.
    """
    source, target = tuple(source), tuple(target)
    found = {p for p in itertools.permutations(range(len(source))) if tuple(source[i] for i in p) == target}
    hinted = found & set(hints)
    if len(found) == 1 or len(hinted) == 1:
        return (found if len(found) == 1 else hinted).pop()
    if source == target and not any(len(h) == len(source) for h in hints):
        return tuple(range(len(source)))
    if not found:
        return f"shapes {source} and {target} are not one axis permutation apart"
    return (
        f"shapes {source} and {target} are {len(found)} axis permutations apart (ambiguous); "
        "give the pair's layout in modules={torch_path: (flax_path, 'einops pattern')}"
    )
