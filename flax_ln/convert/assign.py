"""What every way of loading shares: torch values as NumPy, the dtype check, and the write into a variable."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ModuleT = TypeVar("ModuleT", bound=nnx.Module)

# Variable kinds that torch saves (parameters and running statistics): each must be covered by a rule.
SAVED_KINDS = (nnx.Param, nnx.BatchStat)


def as_numpy(value: Any) -> np.ndarray:
    """A NumPy view of a torch tensor or array-like, without importing torch unless given one."""
    if hasattr(value, "detach"):  # a torch.Tensor
        import torch

        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            import ml_dtypes

            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    return np.asarray(value)


def dtype_problem(got: np.dtype, want: np.dtype) -> str | None:
    """Why a ``got`` value cannot replace a ``want`` variable: floats stay floating, integers stay integer."""
    if jnp.issubdtype(want, jnp.floating) and not jnp.issubdtype(got, jnp.floating):
        return (
            f"dtype {got} is not floating, but the parameter is {want}; pass floating-point weights "
            "(e.g. tensor.float()), an integer or bool tensor here is usually the wrong key"
        )
    if jnp.issubdtype(want, jnp.integer) and not jnp.issubdtype(got, jnp.integer):
        return f"dtype {got} is not an integer dtype, but the buffer is {want}; pass an integer tensor"
    return None


def assign(var: nnx.Variable, new: np.ndarray) -> None:
    """Set ``var`` to an owned copy of ``new`` in its own dtype, placed with its sharding."""
    old = var.get_value()  # also a ShapeDtypeStruct, for a model made by nnx.eval_shape
    # An owned copy: torch's state_dict() shares memory with its parameters, and JAX
    # on the CPU may alias a NumPy buffer, so a later in-place torch update (an
    # optimizer step) would otherwise change the flax model behind its back.
    # Placed with the variable's sharding: kept by a sharded model, named by an abstract
    # one from flax_ln.sharding.abstract_model(make, mesh); None is the default device.
    value = jax.device_put(np.array(new, dtype=old.dtype, copy=True), getattr(old, "sharding", None))
    var.set_value(value)
