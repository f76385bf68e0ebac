"""Evidence for a pair's activation layout: which axis permutation takes a flax activation onto torch's, decided by
structure and never by the values under test. Imports no torch.

The rule, the same in ``docs/parity.md`` and ``docs/ports.md``: a layout comes from the side kinds' own conventions
(a convolution's channels-last or channels-first dimension numbers), from torch's recorded view/permute/transpose,
from the key map, from provenance (both sides' arrays are rearrangements of an earlier pair's outputs, or of the
model's inputs, whose layout is known: :func:`flow_permutation`), or from the pair's *inputs* agreeing under exactly
one layout (their values come from upstream, not from the module under test: :func:`agreeing_permutation`). A
module's own output agreeing is never evidence. Where these leave several layouts that fit the shapes, the pair is not
compared and says why, so it can be neither the first divergence nor a culprit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from flax_ln.parity.core.policy import Tolerance, compare_tensors

UNDECIDED = (
    "shapes {source} and {target} are {count} axis permutations apart and no structural fact decides which one "
    "(the module types, torch's own view/permute, the key map, an earlier pair's layout, the pair's inputs agreeing "
    "under exactly one), so the pair is not compared; give its layout in "
    "modules={{torch_path: (flax_path, 'einops pattern')}}"
)


def axis_permutations(source: Sequence[int], target: Sequence[int]) -> list[tuple[int, ...]]:
    """Every ``p`` with ``source[p] == target`` (an array of shape ``source`` transposed by ``p`` has ``target``'s)."""
    source, target = tuple(source), tuple(target)
    if len(source) != len(target):
        return []
    return [p for p in itertools.permutations(range(len(source))) if tuple(source[i] for i in p) == target]


def positions(source, target) -> np.ndarray | None:
    """For each element of ``target``, the flat position in ``source`` of the value it holds, where ``target``
    holds exactly ``source``'s values, each once, and ``source``'s values are all distinct (else the places are not
    known: ``None``). Both arrays are one side's own run, so no value under comparison decides anything."""
    flat, wanted = np.asarray(source).ravel(), np.asarray(target).ravel()
    if flat.size != wanted.size or flat.size == 0:
        return None
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    if flat.size > 1 and bool(np.any(ordered[1:] == ordered[:-1])):
        return None  # repeated values: which is where is not known
    at = np.clip(np.searchsorted(ordered, wanted), 0, flat.size - 1)
    if not np.array_equal(ordered[at], wanted):
        return None
    return order[at].reshape(np.shape(target))


def places(permutation: Sequence[int], flax_shape: Sequence[int], torch_shape: Sequence[int]) -> np.ndarray:
    """A flax-shaped array holding, at each place, the flat position in torch's array of the element it stands for,
    where ``flax.transpose(permutation)`` is torch's layout."""
    torch_places = np.arange(int(np.prod(torch_shape))).reshape(tuple(torch_shape))
    moved = torch_places.transpose(np.argsort(permutation))
    assert moved.shape == tuple(flax_shape), (moved.shape, flax_shape)
    return moved


def flow_permutation(source_flax, source_torch, source_places: np.ndarray, flax, torch) -> tuple[int, ...] | None:
    """The one flax -> torch axis permutation of ``flax`` onto ``torch`` that provenance gives: ``flax`` holds the
    values of ``source_flax`` rearranged by the port's code (any reshape and transpose), ``torch`` those of
    ``source_torch`` rearranged by torch's code, and ``source_places`` (:func:`places`) says which torch element each
    element of ``source_flax`` stands for. ``None`` where the values do not say where each element came from, or
    where several permutations (or none) fit."""
    from_flax, from_torch = positions(source_flax, flax), positions(source_torch, torch)
    if from_flax is None or from_torch is None or np.size(source_places) != np.size(source_flax):
        return None
    stands_for = np.asarray(source_places).ravel()[from_flax]  # flax-shaped: the torch source place of each element
    fits = axis_permutations(np.shape(flax), np.shape(torch))
    found = [p for p in fits if np.array_equal(stands_for.transpose(p), from_torch)]
    return found[0] if len(found) == 1 else None


def agreeing_permutation(flax, torch, agree: Callable[[np.ndarray, np.ndarray], bool]) -> tuple[int, ...] | None:
    """The one flax -> torch axis permutation under which a pair's *input* ``flax`` agrees with torch's (``agree``:
    within the comparison's tolerance); ``None`` where none or several do. Never used on a module's own output."""
    found = [p for p in axis_permutations(np.shape(flax), np.shape(torch)) if agree(np.transpose(flax, p), torch)]
    return found[0] if len(found) == 1 else None


def inputs_agree(flax_input, torch_input, tolerance: Tolerance) -> bool:
    """Whether a pair's input (put into torch's layout) agrees with torch's within ``tolerance``: the test
    :func:`agreeing_permutation` asks of each layout that fits."""
    return compare_tensors("input", "module input", flax_input, torch_input, tolerance).passed
