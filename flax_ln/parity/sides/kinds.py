"""The kinds of flax side a comparison takes (:data:`KINDS`), and which kind a user's flax side is
(:func:`flax_side_kind`), before any work. Imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax_ln.parity.core.failure import note_failure
from flax_ln.parity.core.structure import model_difference
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


def check_factories(**factories: Any) -> None:
    """``TypeError`` (before any work) for a factory argument (``torch_factory=``, ``flax_factory=``) that is given
    and cannot be called."""
    for argument, factory in factories.items():
        if factory is not None and not callable(factory):
            raise TypeError(
                f"{argument} must be a zero-argument callable that builds the model afresh (lambda: MyModel(config)), "
                f"got a {type(factory).__name__}: {factory!r:.60}"
            )


def built_by_flax_factory(factory: Callable[[], Any], flax_module: Any) -> Any:
    """What ``factory()`` builds, checked to be ``flax_module`` built again: of its kind (else ``TypeError``), with
    its structure and static configuration, only dtypes may differ
    (:func:`~flax_ln.parity.core.structure.model_difference`: an NNX module's graph, a Linen module's fields, a
    ``Function``'s code and parameter structure; else ``ValueError`` naming what differs).
    An exception the factory raises carries a note naming it."""
    try:
        built = factory()
    except Exception as err:
        note_failure(err, "raised inside flax_factory(), which builds the flax side of the float64 check")
        raise
    if flax_side_kind(built) is not flax_side_kind(flax_module):
        raise TypeError(
            f"flax_factory built a {type(built).__name__}, but the flax side is a "
            f"{type(flax_module).__name__}: the factory must build the same kind of flax side"
        )
    difference = model_difference(flax_module, built)
    if difference is not None:
        raise ValueError(
            f"flax_factory builds another model than flax_module ({difference}): the float64 check must run the "
            "port compared in float32, so the factory must build it with the same structure and static "
            "configuration (only dtypes may differ)"
        )
    return built
