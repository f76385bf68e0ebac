"""The flax side as a pure function over a parameter pytree: :class:`FunctionSide`, for a
:class:`~flax_ln.parity.sides.flax.Function`. It has no modules: no localisation. Imports no torch."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from flax_ln.convert import KeyMap, PytreeTree
from flax_ln.convert.trees import is_python_number
from flax_ln.parity.core.call import with_floats
from flax_ln.parity.sides.flax import Function, Parts
from flax_ln.parity.sides.tree import TreeSide

NEEDS_MODULES = (
    "localisation needs modules: a Function has no submodules to pair with torch's, so no first divergence "
    "or isolated mode; every output and gradient is compared above"
)


@dataclasses.dataclass
class FunctionSide(TreeSide):
    """The flax side as a :class:`~flax_ln.parity.sides.flax.Function`: ``apply(params, *inputs, **kwargs)``,
    differentiated with respect to every floating leaf of ``params`` (a copy, filled through the key map)."""

    wrapper_type: ClassVar[type] = Function
    tree_type: ClassVar[type[PytreeTree]] = PytreeTree
    variable_noun: ClassVar[str] = "params leaf"
    differentiated: ClassVar[str | None] = None
    localization_note: ClassVar[str | None] = NEEDS_MODULES

    @classmethod
    def variables_of(cls, wrapper: Any) -> Any:
        return wrapper.params

    @classmethod
    def check(cls, flax_module: Any, weights: KeyMap | None, mesh) -> None:
        """And no ``mesh`` (its params have no sharding rule); ``apply`` must be callable."""
        super().check(flax_module, weights, mesh)
        if mesh is not None:
            raise ValueError(
                "mesh= is not supported for a flax_ln.parity.Function flax side (its params are an arbitrary "
                "pytree, with no sharding rule); compare it without mesh, or as an NNX or Linen module"
            )
        if not callable(flax_module.apply):
            raise TypeError(f"Function(apply, params): apply must be callable, got {type(flax_module.apply).__name__}")

    def parts(self) -> Parts:
        """The floating arrays are differentiated, the other leaves (integer tables, Python numbers) are state."""
        apply = self.wrapper.apply
        variables = self.tree.tree()
        leaves, treedef = jax.tree_util.tree_flatten(variables)
        names = list(self.tree.names(variables))
        floating = [
            i
            for i, x in enumerate(leaves)
            if not is_python_number(x) and jnp.issubdtype(jnp.result_type(x), jnp.floating)
        ]
        others = [None if i in floating else x for i, x in enumerate(leaves)]

        def build(params, rest):
            return functools.partial(apply, jax.tree_util.tree_unflatten(treedef, with_floats(rest, floating, params)))

        float_names = [names[i] for i in floating]
        return Parts(build, [leaves[i] for i in floating], others, lambda g: dict(zip(float_names, g)))
