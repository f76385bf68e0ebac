"""Torch's submodules paired with the flax side's (:func:`pair_modules`), for any kind of flax side: by the
converter's renames or the key map's parameters, the recorded outputs choosing among modules that hold the same
parameters. Imports no torch."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from flax_ln.parity.core.policy import Tolerance
from flax_ln.parity.localize.activations import compare_activation, in_torch_layout
from flax_ln.parity.localize.inside import inside_module
from flax_ln.parity.records.capture import WHOLE_MODEL, Records
from flax_ln.parity.records.pairing import (
    NO_OUTPUT,
    Pairs,
    ParameterGroups,
    complete_pairs,
    filled_variables,
    fingerprint,
    pairs_by_parameters,
    projection_layouts,
)
from flax_ln.parity.records.torch_trace import TorchTrace
from flax_ln.parity.report.data import TensorResult
from flax_ln.parity.sides.flax import FlaxSide


def pair_modules(
    flax: FlaxSide,
    *,
    torch_keys: Sequence[str] = (),
    modules: Mapping[str, Any] | None = None,
    recorded: Records | None = None,
    torch_records: Records | None = None,
    tolerance: Tolerance | None = None,
    torch_trace: TorchTrace | None = None,
) -> Pairs:
    """Each flax submodule under the torch path of its twin (the roots under :data:`WHOLE_MODEL`).

    The one place where torch paths and flax paths are paired.

    Without a plan (``flax.plan``): a flax path is mapped through the converter's registered renames
    (:meth:`~flax_ln.parity.sides.flax.FlaxSide.mirrored_paths`), else kept as it is (the module trees
    mirror each other).

    With the plan of the port's key map and the torch state dict's ``torch_keys``: a torch submodule may pair
    with a flax submodule when the flax variables its keys fill are exactly the flax module's variables
    (:meth:`~flax_ln.parity.sides.flax.FlaxSide.parameter_groups`), at any depth. Where several modules hold the
    same parameters (a wrapper and its only child, an embedding inside a module that scales it), the recorded
    values decide (``torch_records``, ``recorded``, ``tolerance``; see :func:`_choose_by_outputs`): each torch
    module takes the candidate whose output is its own, and one that no candidate's output matches is unpaired
    (``pairs.unpaired``) rather than paired with a part of it. A failing pair whose output torch passes on as it
    is while flax passes on something else is unpaired too (:func:`_unpair_detours`). A pair's activation
    layouts come from the key map (:func:`~flax_ln.parity.records.pairing.projection_layouts`: fused heads) and the
    module's type (channels-last convolutions), see :class:`~flax_ln.parity.records.pairing.Pairs`.

    With torch's op trace (``torch_trace``, :class:`~flax_ln.parity.records.torch_trace.TorchTrace`): a pair means
    the same output, so a torch module that applies more after its parameterised operation (an activation inside a
    ``BatchNormAct2d``, a scale inside an embedding's forward) pairs only with a flax module that wraps another
    holding the same parameters (the flax code around it can do the same), never with the bare innermost one; with
    none such it is unpaired (:func:`_pairs_that_apply_as_much`). Torch's own code's layouts of each output
    (``torch_trace.layouts``) go to the pairs (``Pairs.code_layouts``).

    ``modules``: ``{torch_path: flax_path | (flax_path, layout) | None}`` adds a pair
    (a parameter-free module), gives a pair's activation layout (an einops pattern or a
    permutation triple, torch -> flax), or removes a pair (``None``; with a key map the torch
    module then takes no part in pairing, so that its wrapper pairs instead); a pair it gives is never
    re-chosen. ``flax.orders``: the axis order of each compared input from torch's to flax's
    (``flax_inputs=``). ``recorded``: the flax side's records (:meth:`~flax_ln.parity.sides.flax.FlaxSide.record`).
    """
    recorded = {} if recorded is None else recorded
    groups: ParameterGroups = {}
    candidates: dict[str, list[str]] = {}
    applying: dict[str, str] = {}  # torch modules that apply more than any flax holder of their parameters
    if flax.plan is None:
        flax_paths = flax.mirrored_paths()
    else:
        groups = flax.parameter_groups(filled_variables(flax.plan), recorded)
        candidates = pairs_by_parameters(groups, flax.plan, torch_keys, modules)
        methods = flax.method_calls()  # a tied head's attend is a candidate wherever its embedding is
        for found in candidates.values():
            found += [name for name, owner in methods.items() if owner in found and name not in found]
        applying = _pairs_that_apply_as_much(candidates, torch_trace, modules)
        flax_paths = {t: found[0] for t, found in candidates.items()}
    by_flax_path = flax.module_paths(groups, recorded)
    pairs = complete_pairs(
        flax_paths, by_flax_path, modules, flax.orders, flax.plan is not None, flax.paths_named, flax.type_layout
    )
    for torch_path, reason in applying.items():
        pairs.unpair(torch_path, reason)
    if torch_trace is not None:
        pairs.code_layouts, pairs.fed_by = dict(torch_trace.layouts), dict(torch_trace.fed_by)
    if flax.plan is not None:
        pairs.holders = frozenset(
            {WHOLE_MODEL, *(".".join(key.split(".")[:i]) for key in torch_keys for i in range(1, key.count(".") + 1))}
        )
        for torch_path in pairs.modules:
            if layouts := projection_layouts(flax.plan, torch_path):
                pairs.derived[torch_path] = layouts
    if torch_records is not None and tolerance is not None:
        given = set(modules or {})
        open_choices = {t: [f for f in found if f in by_flax_path] for t, found in candidates.items() if t not in given}
        _choose_by_outputs(pairs, open_choices, by_flax_path, flax, torch_records, recorded, tolerance)
        _unpair_detours(pairs, torch_records, recorded, tolerance, given)
    return pairs


def _pairs_that_apply_as_much(
    candidates: dict[str, list[str]], trace: TorchTrace | None, modules: Mapping[str, Any] | None
) -> dict[str, str]:
    """Drop, from the candidates of each torch module that applies operations after its parameterised one (torch's
    op trace), the innermost flax holders of its parameters (a bare module wrapped by another candidate); a torch
    module left with none is taken out of ``candidates`` and comes back with the reason. ``modules=`` pairs stay."""
    unpaired: dict[str, str] = {}
    if trace is None:
        return unpaired
    for torch_path, after in trace.after.items():
        found = candidates.get(torch_path)
        if not found or torch_path in (modules or {}) or torch_path == WHOLE_MODEL:
            continue
        wrappers = [f for f in found if any(inside_module(g, f) for g in found if g != f)]
        if wrappers:
            candidates[torch_path] = wrappers
            continue
        del candidates[torch_path]
        ops = ", ".join(dict.fromkeys(after))
        unpaired[torch_path] = (
            f"{NO_OUTPUT}: torch's module applies {ops} after its parameterised operation (its op trace), and the "
            f"flax module holding its parameters ({', '.join(found)}) wraps no other holding them"
        )
    return unpaired


def _choose_by_outputs(
    pairs: Pairs,
    choices: Mapping[str, list[str]],
    by_flax_path: Mapping[str, Any],
    flax: FlaxSide,
    torch_records: Records,
    recorded: Records,
    tolerance: Tolerance,
) -> None:
    """Among torch modules that hold the same parameters and the flax modules that do (``choices``: torch path ->
    candidate flax paths, likeliest first), pair each torch module with the candidate whose recorded output is
    its own: one within tolerance first (the likeliest among several), else the smallest error; one flax module
    per torch module. A torch module left without a candidate is unpaired."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for torch_path, found in choices.items():
        groups.setdefault(tuple(sorted(found)), []).append(torch_path)
    for flax_options, torch_paths in groups.items():
        if len(flax_options) < 2 and len(torch_paths) < 2:
            continue
        scored = []
        for t in torch_paths:
            for rank, f in enumerate(choices[t]):
                if t not in torch_records:
                    error = None
                elif f in recorded:
                    pairs.assign(t, f, by_flax_path[f], flax.type_layout(by_flax_path[f]))
                    error = _pair_output(pairs, t, recorded[f], torch_records[t], tolerance)
                else:
                    error = None
                passed = error is not None and error.passed
                excess = 0.0 if passed else math.inf if error is None else error.excess
                scored.append((not passed, excess, rank, t, f))
        taken: set[str] = set()
        for *_, t, f in sorted(scored, key=lambda s: s[:3]):
            if t in taken or f in {pairs.flax_paths.get(u) for u in taken}:
                continue
            pairs.assign(t, f, by_flax_path[f], flax.type_layout(by_flax_path[f]))
            taken.add(t)
        for t in set(torch_paths) - taken:
            others = ", ".join(f"{u} <-> {pairs.flax_paths[u]}" for u in sorted(taken))
            pairs.unpair(t, f"{NO_OUTPUT}: the flax modules holding its parameters pair with {others}")


def _unpair_detours(
    pairs: Pairs, torch_records: Records, recorded: Records, tolerance: Tolerance, given: set[str]
) -> None:
    """Unpair each failing pair whose output torch passes on as it is (the inputs of a later paired module hold
    exactly its values, in some layout) while the flax module's output is not what that module's flax twin is
    given: flax computes something in between that torch does inside the module, so the two outputs are not
    meant to be equal (an embedding scaled inside torch's module, outside flax's). Pairs from ``modules=`` stay."""
    order = [p for p in torch_records if p in pairs.modules and pairs.flax_paths[p] in recorded]
    torch_inputs: dict[bytes, int] = {}  # fingerprint of a paired module's torch input -> its first position
    for i, path in reversed(list(enumerate(order))):
        for x in torch_records[path][0]:
            torch_inputs[fingerprint(x)] = i
    for i, path in enumerate(order):
        if path == WHOLE_MODEL or path in given:
            continue
        result = _pair_output(pairs, path, recorded[pairs.flax_paths[path]], torch_records[path], tolerance)
        if result is None or result.passed:
            continue
        later = [torch_inputs[k] for k in map(fingerprint, torch_records[path][1]) if torch_inputs.get(k, -1) > i]
        if not later:
            continue
        consumer = order[min(later)]
        consumer_inputs = {fingerprint(x) for x in recorded[pairs.flax_paths[consumer]][0]}
        if not any(fingerprint(y) in consumer_inputs for y in recorded[pairs.flax_paths[path]][1]):
            flax_path = pairs.flax_paths[path]
            pairs.unpair(
                path,
                f"{NO_OUTPUT}: torch passes it on to {consumer} as it is, while {flax_path}'s flax output is not "
                f"what {pairs.flax_paths[consumer]} is given",
            )


def _pair_output(pairs: Pairs, path: str, flax_record, torch_record, tolerance: Tolerance) -> TensorResult | None:
    """The worst output error of the pair at ``path`` (its layout decided on its inputs first), or ``None`` when
    its outputs do not fit torch's; nothing is noted."""
    (f_ins, f_outs), (t_ins, t_outs) = flax_record, torch_record
    pairs.decide(path, f_ins, t_ins)
    fitted, _ = in_torch_layout("output", f_outs, t_outs, pairs, path)
    results = [compare_activation(f"output {i}", "module output", f, t, tolerance) for i, f, t in fitted]
    return max(results, key=lambda r: r.excess) if results else None
