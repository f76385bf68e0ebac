"""The kinds of flax side a comparison takes (:data:`KINDS`), and which kind a user's flax side is
(:func:`flax_side_kind`), before any work. Imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax_ln.parity.core.failure import note_failure
from flax_ln.parity.core.structure import Rebuild
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


def built_by_flax_factory(factory: Callable[[], Any], flax_module: Any) -> tuple[Any, Rebuild]:
    """What ``factory()`` builds, of ``flax_module``'s kind (else ``TypeError``), as its kind takes it in the
    caller's stead (:meth:`~flax_ln.parity.sides.flax.FlaxSide.rebuilt_as`: a Keras model's variables named by the
    caller's paths); and its :class:`~flax_ln.parity.core.structure.Rebuild`, whose ``confirm`` (after the built
    model's call) says whether it is ``flax_module`` built again: its structure and configuration (an NNX module's
    graph, a Linen module's fields, a ``Function``'s code and parameter structure, a Keras model's layers, private
    ones included, and a functional model's operations), only dtypes may differ.
    An exception the factory raises carries a note naming it."""
    try:
        built = factory()
    except Exception as err:
        note_failure(err, "raised inside flax_factory(), which builds the flax side of the float64 check")
        raise
    kind = flax_side_kind(flax_module)
    if flax_side_kind(built) is not kind:
        raise TypeError(
            f"flax_factory built a {type(built).__name__}, but the flax side is a "
            f"{type(flax_module).__name__}: the factory must build the same kind of flax side"
        )
    return kind.rebuilt_as(built, flax_module), Rebuild(flax_module, built)
