"""The kinds of flax side a comparison takes (:data:`KINDS`), and which kind a user's flax side is
(:func:`flax_side_kind`), before any work. Imports no torch."""

from __future__ import annotations

from typing import Any

from flax_ln.parity.sides.equinox import EquinoxSide
from flax_ln.parity.sides.flax import FlaxSide
from flax_ln.parity.sides.function import FunctionSide
from flax_ln.parity.sides.keras import KerasSide
from flax_ln.parity.sides.linen import LinenSide
from flax_ln.parity.sides.nnx import NNXSide

# The kinds of flax side: a user's flax side is of the first that takes it.
KINDS: tuple[type[FlaxSide], ...] = (LinenSide, FunctionSide, EquinoxSide, KerasSide, NNXSide)


def flax_side_kind(flax_module: Any) -> type[FlaxSide]:
    """The kind of flax side ``flax_module`` is: the first of :data:`KINDS` that takes it; ``TypeError`` (before
    any work) for an object none takes."""
    kind = next((kind for kind in KINDS if kind.takes(flax_module)), None)
    if kind is None:
        raise TypeError(
            f"the flax side is a {type(flax_module).__module__}.{type(flax_module).__qualname__}, which the engine "
            "does not know: compare_modules takes an nnx.Module, an equinox.Module, a Keras model, "
            "flax_ln.parity.Linen(module, variables) or flax_ln.parity.Function(apply, params). Wrap a model of "
            "another module system (a pytree with its own call) as Function(apply, params), with params its arrays "
            "and apply(params, *inputs) calling it"
        )
    return kind
