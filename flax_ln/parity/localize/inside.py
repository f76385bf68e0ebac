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

from typing import Any

from flax_ln.parity.records.capture import Calls, Records
from flax_ln.parity.records.pairing import Pairs, fingerprint
from flax_ln.parity.sides.flax import FlaxSide
from flax_ln.parity.sides.keras import BEFORE_ACTIVATION


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
