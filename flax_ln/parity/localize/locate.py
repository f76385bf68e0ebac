"""Localisation, written once over the flax side's interface (:class:`~flax_ln.parity.sides.flax.FlaxSide`):
the submodules paired (:func:`pair_modules`), the first whose output diverges and where the difference arises
(:func:`first_divergence`), and each run alone on its torch twin's inputs (:func:`isolate`); :func:`localize`
puts them in a report and never lets an error there lose the verdict. Imports no torch."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_ln.parity.core.call import Call, run_forward
from flax_ln.parity.core.policy import Tolerance
from flax_ln.parity.localize.activations import compare_activation, compare_activations, in_torch_layout
from flax_ln.parity.localize.gradient_only import gradient_only_modules
from flax_ln.parity.localize.inside import (
    activation_modules_in_own_code,
    activation_pairs,
    activations_in_own_code,
    inside_module,
)
from flax_ln.parity.localize.integers import integer_arguments, integer_inputs
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records
from flax_ln.parity.records.pairing import (
    NO_OUTPUT,
    PairingArgumentError,
    Pairs,
    ParameterGroups,
    complete_pairs,
    filled_variables,
    fingerprint,
    pairs_by_parameters,
    projection_layouts,
)
from flax_ln.parity.records.replay import Replayed, constant_arguments, nudged
from flax_ln.parity.records.torch_trace import TorchTrace
from flax_ln.parity.report.data import FirstDivergence, Isolation, ParityReport, TensorResult
from flax_ln.parity.report.text import commonest
from flax_ln.parity.sides.flax import FlaxSide
from flax_ln.parity.sides.torch import TorchSide


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


def _within_tolerance(r: TensorResult) -> bool:
    """Whether a module's own error is within its tolerance, NaN or Inf at the same places on both sides
    allowed (an input that holds NaN gives NaN on both sides: that is not the module's own error)."""
    if r.problem is not None or not math.isfinite(r.relative_error):
        return False
    return r.relative_error <= r.tolerance.rtol or r.max_abs_error <= r.tolerance.atol


def _input_errors(
    compared: Sequence[TensorResult], torch_records: Records, flax_records: Records, tolerance: Tolerance, pairs: Pairs
) -> list[TensorResult]:
    """The worst input error of each compared pair (named by its torch path), its layout as its outputs' (decided
    by :func:`first_divergence`); a pair whose inputs do not fit torch's is left out."""
    errors = []
    for path in (r.name for r in compared):
        fitted, _ = in_torch_layout("input", flax_records[path][0], torch_records[path][0], pairs, path)
        inputs = [compare_activation(f"input {i}", "module input", f, t, tolerance) for i, f, t in fitted]
        inputs += integer_inputs(pairs, path, tolerance)
        if inputs:
            errors.append(dataclasses.replace(max(inputs, key=lambda r: r.excess), name=path))
    return errors


def _pair_output(pairs: Pairs, path: str, flax_record, torch_record, tolerance: Tolerance) -> TensorResult | None:
    """The worst output error of the pair at ``path`` (its layout decided on its inputs first), or ``None`` when
    its outputs do not fit torch's; nothing is noted."""
    (f_ins, f_outs), (t_ins, t_outs) = flax_record, torch_record
    pairs.decide(path, f_ins, t_ins)
    fitted, _ = in_torch_layout("output", f_outs, t_outs, pairs, path)
    results = [compare_activation(f"output {i}", "module output", f, t, tolerance) for i, f, t in fitted]
    return max(results, key=lambda r: r.excess) if results else None


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


def _inputs_fail(results: list[TensorResult]) -> bool:
    return any(not r.passed for r in results)


def first_divergence(
    torch_records: Records, flax_records: Records, tolerance: Tolerance, pairs: Pairs
) -> tuple[list[TensorResult], FirstDivergence | None]:
    """Every paired submodule's output error (``flax_records`` by torch path), in torch execution order, and
    where the difference first arises.

    A flax activation is put into torch's layout first (see :class:`~flax_ln.parity.records.pairing.Pairs`; where
    several axis permutations fit, the pair's inputs decide); a pair that does not fit is skipped, the reason in
    ``pairs.skipped``. The first module whose output is out of tolerance is where the difference is *seen*
    (``seen_at``); where it *arises* is :func:`_locate`: that module, or the code of a module between two of its
    paired children. Errors compound down the stack; :func:`isolate` does not let them.
    """
    errors, compared = [], {}
    sources = pairs.input_sources(flax_records.get(WHOLE_MODEL), torch_records.get(WHOLE_MODEL))  # + pairs' outputs
    firsts: dict[str, tuple[str, np.ndarray, np.ndarray]] = {}  # each earlier pair's first outputs
    for path, t_record in torch_records.items():
        if path not in flax_records or path not in pairs.modules:
            continue
        f_outs = flax_records[path][1]
        fed = firsts.get(pairs.fed_by.get(path, ""))
        pairs.decide(path, flax_records[path][0], t_record[0], sources, fed=fed, tolerance=tolerance)
        pairs.decide(path, f_outs, t_record[1], sources, which="output")
        if f_outs and t_record[1]:
            firsts[path] = (path, np.asarray(f_outs[0]), t_record[1][0])
        for f, t in zip(f_outs, t_record[1]):
            if (where := pairs.output_places(path, f, np.shape(t))) is not None:
                sources[fingerprint(t)] = (np.asarray(f), np.asarray(t), where)
        outputs = compare_activations("output", f_outs, t_record[1], tolerance, pairs, path)
        if outputs:
            compared[path] = outputs
            errors.append(dataclasses.replace(max(outputs, key=lambda r: r.excess), name=path))
    seen = next((p for p, outs in compared.items() if not all(r.passed for r in outs)), None)
    if seen is None:
        return errors, None
    return errors, _locate(seen, list(compared), torch_records, flax_records, tolerance, pairs)


def _locate(
    seen: str, compared: list[str], torch_records: Records, flax_records: Records, tolerance: Tolerance, pairs: Pairs
) -> FirstDivergence:
    """Where the difference first seen at ``seen`` arises, among the ``compared`` pairs (execution order).

    A module is its nearest compared ancestor's child. If ``seen`` has children (each agrees: they ran before
    it) and its inputs agree, the gap is in its own code: before the first child whose inputs differ, else after
    the last child. If it has none and its inputs agree (or none are compared), it is the module itself.
    Otherwise its inputs were made by the code of the nearest ancestor whose own inputs agree: in that ancestor,
    between the child on the way down that took the difference in and its previous sibling (or the start).
    """

    def inputs(path: str) -> list[TensorResult]:
        found = compare_activations("input", flax_records[path][0], torch_records[path][0], tolerance, pairs, path)
        return found + integer_inputs(pairs, path, tolerance)

    def parent(path: str) -> str | None:
        above = [p for p in compared if p != path and (p == WHOLE_MODEL or path.startswith(p + "."))]
        return max(above, key=lambda p: -1 if p == WHOLE_MODEL else len(p), default=None)

    def children(path: str) -> list[str]:
        return [p for p in compared if parent(p) == path]

    evidence_in = inputs(seen)
    evidence_out = compare_activations("output", flax_records[seen][1], torch_records[seen][1], tolerance, pairs, seen)

    def found(module: str, between: tuple[str | None, str | None] | None) -> FirstDivergence:
        def flax_path(path: str | None) -> str | None:
            return None if path is None else pairs.flax_paths[path]

        flax_between = None if between is None else (flax_path(between[0]), flax_path(between[1]))
        return FirstDivergence(
            module,
            evidence_in,
            evidence_out,
            pairs.flax_paths[module],
            pairs.by_parameters,
            between,
            flax_between,
            seen,
        )

    kids = children(seen)
    if not _inputs_fail(evidence_in):
        if not kids:
            return found(seen, None)
        failing = next((k for k in kids if _inputs_fail(inputs(k))), None)
        if failing is None:
            return found(seen, (kids[-1], None))
        at = kids.index(failing)
        return found(seen, (kids[at - 1] if at else None, failing))
    child = seen
    while (above := parent(child)) is not None:
        if not _inputs_fail(inputs(above)):  # everything the parent's code had agrees: the gap is in that code
            siblings = children(above)
            at = siblings.index(child)
            return found(above, (siblings[at - 1] if at else None, child))
        child = above
    return found(seen, None)


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
    :meth:`~flax_ln.parity.sides.flax.FlaxSide.run_alone` on torch's recorded inputs, and its output is
    compared with torch's recorded output. An error here cannot come from upstream, so a deep run names the
    module that differs. A module that could not be run alone is skipped with the reason. ``culprits`` are
    the failing modules none of whose own submodules fails; a module whose own error is within tolerance (NaN
    at the same places on both sides allowed) is never one. ``flax_culprits`` are their flax paths;
    ``own_code`` the culprits with paired children, all agreeing alone: the difference is in the code between;
    ``kept`` the floating arguments of each module's call that kept the port's own value.
    """
    results, skipped, kept = [], {}, {}
    for path, run in flax.run_alone(pairs, torch_records, torch_calls, flax_records, forward):
        if isinstance(run, str):
            skipped[path] = run
            continue
        if isinstance(run, Replayed) and run.kept:  # floating arguments that kept the port's own value (a mask)
            kept[path] = run.kept
        try:
            compared = compare_activations("output", run, torch_records[path][1], tolerance, pairs, path)
        except Exception as err:  # noqa: BLE001 - one module that cannot be compared is skipped, the rest go on
            skipped[path] = f"its output could not be compared: {type(err).__name__}: {str(err)[:120]}"
            continue
        if compared:
            results.append(dataclasses.replace(max(compared, key=lambda r: r.excess), name=path))
        else:
            skipped[path] = pairs.skipped.get(path, "its outputs do not match torch's in number or shape")
    failing = [r.name for r in results if not _within_tolerance(r)]
    culprits = [p for p in failing if not any(inside_module(q, p) for q in failing if q != p)]
    own_code = [p for p in culprits if any(inside_module(r.name, p) for r in results)]
    ran = {r.name for r in results}
    kept = {p: names for p, names in kept.items() if p in ran}
    return Isolation(results, skipped, culprits, [pairs.flax_paths[p] for p in culprits], own_code, kept)


class _Phase:
    """Runs one phase of localisation, an error in it kept as a note instead of raised (``modules=`` mistakes
    are raised: they are the caller's)."""

    def __init__(self, report: ParityReport):
        self.report, self.notes = report, list[str]()

    def run(self, what: str, step: Callable[[], Any]) -> tuple[bool, Any]:
        try:
            return True, step()
        except PairingArgumentError:
            raise
        except Exception as err:  # noqa: BLE001 - localisation never costs the verdict; the error is reported
            self.notes.append(
                f"{what} failed ({type(err).__name__}: {str(err)[:300]}); the verdict and every tensor's result stand"
            )
            return False, None


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
    :func:`pair_modules`), then each run alone. A flax side without modules leaves its note instead.

    An error in any phase (recording, pairing, the first divergence, isolation), or anywhere else in localising,
    ends it with a note in ``report.localization_note``; the verdict and the results are never lost. When the
    verdict failed on outputs but no recorded module output differs in the eager run (the compiled run differs),
    the note says that the localisation did not reproduce the failure."""
    if flax.localization_note is not None:
        report.localization_note = flax.localization_note
        return
    if side.records is None:
        return
    phase = _Phase(report)
    phase.run("localising", lambda: _localize(report, side, flax, call, tolerance, modules, phase))
    ok, gradient_only = phase.run("naming a difference seen only in a gradient", lambda: gradient_only_modules(report))
    report.gradient_only = gradient_only if ok else report.gradient_only
    report.localization_note = "; ".join(phase.notes) if phase.notes else report.localization_note


def _localize(report, side, flax, call, tolerance, modules, phase: _Phase) -> None:
    args = [jnp.asarray(x) for x in flax.inputs]
    kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in side.kwargs.items()}
    model = flax.eager_model()

    def forward():
        with jax.disable_jit():  # eagerly, op by op: a scan over layers runs as a loop, one layer at a time
            return run_forward(call.forward[1], model, args, kwargs)

    ok, recorded = phase.run("recording the flax side's submodules", lambda: flax.record(forward))
    if not ok:
        return
    torch_records = side.records
    ok, pairs = phase.run(
        "pairing torch's modules with flax's",
        lambda: pair_modules(
            flax,
            torch_keys=list(side.state_dict),
            modules=modules,
            recorded=recorded,
            torch_records=torch_records,
            tolerance=tolerance,
            torch_trace=side.trace,
        ),
    )
    if not ok:
        return
    ok, constants = phase.run(
        "telling the port's activations from its constants",
        lambda: constant_arguments(
            flax.recorded_calls(), flax.record_nudged(lambda m: run_forward(call.forward[1], m, nudged(args), kwargs))
        ),
    )
    pairs.constants = constants if ok else pairs.constants
    torch_calls = side.calls
    ok, inside = phase.run(
        "pairing activations inside layers", lambda: activation_pairs(flax, pairs, torch_records, side.calls, recorded)
    )
    if ok:
        torch_records, torch_calls = inside
    _, integers = phase.run(
        "pairing integer arguments", lambda: integer_arguments(pairs, torch_calls, flax.recorded_calls())
    )
    pairs.integers = integers or {}
    flax_records = {t: recorded[f] for t, f in pairs.flax_paths.items() if f in recorded}
    unrecorded = {p: why for p, why in flax.unrecorded().items() if p not in recorded}
    ok, found = phase.run(
        "finding the first divergence", lambda: first_divergence(torch_records, flax_records, tolerance, pairs)
    )
    if ok:
        report.module_errors, report.first_divergence = found
        report.first_divergence = _not_recorded_within(report.first_divergence, unrecorded, pairs, recorded)
        _, inputs = phase.run(
            "comparing each module's inputs",
            lambda: _input_errors(report.module_errors, torch_records, flax_records, tolerance, pairs),
        )
        report.module_inputs = inputs or []
    report.module_pairs = {t: pairs.flax_paths.get(t) for t in torch_records}
    report.module_skipped = {**pairs.unpaired, **pairs.skipped}
    failed_outputs = [r.name for r in report.results if r.kind == "output" and not r.passed]
    if ok and failed_outputs and not report.module_errors:
        why = commonest(report.module_skipped)
        phase.notes.append(
            f"no paired module could be compared in the eager localisation run ({len(report.module_skipped)} "
            f"pairs skipped or unpaired{why}), so nothing says where {', '.join(failed_outputs[:3])} differ"
        )
    elif ok and failed_outputs and report.first_divergence is None:
        phase.notes.append(
            f"the eager localisation run does not reproduce the failure of {', '.join(failed_outputs[:3])}: every "
            "recorded module output agrees there, so the difference arises only in the compiled (jit) run "
            "(XLA's fusion and op order); the first divergence and isolation describe the eager run"
        )
    if side.calls is not None or not flax.isolates_from_calls:
        ok, isolation = phase.run(
            "isolating each module",
            lambda: isolate(
                torch_records, torch_calls, flax, tolerance, pairs=pairs, flax_records=flax_records, forward=forward
            ),
        )
        if ok:
            report.isolation = _unrecorded_culprits(isolation, unrecorded, pairs)
            phase.run(
                "looking for activations inside layers",
                lambda: activations_in_own_code(
                    report, flax, pairs, torch_records, torch_calls, recorded, tolerance, forward
                ),
            )
            phase.run(
                "naming torch's activation modules",
                lambda: activation_modules_in_own_code(report, pairs, torch_records),
            )
            _confirm_between(report)


def _held_by(flax_path: str, unrecorded: Mapping[str, str]) -> list[str]:
    """The unrecorded flax modules inside ``flax_path``."""
    return [p for p in unrecorded if inside_module(p, flax_path)]


def _not_recorded_within(fd: FirstDivergence | None, unrecorded: Mapping[str, str], pairs: Pairs, recorded: Records):
    """A gap in a module's own code holds the modules that ran there without a record: the difference may be in
    them (a scan's body), so the first divergence names them; those inside a paired child are that child's."""
    if fd is None or fd.between is None:
        return fd
    inside = [pairs.flax_paths.get(t) for t in pairs.flax_paths if t != fd.module and inside_module(t, fd.module)]
    children = [c for c in inside if c in recorded]  # the recorded pairs: they could take the blame
    held = [p for p in _held_by(fd.flax_module, unrecorded) if not any(p == c or inside_module(p, c) for c in children)]
    return dataclasses.replace(fd, unrecorded=held)


def _unrecorded_culprits(isolation: Isolation, unrecorded: Mapping[str, str], pairs: Pairs) -> Isolation:
    """Every unrecorded module with its reason; a culprit holding one is not blamed in its own code."""
    own_code = [p for p in isolation.own_code if not _held_by(pairs.flax_paths[p], unrecorded)]
    return dataclasses.replace(isolation, own_code=own_code, unrecorded=dict(unrecorded))


def _confirm_between(report: ParityReport) -> None:
    """A gap between children whose next child itself disagrees alone is that child's own difference."""
    fd, isolation = report.first_divergence, report.isolation
    if fd is None or fd.between is None or isolation is None or fd.between[1] not in isolation.culprits:
        return
    child = fd.between[1]
    flax_child = fd.flax_between[1] if fd.flax_between is not None else child
    report.first_divergence = dataclasses.replace(
        fd, module=child, flax_module=flax_child or child, between=None, flax_between=None, unrecorded=[]
    )


def check_torch_paths(torch_module, modules: Mapping[str, Any] | None) -> None:
    """Raise ``ValueError`` (before any compute) for a key of ``modules=`` that names no torch submodule (a typo
    would otherwise pair or remove nothing, silently), listing the nearest known paths."""
    known = [path for path, _ in torch_module.named_modules() if path]
    for path in modules or {}:
        if path not in known:
            near = difflib.get_close_matches(path, known, n=5, cutoff=0.5) or known[:5]
            raise ValueError(
                f"modules={{{path!r}: ...}}: the torch module {type(torch_module).__name__} has no submodule "
                f"{path!r}; the nearest of its module paths (named_modules()): {near}. Give a torch path as "
                "named_modules() names it"
            )
