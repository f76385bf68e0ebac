"""The flax side of a comparison: an NNX module run under ``jax.jit`` for outputs and gradients or tangents.

Imports no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert import load_torch_state_dict, to_torch_state_dict
from flax_ln.parity.call import _call, _is_float, named_outputs
from flax_ln.parity.policy import HALF_PRECISION
from flax_ln.parity.torch_side import TorchSide


def _on_mesh(mesh, params, rest, arrays):
    """The flax side placed on a ``(data, fsdp)`` mesh, as training places it (:mod:`flax_ln.sharding`).

    Parameters and the other state (buffers, RNG state) by the FSDP rule
    (:func:`flax_ln.sharding.state_shardings`); every other array (inputs, masks) split
    along its first axis over ``data`` when that axis divides evenly (the batch), else
    replicated (a mask broadcast over the batch, a scalar).

    Returns:
      ``(params, rest, arrays)`` placed, and the ``sharding`` record of the report:
      the mesh's axis sizes and each parameter's ``PartitionSpec`` (flax path -> str).
    """
    from flax_ln.sharding import DATA, batch_sharding, replicated, state_shardings

    params = jax.device_put(params, state_shardings(params, mesh))
    rest = jax.device_put(rest, state_shardings(rest, mesh))

    def place(x):
        split = x is not None and np.ndim(x) > 0 and np.shape(x)[0] % mesh.shape[DATA] == 0
        return None if x is None else jax.device_put(x, batch_sharding(mesh) if split else replicated(mesh))

    specs = {".".join(map(str, path)): str(var.get_value().sharding.spec) for path, var in nnx.to_flat_state(params)}
    record = {"mesh": dict(mesh.shape), "params": specs}
    return params, rest, jax.tree.map(place, arrays, is_leaf=lambda x: x is None), record


def _flax_split(model, inputs, kwargs):
    """``(graphdef, params, rest)``, the floating input positions and values, the other inputs,
    and the kwargs split into arrays and static values."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    float_positions = [i for i, x in enumerate(inputs) if _is_float(x)]
    array_kwargs = {k: jnp.asarray(v) for k, v in kwargs.items() if isinstance(v, (np.ndarray, jax.Array))}
    static_kwargs = {k: v for k, v in kwargs.items() if k not in array_kwargs}
    float_inputs = [jnp.asarray(inputs[i]) for i in float_positions]
    other_inputs = [None if i in float_positions else jnp.asarray(x) for i, x in enumerate(inputs)]
    return graphdef, params, rest, float_positions, float_inputs, other_inputs, array_kwargs, static_kwargs


def _run_flax(model, inputs, input_names, kwargs, forward, loss, cotangents, param_names, mesh=None):
    """Outputs, loss and gradients (same keys as :func:`_run_torch`) of the flax side, jitted; on ``mesh``
    (see :func:`_on_mesh`) when given. Also returns the sharding record (``None`` without a mesh)."""
    graphdef, params, rest, float_positions, float_inputs, other_inputs, array_kwargs, static_kwargs = _flax_split(
        model, inputs, kwargs
    )

    def objective(params, rest, float_inputs, other_inputs, array_kwargs):
        args = list(other_inputs)
        for i, x in zip(float_positions, float_inputs):
            args[i] = x
        outputs = _call(forward, nnx.merge(graphdef, params, rest), args, {**array_kwargs, **static_kwargs})
        if loss is not None:
            return loss[1](outputs), outputs
        value = sum(
            jnp.sum(v * jnp.asarray(cotangents[k], v.dtype)) for k, v in named_outputs(outputs) if k in cotangents
        )
        return value, outputs

    sharding = None
    if mesh is not None:
        params, rest, (float_inputs, other_inputs, array_kwargs), sharding = _on_mesh(
            mesh, params, rest, (float_inputs, other_inputs, array_kwargs)
        )
    grad_fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 2), has_aux=True))
    (value, outputs), (param_grads, input_grads) = grad_fn(params, rest, float_inputs, other_inputs, array_kwargs)
    grads = {f"grad {input_names[i]}": np.asarray(g) for i, g in zip(float_positions, input_grads)}
    named = to_torch_state_dict(nnx.merge(graphdef, param_grads, rest))
    grads.update({k: v for k, v in named.items() if k in param_names})  # buffers are not trained
    return {k: np.asarray(v) for k, v in named_outputs(outputs)}, np.asarray(value), grads, sharding


def _run_flax_jvp(model, inputs, input_names, kwargs, forward, tangents, state_dict, param_names, mesh=None):
    """Outputs and output tangents (``tangent <output>``, as :func:`_run_torch_jvp`) of the flax side:
    ``jax.jvp``, jitted; on ``mesh`` (see :func:`_on_mesh`) when given, each tangent placed like its
    primal. Also returns the sharding record (``None`` without a mesh).

    The parameter tangents, keyed by torch name, go through the converter like weights
    (into a copy of the model), so they land in the flax layout; parameters without
    one get a zero tangent.
    """
    graphdef, params, rest, float_positions, float_inputs, other_inputs, array_kwargs, static_kwargs = _flax_split(
        model, inputs, kwargs
    )
    holder = nnx.clone(model)
    load_torch_state_dict(
        holder,
        {
            k: tangents[k] if k in tangents else np.zeros_like(v) if k in param_names else v
            for k, v in state_dict.items()
        },
    )
    param_tangents = nnx.split(holder, nnx.Param, ...)[1]
    input_tangents = [
        jnp.asarray(tangents[f"tangent {input_names[i]}"], float_inputs[k].dtype) for k, i in enumerate(float_positions)
    ]

    sharding = None
    if mesh is not None:
        params, rest, (float_inputs, other_inputs, array_kwargs), sharding = _on_mesh(
            mesh, params, rest, (float_inputs, other_inputs, array_kwargs)
        )
        param_tangents, input_tangents = jax.device_put(
            (param_tangents, input_tangents), jax.tree.map(lambda x: x.sharding, (params, float_inputs))
        )

    @jax.jit
    def primal_and_tangent(params, rest, float_inputs, param_tangents, input_tangents, other_inputs, array_kwargs):
        def run(params, float_inputs):
            args = list(other_inputs)
            for i, x in zip(float_positions, float_inputs):
                args[i] = x
            return _call(forward, nnx.merge(graphdef, params, rest), args, {**array_kwargs, **static_kwargs})

        return jax.jvp(run, (params, float_inputs), (param_tangents, input_tangents))

    outputs, output_tangents = primal_and_tangent(
        params, rest, float_inputs, param_tangents, input_tangents, other_inputs, array_kwargs
    )
    named = {k: np.asarray(v) for k, v in named_outputs(outputs)}
    named.update({f"tangent {k}": np.asarray(v) for k, v in named_outputs(output_tangents) if _is_float(named[k])})
    return named, sharding


def _check_flax_params(model: nnx.Module, dtype: str) -> None:
    want = np.dtype("float32" if dtype in HALF_PRECISION else dtype)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and jnp.issubdtype(node.dtype, jnp.floating) and np.dtype(node.dtype) != want:
            hint = " under jax.enable_x64(True)" if want == np.float64 else ""
            raise ValueError(
                f"compare_modules(dtype={dtype!r}): flax parameter {'.'.join(map(str, path))!r} is {node.dtype}, "
                f"expected {want}: build the flax module with param_dtype=jnp.{want}{hint}"
            )


def _axis_order(torch_input: np.ndarray, flax_input: np.ndarray, index: int) -> tuple[int, ...]:
    """The permutation ``p`` with ``flax_input == torch_input.transpose(p)``; identity when shapes agree."""
    if torch_input.shape == flax_input.shape and np.array_equal(torch_input, flax_input, equal_nan=True):
        return tuple(range(torch_input.ndim))
    for perm in itertools.permutations(range(torch_input.ndim)):
        moved = np.transpose(torch_input, perm)
        if moved.shape == flax_input.shape and np.array_equal(moved, flax_input, equal_nan=True):
            return perm
    raise ValueError(
        f"flax_inputs[{index}] (shape {flax_input.shape}) must hold the values of inputs[{index}] (shape "
        f"{torch_input.shape}) in some axis order, e.g. np.moveaxis(inputs[{index}], 1, -1) for NCL -> NLC"
    )


def _float64_twin(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with every floating parameter and buffer in float64 and every module's
    compute ``dtype`` set to float64 (call under x64)."""
    twin = nnx.clone(model)
    graphdef, state = nnx.split(twin)
    state = jax.tree.map(lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    twin = nnx.merge(graphdef, state)
    for _, module in nnx.iter_modules(twin):
        for attr in ("dtype", "param_dtype"):
            value = getattr(module, attr, None)
            if value is not None and jnp.issubdtype(value, jnp.floating):
                object.__setattr__(module, attr, jnp.float64)
    return twin


def _float64(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if _is_float(v) else v for k, v in arrays.items()}


def _flax_results(
    side: TorchSide, flax_eval: nnx.Module, flax_inputs, orders, forward, loss, mesh=None
) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """The flax side's values under the keys of ``side.expected`` (input gradients back in torch's axis order),
    and the sharding record when it ran on ``mesh``."""
    names, kwargs = side.input_names, side.kwargs
    if side.mode == "jvp":
        tangents = dict(side.tangents)
        for i, order in enumerate(orders):  # input tangents into the flax layout
            key = f"tangent {names[i]}"
            if key in tangents:
                tangents[key] = np.transpose(tangents[key], order)
        return _run_flax_jvp(
            flax_eval, flax_inputs, names, kwargs, forward, tangents, side.state_dict, set(side.param_names), mesh
        )
    outputs, value, grads, sharding = _run_flax(
        flax_eval, flax_inputs, names, kwargs, forward, loss, side.cotangents, set(side.param_names), mesh
    )
    for i, order in enumerate(orders):
        key = f"grad {names[i]}"
        if key in grads:
            grads[key] = np.transpose(grads[key], np.argsort(order))
    return {**outputs, **({"loss": value} if loss is not None else {}), **grads}, sharding
