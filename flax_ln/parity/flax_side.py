"""The flax side of a comparison: an NNX module, loaded with the torch weights and run under ``jax.jit``.

:class:`NNXSide` is the one kind of flax side today. It loads the weights, runs the forward
for outputs and gradients (or tangents), and gives the module that localisation walks.
Another kind (a Linen module, a plain function over a parameter pytree) is another class
with the same ``load``/``values``/``float64_values`` and ``model``. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ln.convert import KeyMap, KeyPlan, find_ties, load_torch_state_dict, to_torch_state_dict
from flax_ln.parity.call import Call, check_same_outputs, flatten_outputs, is_float, with_floats
from flax_ln.parity.call import call as call_forward
from flax_ln.parity.policy import parameter_dtype
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
        return None if x is None else jax.device_put(x, batch_sharding(mesh, (DATA,)) if split else replicated(mesh))

    specs = {".".join(map(str, path)): str(var.get_value().sharding.spec) for path, var in nnx.to_flat_state(params)}
    record = {"mesh": dict(mesh.shape), "params": specs}
    return params, rest, jax.tree.map(place, arrays, is_leaf=lambda x: x is None), record


def _check_flax_params(model: nnx.Module, dtype: str) -> None:
    want = np.dtype(parameter_dtype(dtype))
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
    return {k: v.astype(np.float64) if is_float(v) else v for k, v in arrays.items()}


def _torch_output_shapes(side: TorchSide) -> dict[str, tuple[int, ...]]:
    return {k: tuple(np.shape(v)) for k, v in side.expected.items() if side.kinds[k] == "output"}


@dataclasses.dataclass
class _Split:
    """A model split for ``jax.jit``: the arrays that are traced, and what stays static."""

    graphdef: Any
    params: Any
    rest: Any
    float_positions: list[int]
    float_inputs: list[Any]
    other_inputs: list[Any]
    array_kwargs: dict[str, Any]
    static_kwargs: dict[str, Any]

    @classmethod
    def of(cls, model: nnx.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> _Split:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]  # nnx.split's result is typed as a variadic tuple
        float_positions = [i for i, x in enumerate(inputs) if is_float(x)]
        array_kwargs = {
            k: jnp.asarray(v) for k, v in kwargs.items() if isinstance(v, (np.ndarray, np.generic, jax.Array))
        }
        static_kwargs = {k: v for k, v in kwargs.items() if k not in array_kwargs}
        float_inputs = [jnp.asarray(inputs[i]) for i in float_positions]
        other_inputs = [None if i in float_positions else jnp.asarray(x) for i, x in enumerate(inputs)]
        return cls(graphdef, params, rest, float_positions, float_inputs, other_inputs, array_kwargs, static_kwargs)

    def place(self, mesh) -> dict[str, Any] | None:
        """Put the arrays on ``mesh`` (see :func:`_on_mesh`); the sharding record, ``None`` without a mesh."""
        if mesh is None:
            return None
        self.params, self.rest, (self.float_inputs, self.other_inputs, self.array_kwargs), sharding = _on_mesh(
            mesh, self.params, self.rest, (self.float_inputs, self.other_inputs, self.array_kwargs)
        )
        return sharding

    def outputs(self, forward, params, float_inputs, other_inputs, array_kwargs, side: TorchSide, dropped: dict):
        """The forward's compared outputs by name (checked against torch's, at trace time, before any
        derivative) and its result as it is; the dropped leaves go into ``dropped``."""
        args = with_floats(other_inputs, self.float_positions, float_inputs)
        model = nnx.merge(self.graphdef, params, self.rest)
        raw = call_forward(forward, model, args, {**array_kwargs, **self.static_kwargs})
        named, skipped = flatten_outputs(raw)
        check_same_outputs(_torch_output_shapes(side), {k: tuple(np.shape(v)) for k, v in named})
        dropped.update(skipped)
        return {k: jnp.asarray(v) for k, v in named}, raw


def _torch_named(grads_model: nnx.Module, param_grads, plan: KeyPlan | None) -> dict[str, Any]:
    """Parameter gradients under torch's names: through the converter's rules, or through ``plan`` (tied
    copies summed, each through its inverse layout; a variable shared in two places counts once)."""
    if plan is None:
        return to_torch_state_dict(grads_model)
    flat = {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(param_grads)}
    return plan.torch_gradients(flat)


def _run_flax(model, inputs, call: Call, side: TorchSide, mesh=None, plan: KeyPlan | None = None):
    """Outputs, dropped outputs, loss, gradients (same keys as the torch side) and the sharding record of
    the flax side, jitted; on ``mesh`` (see :func:`_on_mesh`) when given; named through ``plan`` when given."""
    split = _Split.of(model, inputs, call.kwargs)
    dropped: dict[str, str] = {}
    loss, cotangents = call.loss, side.cotangents

    def objective(params, rest, float_inputs, other_inputs, array_kwargs):
        outputs, raw = split.outputs(call.forward[1], params, float_inputs, other_inputs, array_kwargs, side, dropped)
        if loss is not None:
            return loss[1](raw), outputs
        value = sum(
            (jnp.sum(outputs[k] * jnp.asarray(c, outputs[k].dtype)) for k, c in cotangents.items()), jnp.zeros(())
        )
        return value, outputs

    sharding = split.place(mesh)
    grad_fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 2), has_aux=True))
    (value, outputs), (param_grads, input_grads) = grad_fn(
        split.params, split.rest, split.float_inputs, split.other_inputs, split.array_kwargs
    )
    grads = {f"grad {call.input_names[i]}": np.asarray(g) for i, g in zip(split.float_positions, input_grads)}
    named = _torch_named(nnx.merge(split.graphdef, param_grads, split.rest), param_grads, plan)
    grads.update({k: v for k, v in named.items() if k in side.param_names})  # buffers and frozen: no gradient
    return {k: np.asarray(v) for k, v in outputs.items()}, dropped, np.asarray(value), grads, sharding


def _run_flax_jvp(
    model, inputs, call: Call, side: TorchSide, tangents, mesh=None, weights: KeyMap | None = None, plan=None
):
    """Outputs and output tangents (``tangent <output>``, as the torch side), the dropped outputs and the
    sharding record of the flax side: ``jax.jvp``, jitted; on ``mesh`` (see :func:`_on_mesh`) when given,
    each tangent placed like its primal.

    The parameter tangents, keyed by torch name, go through the converter like weights
    (into a copy of the model), so they land in the flax layout; parameters without
    one (frozen ones included) get a zero tangent. With ``weights`` (a key map) they go through it;
    a tied alias takes its canonical parameter's tangent.
    """
    split = _Split.of(model, inputs, call.kwargs)
    holder = nnx.clone(model)
    params_of_torch = set(side.param_names) | set(side.frozen)
    canonical = {k: k for k in side.state_dict}
    if plan is not None:
        canonical = {k: plan.canonical(k) for k in side.state_dict}
    load_torch_state_dict(
        holder,
        {
            k: tangents[c] if c in tangents else np.zeros_like(v) if c in params_of_torch else v
            for k, v in side.state_dict.items()
            for c in (canonical[k],)
        },
        weights=weights,
    )
    param_tangents = nnx.split(holder, nnx.Param, ...)[1]
    input_tangents = [
        jnp.asarray(tangents[f"tangent {call.input_names[i]}"], split.float_inputs[k].dtype)
        for k, i in enumerate(split.float_positions)
    ]
    sharding = split.place(mesh)
    if mesh is not None:
        param_tangents, input_tangents = jax.device_put(
            (param_tangents, input_tangents), jax.tree.map(lambda x: x.sharding, (split.params, split.float_inputs))
        )
    dropped: dict[str, str] = {}

    @jax.jit
    def primal_and_tangent(params, rest, float_inputs, param_tangents, input_tangents, other_inputs, array_kwargs):
        def run(params, float_inputs):
            return split.outputs(call.forward[1], params, float_inputs, other_inputs, array_kwargs, side, dropped)[0]

        return jax.jvp(run, (params, float_inputs), (param_tangents, input_tangents))

    outputs, output_tangents = primal_and_tangent(
        split.params,
        split.rest,
        split.float_inputs,
        param_tangents,
        input_tangents,
        split.other_inputs,
        split.array_kwargs,
    )
    named = {k: np.asarray(v) for k, v in outputs.items()}
    named.update({f"tangent {k}": np.asarray(v) for k, v in output_tangents.items() if is_float(named[k])})
    return named, dropped, sharding


def _ties(side: TorchSide) -> dict[str, tuple[str, ...]]:
    """The torch side's ties (keys holding one tensor), each under the name ``named_parameters()`` gives it."""
    named = set(side.param_names) | set(side.frozen)
    ties = {}
    for keys in find_ties(side.state_dict).values():
        canonical = next((k for k in keys if k in named), keys[0])
        ties[canonical] = (canonical, *[k for k in keys if k != canonical])
    return ties


@dataclasses.dataclass
class NNXSide:
    """The flax side as an NNX module, loaded with a :class:`TorchSide`'s weights.

    ``module`` is the caller's (its weights are replaced in place by the strict converter);
    ``model`` an eval-mode copy, which is what runs (the caller's module keeps its mode);
    ``inputs`` the flax side's inputs and ``orders`` the axis permutation of each from torch's;
    ``weights`` the port's key map (``None``: the converter's rules) and ``plan`` it resolved.
    """

    module: nnx.Module
    model: nnx.Module
    inputs: tuple[np.ndarray, ...]
    orders: list[tuple[int, ...]]
    weights: KeyMap | None = None
    plan: KeyPlan | None = None

    @classmethod
    def load(
        cls,
        flax_module: nnx.Module,
        side: TorchSide,
        flax_inputs: Sequence[np.ndarray] | None,
        weights: KeyMap | None = None,
    ) -> NNXSide:
        """Check the flax parameters' dtype, load the torch weights (through ``weights``, a key map, when
        given; else the converter's rules), and pair each input with torch's."""
        inputs = tuple(side.inputs) if flax_inputs is None else tuple(flax_inputs)
        if len(inputs) != len(side.inputs):
            raise ValueError(f"flax_inputs has {len(inputs)} arrays, inputs {len(side.inputs)}: give one per input")
        orders = [_axis_order(t, f, i) for i, (t, f) in enumerate(zip(side.inputs, inputs))]
        _check_flax_params(flax_module, side.dtype)
        load_torch_state_dict(flax_module, side.state_dict, weights=weights)
        plan = None if weights is None else weights.resolve(flax_module, side.state_dict, ties=_ties(side))
        model = nnx.clone(flax_module)
        model.eval()
        return cls(flax_module, model, inputs, orders, weights, plan)

    def values(self, side: TorchSide, call: Call, mesh=None) -> tuple[dict[str, np.ndarray], dict[str, str], Any]:
        """The flax side's values under the keys of ``side.expected`` (input gradients back in torch's axis
        order), its dropped outputs, and the sharding record when it ran on ``mesh``."""
        return self._values(self.model, self.inputs, side, call, mesh)

    def float64_values(self, side: TorchSide, call: Call) -> dict[str, np.ndarray]:
        """:meth:`values` of a float64 twin of the model (same weights), for attribution; call under x64."""
        twin_side = dataclasses.replace(
            side,
            cotangents=_float64(side.cotangents),
            tangents=_float64(side.tangents),
            state_dict=_float64(side.state_dict),
        )
        inputs = tuple(x.astype(np.float64) if is_float(x) else x for x in self.inputs)
        return self._values(_float64_twin(self.model), inputs, twin_side, call, None)[0]

    def _values(self, model, inputs, side: TorchSide, call: Call, mesh):
        names = side.input_names
        if side.mode == "jvp":
            tangents = dict(side.tangents)
            for i, order in enumerate(self.orders):  # input tangents into the flax layout
                key = f"tangent {names[i]}"
                if key in tangents:
                    tangents[key] = np.transpose(tangents[key], order)
            return _run_flax_jvp(model, inputs, call, side, tangents, mesh, self.weights, self.plan)
        outputs, dropped, value, grads, sharding = _run_flax(model, inputs, call, side, mesh, self.plan)
        for i, order in enumerate(self.orders):
            key = f"grad {names[i]}"
            if key in grads:
                grads[key] = np.transpose(grads[key], np.argsort(order))
        return {**outputs, **({"loss": value} if call.loss is not None else {}), **grads}, dropped, sharding
