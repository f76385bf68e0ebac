"""Localisation, written once over the flax side's interface (:class:`~flax_ln.parity.flax_side.FlaxSide`):
the submodules paired (:func:`pair_modules`), the first whose output diverges (:func:`first_divergence`), and
each run alone on its torch twin's inputs (:func:`isolate`); :func:`localize` puts them in a report. Imports no
torch."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from flax_ln.parity.call import Call, run_forward
from flax_ln.parity.capture import WHOLE_MODEL, Calls, Records
from flax_ln.parity.flax_side import FlaxSide
from flax_ln.parity.pairing import Pairs, ParameterGroups, complete_pairs, filled_variables, pairs_by_parameters
from flax_ln.parity.policy import Tolerance, compare_tensors
from flax_ln.parity.report import FirstDivergence, Isolation, ParityReport, TensorResult
from flax_ln.parity.torch_side import TorchSide


def pair_modules(
    flax: FlaxSide,
    *,
    torch_keys: Sequence[str] = (),
    modules: Mapping[str, Any] | None = None,
    recorded: Records | None = None,
) -> Pairs:
    """Each flax submodule under the torch path of its twin (the roots under :data:`WHOLE_MODEL`).

    The one place where torch paths and flax paths are paired.

    Without a plan (``flax.plan``): a flax path is mapped through the converter's registered renames
    (:meth:`~flax_ln.parity.flax_side.FlaxSide.mirrored_paths`), else kept as it is (the module trees
    mirror each other).

    With the plan of the port's key map and the torch state dict's ``torch_keys``: a torch submodule pairs
    with a flax submodule when the flax variables its keys fill are exactly the flax module's variables
    (:meth:`~flax_ln.parity.flax_side.FlaxSide.parameter_groups`), at any depth. Where several modules on one
    side hold the same parameters (a wrapper and its only child), they pair innermost with innermost, then
    outwards.

    ``modules``: ``{torch_path: flax_path | (flax_path, layout) | None}`` adds a pair
    (a parameter-free module), gives a pair's activation layout (an einops pattern or a
    permutation triple, torch -> flax), or removes a pair (``None``; with a key map the torch
    module then takes no part in pairing, so that its wrapper pairs instead). ``flax.orders``: the axis
    order of each compared input from torch's to flax's (``flax_inputs=``); where two axis
    permutations fit an activation's shapes (square images), the one the inputs use decides.
    ``recorded``: the flax side's records (:meth:`~flax_ln.parity.flax_side.FlaxSide.record`).
    """
    recorded = {} if recorded is None else recorded
    groups: ParameterGroups = {}
    if flax.plan is None:
        flax_paths = flax.mirrored_paths()
    else:
        groups = flax.parameter_groups(filled_variables(flax.plan), recorded)
        flax_paths = pairs_by_parameters(groups, flax.plan, torch_keys, modules)
    by_flax_path = flax.module_paths(groups, recorded)
    return complete_pairs(flax_paths, by_flax_path, modules, flax.orders, flax.plan is not None, flax.paths_named)


def _within_tolerance(r: TensorResult) -> bool:
    """Whether a module's own error is within its tolerance, NaN or Inf at the same places on both sides
    allowed (an input that holds NaN gives NaN on both sides: that is not the module's own error)."""
    if r.problem is not None or not math.isfinite(r.relative_error):
        return False
    return r.relative_error <= r.tolerance.rtol or r.max_abs_error <= r.tolerance.atol


def _compare_activations(
    label: str, flax_arrays: list, torch_arrays: list, tolerance: Tolerance, pairs: Pairs, path: str
) -> list[TensorResult]:
    """Flax activations (put into torch's layout) against torch's, pairwise; pairs of different shapes are
    skipped (with a key map, the reason is kept in ``pairs.skipped``)."""
    results = []
    for i, (f, t) in enumerate(zip(flax_arrays, torch_arrays)):
        moved = pairs.to_torch(path, f, t.shape)
        if isinstance(moved, str):
            pairs.skipped.setdefault(path, f"{label} {i}: {moved}")
        elif moved.shape == t.shape:
            results.append(compare_tensors(f"{label} {i}", f"module {label}", moved, t, tolerance))
    return results


def first_divergence(
    torch_records: Records, flax_records: Records, tolerance: Tolerance, pairs: Pairs
) -> tuple[list[TensorResult], FirstDivergence | None]:
    """Every paired submodule's output error (``flax_records`` by torch path), in torch execution order, and
    the first that diverges.

    A flax activation is put into torch's layout first: the pair's own layout, else the converter's layout
    rule for the module type (channels-last Conv output to channels-first), else, for pairs found by their
    parameters, the unique axis permutation from one shape to the other (an ambiguous pair is skipped, the
    reason in ``pairs.skipped``). The first divergence also reports the errors of that submodule's inputs, so
    a broken module can be told from one fed broken data. Errors compound down the stack; :func:`isolate`
    does not let them.
    """
    errors, divergence = [], None
    for path, (t_ins, t_outs) in torch_records.items():
        if path not in flax_records or path not in pairs.modules:
            continue
        f_ins, f_outs = flax_records[path]
        outputs = _compare_activations("output", f_outs, t_outs, tolerance, pairs, path)
        if not outputs:
            continue
        worst = max(outputs, key=lambda r: r.excess)
        errors.append(dataclasses.replace(worst, name=path))
        if divergence is None and not worst.passed:
            inputs = _compare_activations("input", f_ins, t_ins, tolerance, pairs, path)
            divergence = FirstDivergence(path, inputs, outputs, pairs.flax_paths[path], pairs.by_parameters)
    return errors, divergence


def isolate(
    torch_records: Records,
    torch_calls: Calls | None,
    flax: FlaxSide,
    tolerance: Tolerance,
    *,
    pairs: Pairs,
    flax_records: Records,
    forward: Callable[[], Any],
) -> Isolation:
    """Each flax submodule run on its torch twin's recorded inputs, alone: which module's own computation differs.

    Every paired submodule is run by the flax side's
    :meth:`~flax_ln.parity.flax_side.FlaxSide.run_alone` on torch's recorded inputs, and its output is
    compared with torch's recorded output. An error here cannot come from upstream, so a deep run names the
    module that differs. A module that could not be run alone is skipped with the reason. ``culprits`` are
    the failing modules none of whose own submodules fails; a module whose own error is within tolerance (NaN
    at the same places on both sides allowed) is never one. ``flax_culprits`` are their flax paths.
    """
    results, skipped = [], {}
    for path, run in flax.run_alone(pairs, torch_records, torch_calls, flax_records, forward):
        if isinstance(run, str):
            skipped[path] = run
            continue
        compared = _compare_activations("output", run, torch_records[path][1], tolerance, pairs, path)
        if compared:
            results.append(dataclasses.replace(max(compared, key=lambda r: r.excess), name=path))
        else:
            skipped[path] = pairs.skipped.get(path, "its outputs do not match torch's in number or shape")
    failing = [r.name for r in results if not _within_tolerance(r)]

    def inside(child: str, parent: str) -> bool:
        return parent == WHOLE_MODEL and child != WHOLE_MODEL or child.startswith(parent + ".")

    culprits = [p for p in failing if not any(inside(q, p) for q in failing if q != p)]
    return Isolation(results, skipped, culprits, [pairs.flax_paths[p] for p in culprits])


def localize(
    report: ParityReport,
    side: TorchSide,
    flax: FlaxSide,
    call: Call,
    tolerance: Tolerance,
    modules: Mapping[str, Any] | None = None,
) -> None:
    """The first divergence and isolated mode into ``report``, from the torch side's records (when it has them):
    one eager flax forward recorded, its submodules paired with torch's (``modules=`` as in
    :func:`pair_modules`), then each run alone. A flax side without modules leaves its note instead."""
    if flax.localization_note is not None:
        report.localization_note = flax.localization_note
        return
    if side.records is None:
        return
    args = [jnp.asarray(x) for x in flax.inputs]
    kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in side.kwargs.items()}
    model = flax.eager_model()

    def forward():
        return run_forward(call.forward[1], model, args, kwargs)

    recorded = flax.record(forward)
    pairs = pair_modules(flax, torch_keys=list(side.state_dict), modules=modules, recorded=recorded)
    flax_records = {t: recorded[f] for t, f in pairs.flax_paths.items() if f in recorded}
    report.module_errors, report.first_divergence = first_divergence(side.records, flax_records, tolerance, pairs)
    report.module_skipped = dict(pairs.skipped)
    if side.calls is not None or not flax.isolates_from_calls:
        report.isolation = isolate(
            side.records, side.calls, flax, tolerance, pairs=pairs, flax_records=flax_records, forward=forward
        )
