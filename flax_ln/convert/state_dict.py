"""The state-dict entry points: :func:`load_torch_state_dict` and :func:`to_torch_state_dict`.

Each goes through the rule table (:mod:`flax_ln.convert.rules`, for models that mirror
their torch twins) or, given ``weights=``, through the port's own
:class:`~flax_ln.convert.KeyMap` (:mod:`flax_ln.convert.keymap_transfer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from flax_ln.convert.assign import ModuleT
from flax_ln.convert.keymap import KeyMap
from flax_ln.convert.keymap_transfer import export_with_key_map, load_with_key_map
from flax_ln.convert.rules import export_with_rules, load_with_rules


def load_torch_state_dict(
    model: ModuleT, state_dict: Mapping[str, Any], *, strict: bool = True, weights: KeyMap | None = None
) -> ModuleT:
    """Load a torch-style state dict into ``model`` in place and return it.

    Values may be ``torch.Tensor`` or NumPy arrays; each is cast to the dtype of the
    variable it replaces (floating parameters take only floating values, integer
    buffers only integer ones). Every key is validated before anything is written:
    missing and unexpected keys (only when ``strict``), wrong shapes and incompatible
    dtypes are all listed in one :class:`ConversionError`, and a failed load leaves the
    model as it was. Persistent buffers that flax recomputes (:class:`DerivedBuffer`)
    must equal the recomputed value. A parameter that no rule covers raises
    :class:`MissingRuleError` naming its module. Each value is placed with its variable's
    sharding: a sharded model keeps its placement, and
    ``flax_ln.sharding.abstract_model(make, mesh)`` gives a model to load onto a mesh
    with training's FSDP shardings, never initialised.

    With ``weights=`` a :class:`~flax_ln.convert.KeyMap` (the port's own table)
    places the keys instead of the rule table, as strictly: every key matches one rule,
    every ``nnx.Param`` and ``nnx.BatchStat`` is filled once, all problems in one error,
    nothing loaded on error. ``strict=False`` then allows keys no rule matches and
    variables no key fills.

    Args:
      model: the NNX model; its variables fix the expected shapes and dtypes.
      state_dict: torch key -> tensor or array, in torch layout.
      strict: require exactly the model's keys.
      weights: the port's key map; ``None``: the rule table.
    """
    if weights is not None:
        return load_with_key_map(model, state_dict, weights, strict=strict)
    return load_with_rules(model, state_dict, strict=strict)


def to_torch_state_dict(
    model: Any, *, weights: KeyMap | None = None, like: Mapping[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """The model's weights as a dict of NumPy arrays with torch names and layouts.

    Includes the persistent buffers torch saves (running statistics, ``num_batches_tracked``,
    derived masks), so the result loads with ``strict=True`` into the torch twin (wrap
    values with ``torch.from_numpy``). Stacked layers come out as per-layer keys.

    With ``weights=`` a :class:`~flax_ln.convert.KeyMap` names the keys, each layout
    inverted. ``like=`` (the torch model's ``state_dict()``) fixes the key set, order and
    dtypes, gives the keys the map ignores, and the torch shapes that a layout with a
    reshape needs to invert. Without it, keys are written from each rule's regex (a
    literal with groups), ignored keys are left out with a warning, and a rule that needs
    torch's shapes is an error naming it. A tie (torch keys sharing one tensor) whose
    port copies differ raises :class:`ConversionError` naming it.

    With a key map the model may also be any variable tree: a Linen module's variables
    (``LinenTree(variables)`` or ``flax_ln.parity.Linen``), a parameter pytree
    (``PytreeTree(params)`` or ``flax_ln.parity.Function``). Anything else, a bare pytree
    included, is a ``TypeError`` saying what to pass.

    Args:
      model: the NNX model; with ``weights=``, any variable tree as above.
      weights: the port's key map; ``None``: the rule table.
      like: a torch state dict to match; only with ``weights=``.
    """
    if weights is not None:
        return export_with_key_map(model, weights, like)
    if like is not None:
        raise TypeError("to_torch_state_dict: like= goes with weights=KeyMap(...); the rule table fixes the keys")
    return export_with_rules(model)
