"""What the flax sides over a pytree of variables share (:class:`TreeSide`): a :class:`~flax_ln.parity.sides.flax.Linen`
module's variables or a :class:`~flax_ln.parity.sides.flax.Function`'s params, copied into a
:class:`~flax_ln.convert.PytreeTree` and filled there through the port's key map. Imports no torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from flax_ln.convert import KeyMap, KeyPlan, PytreeTree, fill_tree
from flax_ln.parity.core.policy import parameter_dtype
from flax_ln.parity.sides.flax import (
    FlaxSide,
    as_float64,
    paired_inputs,
    require_differentiable,
    require_key_map,
    torch_ties,
    widens_to_float64,
    write_through,
)
from flax_ln.parity.sides.torch import TorchSide


def _check_tree_params(tree: PytreeTree, dtype: str, noun: str) -> None:
    want = np.dtype(parameter_dtype(dtype))
    for name, (_, have, required) in tree.variables().items():
        if required and np.issubdtype(have, np.floating) and have != want:
            hint = " under jax.enable_x64(True)" if want == np.float64 else ""
            raise ValueError(
                f"compare_modules(dtype={dtype!r}): flax {noun} {name!r} is {have}, expected {want}: "
                f"initialise the flax side's parameters in {want}{hint}"
            )


@dataclasses.dataclass
class TreeSide(FlaxSide):
    """A flax side whose variables are a pytree, filled (on a copy, ``tree``) with a :class:`TorchSide`'s weights
    through a key map; ``wrapper`` is the caller's :class:`~flax_ln.parity.sides.flax.Linen` or
    :class:`~flax_ln.parity.sides.flax.Function` (or its float64 copy). A kind gives the class attributes below
    and ``parts``."""

    wrapper: Any
    tree: PytreeTree

    wrapper_type: ClassVar[type]  # what the user passes: Linen or Function
    tree_type: ClassVar[type[PytreeTree]]  # how its variables are named: LinenTree or PytreeTree
    variable_noun: ClassVar[str]  # how an error names one of its variables
    # the variables that are differentiated, for require_differentiable: the "params" collection (a Linen
    # module's); None: every leaf, integer ones being state (a Function's)
    differentiated: ClassVar[str | None] = "params"

    @classmethod
    def variables_of(cls, wrapper: Any) -> Any:
        """The caller's pytree of variables in ``wrapper``."""
        raise NotImplementedError

    @classmethod
    def takes(cls, flax_module: Any) -> bool:
        return isinstance(flax_module, cls.wrapper_type)

    @classmethod
    def check(cls, flax_module: Any, weights: KeyMap | None, mesh) -> None:
        """``weights`` must be a key map: there is no module tree for the converter's rules."""
        if weights is None:
            raise TypeError(
                f"a flax_ln.parity.{type(flax_module).__name__} flax side needs weights=KeyMap(...): its variables "
                "are filled from the torch state dict through the key map (there is no module tree for the "
                "converter's rules to mirror)"
            )
        require_key_map(weights)
        variables = cls.variables_of(flax_module)
        if cls.differentiated is None:
            fix = "A Function's params hold arrays only: pass a setting like this to apply itself (functools.partial)"
            require_differentiable(variables, cls.variable_noun, fix, floating_only=False)
        elif isinstance(variables, Mapping) and cls.differentiated in variables:
            fix = (
                f"Keep it out of the {cls.differentiated!r} collection (self.variable('constants', name, ...)), "
                "so that it is state"
            )
            require_differentiable({cls.differentiated: variables[cls.differentiated]}, cls.variable_noun, fix)

    @classmethod
    def wrapped(cls, flax_module: Any) -> Any:
        """What the side keeps of the user's ``flax_module`` (a kind that also takes bare modules wraps them)."""
        return flax_module

    @classmethod
    def tree_of(cls, wrapper: Any) -> PytreeTree:
        """The caller's variables in ``wrapper`` as this kind's tree."""
        return cls.tree_type(cls.variables_of(wrapper))

    @classmethod
    def load(
        cls,
        flax_module: Any,
        side: TorchSide,
        flax_inputs: Sequence[np.ndarray] | None,
        weights: KeyMap | None,
        plan: KeyPlan | None = None,
    ) -> TreeSide:
        """Check the parameters' dtype, fill a copy of the variables through ``weights``, pair the inputs."""
        assert weights is not None  # check
        wrapper = cls.wrapped(flax_module)
        inputs, orders = paired_inputs(side, flax_inputs)
        empty = cls.tree_of(wrapper)
        variables = empty.variables().values()
        floating = {dtype for _, dtype, required in variables if required and np.issubdtype(dtype, np.floating)}
        if side.dtype == "float64" and widens_to_float64(floating):
            empty = empty.like(as_float64(empty.tree()))  # float64 in one argument, on the copy it fills
        _check_tree_params(empty, side.dtype, cls.variable_noun)
        tree = empty.like(empty.tree())
        plan = fill_tree(tree, side.state_dict, weights, ties=torch_ties(side), plan=plan)
        return cls(inputs, orders, plan, wrapper, tree)

    def param_tangents(self, state_dict: Mapping[str, np.ndarray]) -> Any:
        assert self.plan is not None  # a tree side is loaded through a key map
        tree = self.tree.like(self.tree.tree())
        write_through(self.plan, tree, state_dict)
        return dataclasses.replace(self, tree=tree).parts().params

    def variable_tree(self) -> PytreeTree:
        return self.tree

    def float64(self) -> TreeSide:
        """Every floating variable cast to float64."""
        return dataclasses.replace(self, tree=self.float64_tree())

    def float64_tree(self) -> PytreeTree:
        """A copy of ``tree`` with every floating variable cast to float64."""
        return self.tree.like(as_float64(self.tree.tree()))
