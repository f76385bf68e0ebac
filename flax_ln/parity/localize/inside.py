"""An activation inside a layer (:func:`activation_pairs`): torch keeps it in a module of its own without parameters
(``fc1`` then ``act``), the port applies it inside the layer holding ``fc1``'s parameters (Keras's
``Dense(activation=...)``). Imports no torch.

Pairing by parameters pairs torch's ``fc1`` with the layer's output before its activation
(``fc1 (before its activation)``), and leaves torch's ``act`` without a twin. Yet the layer's own output (after its
activation) is torch's ``act`` output, computed from ``fc1``'s input: so ``act`` pairs with the layer, its torch
record made of ``fc1``'s inputs and ``act``'s outputs (and its call ``fc1``'s). A wrong activation is then named
where it lives on each side, by the first divergence and run alone, and never as the parent's code between
children that agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flax_ln.parity.core.policy import Tolerance
from flax_ln.parity.localize.activations import compare_activations
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records
from flax_ln.parity.records.pairing import Pairs, fingerprint
from flax_ln.parity.report.data import ParityReport
from flax_ln.parity.sides.flax import FlaxSide
from flax_ln.parity.sides.keras import BEFORE_ACTIVATION

AFTER_CODE = " (and its parent's code after it)"  # a probe's torch name: a child and the activation after it


def activation_pairs(
    flax: FlaxSide, pairs: Pairs, torch_records: Records, torch_calls: Calls | None, recorded: Records
) -> tuple[Records, Calls | None]:
    """Pair each parameter-free torch module applied to the output of a torch module paired with a flax layer's
    output before its activation (``recorded``: the flax side's records, by flax path) with that layer, when no
    other torch module is its twin; torch's records and calls come back with the activation's record made of its
    producer's inputs and its own outputs, and its call the producer's (the caller's dicts are not changed)."""
    records, calls = dict(torch_records), None if torch_calls is None else dict(torch_calls)
    twins = set(pairs.flax_paths.values())
    handles: dict[str, Any] | None = None
    for producer, before in list(pairs.flax_paths.items()):
        layer = before.removesuffix(BEFORE_ACTIVATION)
        if layer == before or layer in twins or layer not in recorded or not torch_records.get(producer, ((), ()))[1]:
            continue
        made = fingerprint(torch_records[producer][1][0])
        act = next(
            (
                path
                for path, (inputs, outputs) in torch_records.items()
                if path not in pairs.modules
                and pairs.holders is not None
                and path not in pairs.holders  # no parameters: an activation module (torch's GELU, Tanh, act_fn)
                and inputs
                and outputs
                and fingerprint(inputs[0]) == made
            ),
            None,
        )
        if act is None:
            continue
        handles = flax.module_paths({}, recorded) if handles is None else handles
        if layer not in handles:
            continue
        pairs.assign(act, layer, handles[layer], flax.type_layout(handles[layer]))
        pairs.unpaired.pop(act, None)
        records[act] = (torch_records[producer][0], torch_records[act][1])
        if calls is not None and producer in calls:
            calls[act] = calls[producer]
        twins.add(layer)
    return records, calls


def inside_module(child: str, parent: str) -> bool:
    """Whether ``child`` is a module within ``parent``: a dotted (NNX, torch) or slashed (Keras) descendant, a layer
    of a scanned stack (``layers[2]``), or a part of the module's own output (a Keras layer's ``(before its
    activation)``)."""
    parts = tuple(parent + sep for sep in (".", "/", "[", " ("))
    return parent == WHOLE_MODEL and child != WHOLE_MODEL or child.startswith(parts)


def _consumer(pairs: Pairs, torch_records: Records, recorded: Records, producer: str, layer: str):
    """The first pair after ``producer`` (torch's order) whose flax module is given ``layer``'s flax output, and
    torch's input in that place: what torch's code made of the producer's output (``None`` without one)."""
    made = fingerprint(recorded[layer][1][0])
    order = list(torch_records)
    for path in order[order.index(producer) + 1 :]:
        flax_path = pairs.flax_paths.get(path)
        if flax_path is None or flax_path not in recorded:
            continue
        for k, x in enumerate(recorded[flax_path][0]):
            if fingerprint(x) == made and k < len(torch_records[path][0]):
                return path, torch_records[path][0][k]
    return None


def activations_in_own_code(
    report: ParityReport,
    flax: FlaxSide,
    pairs: Pairs,
    torch_records: Records,
    torch_calls: Calls | None,
    recorded: Records,
    tolerance: Tolerance,
    forward: Callable[[], Any],
) -> None:
    """A culprit in its own code (children that agree alone) whose torch code applies an activation inline to a
    child's output, where the port applies it inside the child's layer (a Keras ``Dense(activation=...)`` paired
    by its output before it): that layer is run alone on the child's torch inputs and compared with what torch's
    code made of the child's output (the input torch gives the layer's consumer). Where it differs, the flax side
    of the culprit (and of a first divergence in that code) is the layer, and the culprit's children are no longer
    said to agree: the disagreeing output is the layer's own."""
    isolation, fd = report.isolation, report.first_divergence
    if isolation is None:
        return
    for p in list(isolation.own_code):
        for producer, before in list(pairs.flax_paths.items()):
            layer = before.removesuffix(BEFORE_ACTIVATION)
            if layer == before or not inside_module(producer, p) or layer in pairs.flax_paths.values():
                continue
            if layer not in recorded or producer not in torch_records:
                continue
            found = _consumer(pairs, torch_records, recorded, producer, layer)
            if found is None:
                continue
            _, made = found
            if not _differs_alone(
                flax, pairs, torch_records, torch_calls, recorded, forward, tolerance, producer, made
            ):
                continue
            at = isolation.culprits.index(p)
            isolation.flax_culprits[at] = layer
            isolation.own_code.remove(p)
            if fd is not None and fd.module == p and fd.between is not None and fd.between[0] == producer:
                report.first_divergence = dataclasses.replace(fd, flax_module=layer, flax_between=None)
            break


def _differs_alone(flax, pairs, torch_records, torch_calls, recorded, forward, tolerance, producer, made) -> bool:
    """Whether the flax layer holding ``producer``'s parameters, with its activation, run alone on ``producer``'s
    torch inputs, differs from ``made`` (torch's value after its own code's activation)."""
    before = pairs.flax_paths[producer]
    layer = before.removesuffix(BEFORE_ACTIVATION)
    probe = f"{producer}{AFTER_CODE}"
    handle = flax.module_paths({}, recorded).get(layer)
    if handle is None:
        return False
    pairs.assign(probe, layer, handle, flax.type_layout(handle))
    try:
        records = {probe: (torch_records[producer][0], [made])}
        calls = None if torch_calls is None or producer not in torch_calls else {probe: torch_calls[producer]}
        runs = dict(flax.run_alone(pairs, records, calls, {probe: recorded[layer]}, forward))
        run = runs.get(probe)
        if run is None or isinstance(run, str):
            return False
        compared = compare_activations("output", list(run), [made], tolerance, pairs, probe)
        return bool(compared) and not all(r.passed for r in compared)
    finally:
        for table in (pairs.modules, pairs.flax_paths, pairs.type_layouts, pairs.decided, pairs.decided_outputs):
            table.pop(probe, None)
        pairs.skipped.pop(probe, None)


def activation_modules_in_own_code(report: ParityReport, pairs: Pairs, torch_records: Records) -> None:
    """A first divergence in a parent's own code between two paired children, where torch's code there is exactly one
    module without parameters (its input is the first child's output, its output the second child's input: torch's
    ``act`` between ``fc1`` and ``fc2``) and the port computes it inline: torch's side of the culprit and of the
    first divergence is that module; the port's stays the parent's code between the children."""
    fd, isolation = report.first_divergence, report.isolation
    if fd is None or fd.between is None or None in fd.between or isolation is None or pairs.holders is None:
        return
    parent, (before, after) = fd.module, fd.between
    if parent not in isolation.own_code or before not in torch_records or after not in torch_records:
        return
    if not torch_records[before][1]:
        return
    made = fingerprint(torch_records[before][1][0])
    taken = {fingerprint(x) for x in torch_records[after][0]}
    found = [
        path
        for path, (inputs, outputs) in torch_records.items()
        if path not in pairs.modules
        and path not in pairs.holders
        and inside_module(path, parent)
        and inputs
        and fingerprint(inputs[0]) == made
        and any(fingerprint(y) in taken for y in outputs)
    ]
    if len(found) != 1:
        return
    isolation.culprits[isolation.culprits.index(parent)] = found[0]
    isolation.own_code.remove(parent)
    report.first_divergence = dataclasses.replace(fd, module=found[0], between=None)
