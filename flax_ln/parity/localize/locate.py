"""Localisation, written once over the flax side's interface (:class:`~flax_ln.parity.sides.flax.FlaxSide`):
the submodules paired (:func:`~flax_ln.parity.localize.pair.pair_modules`), the first whose output diverges and
where the difference arises (:func:`first_divergence`), and each run alone on its torch twin's inputs
(:func:`isolate`); :func:`localize` puts them in a report and never lets an error there lose the verdict. Imports
no torch."""

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
from flax_ln.parity.localize.pair import pair_modules
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records
from flax_ln.parity.records.pairing import (
    PairingArgumentError,
    Pairs,
    fingerprint,
)
from flax_ln.parity.records.replay import Replayed, call_signature, constant_arguments, nudged
from flax_ln.parity.report.data import FirstDivergence, Isolation, ParityReport, TensorResult
from flax_ln.parity.report.text import commonest
from flax_ln.parity.sides.flax import FlaxSide
from flax_ln.parity.sides.torch import TorchSide


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
    carried: Carried | None = None,
) -> None:
    """The first divergence and isolated mode into ``report``, from the torch side's records (when it has them):
    one eager flax forward recorded, its submodules paired with torch's (``modules=`` as in
    :func:`pair_modules`), then each run alone. A flax side without modules leaves its note instead.
    ``carried``: what an earlier localisation of the same comparison found (in another dtype), reused where it holds,
    and filled for a later one.

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
    carried = Carried() if carried is None else carried
    phase.run("localising", lambda: _localize(report, side, flax, call, tolerance, modules, phase, carried))
    ok, gradient_only = phase.run("naming a difference seen only in a gradient", lambda: gradient_only_modules(report))
    report.gradient_only = gradient_only if ok else report.gradient_only
    report.localization_note = "; ".join(phase.notes) if phase.notes else report.localization_note


@dataclasses.dataclass
class Carried:
    """What one localisation found that a later one of the same comparison (the float32 run after the float64
    check) may reuse: the port's constant arguments (:func:`~flax_ln.parity.records.replay.constant_arguments`,
    decided by a nudged run, which the values' dtype does not change), with the signature of the calls they were
    found in (:func:`~flax_ln.parity.records.replay.call_signature`): reused only for the same calls."""

    signature: dict[str, tuple] | None = None
    constants: dict[str, set[str]] | None = None


def _localize(report, side, flax, call, tolerance, modules, phase: _Phase, carried: Carried) -> None:
    args = [jnp.asarray(x) for x in flax.inputs]
    kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in side.kwargs.items()}
    model = flax.eager_model()

    def forward():  # a scan over layers runs as a loop, one layer at a time
        return eagerly(run_forward, call.forward[1], model, args, kwargs)

    def nudged_forward(nudged_model):  # the same calls as the recorded run, on the programs it compiled
        return eagerly(run_forward, call.forward[1], nudged_model, nudged(args), kwargs)

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
    calls = flax.recorded_calls()
    signature = call_signature(calls)
    if carried.constants is not None and carried.signature == signature:
        ok, constants = True, carried.constants  # the same calls, in another dtype: no second nudged run
    else:
        ok, constants = phase.run(
            "telling the port's activations from its constants",
            lambda: constant_arguments(calls, flax.record_nudged(nudged_forward)),
        )
        if ok:
            carried.signature, carried.constants = signature, constants
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
            lambda: eagerly(
                isolate,
                torch_records,
                torch_calls,
                flax,
                tolerance,
                pairs=pairs,
                flax_records=flax_records,
                forward=forward,
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


def eagerly(step: Callable[..., Any], *args, **kwargs) -> Any:
    """``step(*args, **kwargs)`` op by op, under ``jax.disable_jit()``: localisation's recorded run, its nudged run
    and each module run alone, so that all three make the same small programs, each compiled once."""
    with jax.disable_jit():
        return step(*args, **kwargs)


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
