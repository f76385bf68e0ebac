"""The flax side of a comparison, loaded with the torch weights and run under ``jax.jit``.

Three kinds: an ``nnx.Module`` (:class:`NNXSide`), a Linen module with its variables
(:class:`Linen`) and a pure function over a parameter pytree (:class:`Function`); the last
two are :class:`TreeSide`, over a copy of their variables (:class:`~flax_ln.convert.LinenTree`,
:class:`~flax_ln.convert.PytreeTree`) filled through the port's key map. Each kind splits
into :class:`_Parts` (what is differentiated, what is state, how the forward's first argument
is built from them); the runs (:func:`_run_flax`, :func:`_run_flax_jvp`) are shared.
Imports no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from flax_ln.convert import (
    KeyMap,
    KeyPlan,
    LinenTree,
    PytreeTree,
    fill_tree,
    find_ties,
    load_torch_state_dict,
    to_torch_state_dict,
)
from flax_ln.convert.keymap import _step
from flax_ln.parity.call import Call, check_same_outputs, flatten_outputs, is_float, run_forward, with_floats
from flax_ln.parity.policy import parameter_dtype
from flax_ln.parity.torch_side import TorchSide


def _on_mesh(mesh, params, rest, arrays, flat):
    """The flax side placed on a ``(data, fsdp)`` mesh, as training places it (:mod:`flax_ln.sharding`).

    Parameters and the other state (buffers, RNG state) by the FSDP rule
    (:func:`flax_ln.sharding.state_shardings`); every other array (inputs, masks) split
    along its first axis over ``data`` when that axis divides evenly (the batch), else
    replicated (a mask broadcast over the batch, a scalar).

    ``flat`` names the parameters (see :class:`_Parts`).

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

    specs = {path: str(x.sharding.spec) for path, x in flat(params).items()}
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
class _Parts:
    """A flax side split for differentiation, whatever its kind.

    ``params``: the pytree that is differentiated; ``rest``: the state that is not (buffers,
    RNG state, a Linen module's other collections); ``build(params, rest)``: what the forward
    receives as its first argument (the NNX module, or ``run`` of a Linen module or a
    function); ``flat(tree)``: a ``params``-shaped pytree (its gradients) as ``{flax path: array}``.
    """

    build: Callable[[Any, Any], Any]
    params: Any
    rest: Any
    flat: Callable[[Any], dict[str, Any]]


def _nnx_flat(state) -> dict[str, Any]:
    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(state)}


def _nnx_parts(model: nnx.Module) -> _Parts:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]  # nnx.split's result is typed as a variadic tuple
    return _Parts(functools.partial(nnx.merge, graphdef), params, rest, _nnx_flat)


@dataclasses.dataclass
class _Split:
    """A flax side split for ``jax.jit``: the arrays that are traced, and what stays static."""

    parts: _Parts
    params: Any
    rest: Any
    float_positions: list[int]
    float_inputs: list[Any]
    other_inputs: list[Any]
    array_kwargs: dict[str, Any]
    static_kwargs: dict[str, Any]

    @classmethod
    def of(cls, parts: _Parts, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> _Split:
        float_positions = [i for i, x in enumerate(inputs) if is_float(x)]
        array_kwargs = {
            k: jnp.asarray(v) for k, v in kwargs.items() if isinstance(v, (np.ndarray, np.generic, jax.Array))
        }
        static_kwargs = {k: v for k, v in kwargs.items() if k not in array_kwargs}
        float_inputs = [jnp.asarray(inputs[i]) for i in float_positions]
        other_inputs = [None if i in float_positions else jnp.asarray(x) for i, x in enumerate(inputs)]
        return cls(
            parts, parts.params, parts.rest, float_positions, float_inputs, other_inputs, array_kwargs, static_kwargs
        )

    def place(self, mesh) -> dict[str, Any] | None:
        """Put the arrays on ``mesh`` (see :func:`_on_mesh`); the sharding record, ``None`` without a mesh."""
        if mesh is None:
            return None
        self.params, self.rest, (self.float_inputs, self.other_inputs, self.array_kwargs), sharding = _on_mesh(
            mesh, self.params, self.rest, (self.float_inputs, self.other_inputs, self.array_kwargs), self.parts.flat
        )
        return sharding

    def outputs(self, forward, params, float_inputs, other_inputs, array_kwargs, side: TorchSide, dropped: dict):
        """The forward's compared outputs by name (checked against torch's, at trace time, before any
        derivative) and its result as it is; the dropped leaves go into ``dropped``."""
        args = with_floats(other_inputs, self.float_positions, float_inputs)
        model = self.parts.build(params, self.rest)
        raw = run_forward(forward, model, args, {**array_kwargs, **self.static_kwargs})
        named, skipped = flatten_outputs(raw)
        check_same_outputs(_torch_output_shapes(side), {k: tuple(np.shape(v)) for k, v in named})
        dropped.update(skipped)
        return {k: jnp.asarray(v) for k, v in named}, raw


def _torch_named(split: _Split, param_grads, plan: KeyPlan | None) -> dict[str, Any]:
    """Parameter gradients under torch's names: through the converter's rules, or through ``plan`` (tied
    copies summed, each through its inverse layout; a variable shared in two places counts once)."""
    if plan is None:
        return to_torch_state_dict(split.parts.build(param_grads, split.rest))
    return plan.torch_gradients({k: np.asarray(v) for k, v in split.parts.flat(param_grads).items()})


def _run_flax(parts: _Parts, inputs, call: Call, side: TorchSide, mesh=None, plan: KeyPlan | None = None):
    """Outputs, dropped outputs, loss, gradients (same keys as the torch side) and the sharding record of
    the flax side, jitted; on ``mesh`` (see :func:`_on_mesh`) when given; named through ``plan`` when given."""
    split = _Split.of(parts, inputs, call.kwargs)
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
    named = _torch_named(split, param_grads, plan)
    grads.update({k: v for k, v in named.items() if k in side.param_names})  # buffers and frozen: no gradient
    return {k: np.asarray(v) for k, v in outputs.items()}, dropped, np.asarray(value), grads, sharding


def _tangent_state_dict(side: TorchSide, tangents, plan: KeyPlan | None, buffers_as_values: bool) -> dict:
    """The torch state dict of the parameter tangents: each parameter's (its canonical name's, for a tied
    alias), zero for parameters without one (frozen ones included); buffers keep their values when
    ``buffers_as_values`` (a loader that checks derived buffers), else zero too."""
    params_of_torch = set(side.param_names) | set(side.frozen)
    canonical = {k: k if plan is None else plan.canonical(k) for k in side.state_dict}
    return {
        k: tangents[c] if c in tangents else v if buffers_as_values and c not in params_of_torch else np.zeros_like(v)
        for k, v in side.state_dict.items()
        for c in (canonical[k],)
    }


def _run_flax_jvp(parts: _Parts, inputs, call: Call, side: TorchSide, tangents, param_tangents, mesh=None):
    """Outputs and output tangents (``tangent <output>``, as the torch side), the dropped outputs and the
    sharding record of the flax side: ``jax.jvp``, jitted; on ``mesh`` (see :func:`_on_mesh`) when given,
    each tangent placed like its primal.

    ``param_tangents`` (shaped like ``parts.params``) come from the torch-named tangents through the
    converter or the key map, like weights (see :func:`_tangent_state_dict`), so they land in the flax layout;
    a tied alias takes its canonical parameter's tangent.
    """
    split = _Split.of(parts, inputs, call.kwargs)
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


def _orders(side: TorchSide, flax_inputs: Sequence[np.ndarray] | None):
    """The flax side's inputs and each one's axis permutation from torch's."""
    inputs = tuple(side.inputs) if flax_inputs is None else tuple(flax_inputs)
    if len(inputs) != len(side.inputs):
        raise ValueError(f"flax_inputs has {len(inputs)} arrays, inputs {len(side.inputs)}: give one per input")
    return inputs, [_axis_order(t, f, i) for i, (t, f) in enumerate(zip(side.inputs, inputs))]


class _Side:
    """What the three kinds share: the values of a run (outputs, loss, gradients or tangents) and of its float64
    twin. A kind gives ``model``, ``inputs``, ``orders``, ``plan`` and ``_parts``/``_param_tangents``/``_float64``."""

    model: Any
    inputs: tuple[np.ndarray, ...]
    orders: list[tuple[int, ...]]
    plan: KeyPlan | None

    def _parts(self, model) -> _Parts:
        raise NotImplementedError

    def _param_tangents(self, model, state_dict: Mapping[str, np.ndarray]) -> Any:
        """The tangents (torch-named ``state_dict``) of ``model``'s parameters, shaped like its ``params``."""
        raise NotImplementedError

    def _float64(self, model) -> Any:
        raise NotImplementedError

    buffers_as_values = False  # see _tangent_state_dict

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
        return self._values(self._float64(self.model), inputs, twin_side, call, None)[0]

    def _values(self, model, inputs, side: TorchSide, call: Call, mesh):
        names = side.input_names
        if side.mode == "jvp":
            tangents = dict(side.tangents)
            for i, order in enumerate(self.orders):  # input tangents into the flax layout
                key = f"tangent {names[i]}"
                if key in tangents:
                    tangents[key] = np.transpose(tangents[key], order)
            state = _tangent_state_dict(side, tangents, self.plan, self.buffers_as_values)
            param_tangents = self._param_tangents(model, state)
            return _run_flax_jvp(self._parts(model), inputs, call, side, tangents, param_tangents, mesh)
        outputs, dropped, value, grads, sharding = _run_flax(self._parts(model), inputs, call, side, mesh, self.plan)
        for i, order in enumerate(self.orders):
            key = f"grad {names[i]}"
            if key in grads:
                grads[key] = np.transpose(grads[key], np.argsort(order))
        return {**outputs, **({"loss": value} if call.loss is not None else {}), **grads}, dropped, sharding


@dataclasses.dataclass
class NNXSide(_Side):
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

    buffers_as_values = True  # the converter checks the buffers flax recomputes against their values

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
        inputs, orders = _orders(side, flax_inputs)
        _check_flax_params(flax_module, side.dtype)
        load_torch_state_dict(flax_module, side.state_dict, weights=weights)
        plan = None if weights is None else weights.resolve(flax_module, side.state_dict, ties=_ties(side))
        model = nnx.clone(flax_module)
        model.eval()
        return cls(flax_module, model, inputs, orders, weights, plan)

    def _parts(self, model) -> _Parts:
        return _nnx_parts(model)

    def _param_tangents(self, model, state_dict):
        holder = nnx.clone(model)
        load_torch_state_dict(holder, state_dict, weights=self.weights)
        return nnx.split(holder, nnx.Param, ...)[1]

    def _float64(self, model):
        return _float64_twin(model)


# ---------------------------------------------------------------------------------------------
# Linen modules and functions over a parameter pytree


@dataclasses.dataclass(frozen=True)
class Linen:
    """A Linen module and its variables as the flax side of a comparison (``weights=KeyMap(...)`` required).

    ``variables``: ``{"params": ..., "batch_stats": ...}`` as ``module.init`` gives them (arrays or
    ``jax.ShapeDtypeStruct``); a copy is filled from the torch weights, the caller's is not modified.
    The forward receives ``run``, ``run(*a, **k) = module.apply(variables, *a, method=method, **k)``
    (no RNGs, ``mutable=False``); eval flags (``deterministic=True``) go through ``forward=``.
    Gradients are taken with respect to the ``params`` collection; the others are state.
    A key map names a ``params`` variable by its keys below the collection, dotted
    (``encoder.layer_0.query.kernel``), another collection's with the collection first
    (``batch_stats.bn.mean``).
    """

    module: linen.Module
    variables: Any
    method: Any = None


@dataclasses.dataclass(frozen=True)
class Function:
    """A pure function ``apply(params, *inputs, **kwargs)`` over a pytree of arrays as the flax side of a
    comparison (``weights=KeyMap(...)`` required).

    The forward receives ``run``, ``run(*a, **k) = apply(params, *a, **k)``; gradients are taken with
    respect to every floating leaf of ``params`` (a copy, filled from the torch weights; the caller's is
    not modified). A key map names a leaf by its dict keys, sequence indices and attribute names,
    dotted (``layers.0.w``). Localisation needs modules: a function has none (``mesh`` is not supported).
    """

    apply: Callable[..., Any]
    params: Any


def check_flax_side(flax_module: Any, weights: KeyMap | None, mesh) -> None:
    """Raise a clear error for a flax side the engine cannot take with these options (before any torch run)."""
    if isinstance(flax_module, (Linen, Function)):
        kind = type(flax_module).__name__
        if weights is None:
            raise TypeError(
                f"a flax_ln.parity.{kind} flax side needs weights=KeyMap(...): its variables are filled from the "
                "torch state dict through the key map (there is no module tree for the converter's rules to mirror)"
            )
        if not isinstance(weights, KeyMap):
            raise TypeError(f"weights= takes a KeyMap, got {type(weights).__name__}")
        if isinstance(flax_module, Function) and mesh is not None:
            raise ValueError(
                "mesh= is not supported for a flax_ln.parity.Function flax side (its params are an arbitrary "
                "pytree, with no sharding rule); compare it without mesh, or as an NNX or Linen module"
            )
        if isinstance(flax_module, Function) and not callable(flax_module.apply):
            raise TypeError(f"Function(apply, params): apply must be callable, got {type(flax_module.apply).__name__}")
    elif isinstance(flax_module, linen.Module):
        raise TypeError(
            f"{type(flax_module).__name__} is a Linen module: pass flax_ln.parity.Linen(module, variables, "
            "method=None) with weights=KeyMap(...)"
        )


def _linen_run(module: linen.Module, variables, method):
    def run(*args, **kwargs):
        return module.apply(variables, *args, method=method, **kwargs)

    return run


def _named_leaves(tree: PytreeTree, prefix: tuple[str, ...], pytree) -> dict[str, Any]:
    """``{dotted path in tree: leaf}`` of ``pytree``, a subtree of ``tree``'s at key path ``prefix``."""
    flat = jax.tree_util.tree_flatten_with_path(pytree)[0]
    return {tree.name_of((*prefix, *(_step(k) for k in path))): leaf for path, leaf in flat}


@dataclasses.dataclass
class _TreeModel:
    """A :class:`Linen` or :class:`Function` with its filled variables (``tree``, a copy of the caller's)."""

    kind: Linen | Function
    tree: PytreeTree

    @classmethod
    def of(cls, kind: Linen | Function, variables: Any) -> _TreeModel:
        return cls(kind, LinenTree(variables) if isinstance(kind, Linen) else PytreeTree(variables))

    def filled(self, state_dict: Mapping[str, np.ndarray], weights: KeyMap) -> _TreeModel:
        """A copy of this model with its variables filled from ``state_dict`` through ``weights``."""
        model = _TreeModel.of(self.kind, self.tree.tree())
        fill_tree(model.tree, state_dict, weights)
        return model

    def parts(self) -> _Parts:
        variables = self.tree.tree()
        if isinstance(self.kind, Linen):
            module, method = self.kind.module, self.kind.method
            rest = {k: v for k, v in variables.items() if k != "params"}
            return _Parts(
                lambda params, rest: _linen_run(module, {"params": params, **rest}, method),
                variables.get("params", {}),
                rest,
                functools.partial(_named_leaves, self.tree, ("params",)),
            )
        apply = self.kind.apply
        leaves, treedef = jax.tree_util.tree_flatten(variables)
        names = list(self.tree.names(variables))
        floating = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
        others = [None if i in floating else x for i, x in enumerate(leaves)]

        def build(params, rest):
            return functools.partial(apply, jax.tree_util.tree_unflatten(treedef, with_floats(rest, floating, params)))

        float_names = [names[i] for i in floating]
        return _Parts(build, [leaves[i] for i in floating], others, lambda g: dict(zip(float_names, g)))

    def float64(self) -> _TreeModel:
        """The same model in float64: every floating variable cast, and a Linen module's ``dtype`` and
        ``param_dtype`` set to float64 where they are floating (call under x64)."""
        kind = self.kind
        if isinstance(kind, Linen):
            attrs = {
                a: jnp.float64
                for a in ("dtype", "param_dtype")
                if getattr(kind.module, a, None) is not None and jnp.issubdtype(getattr(kind.module, a), jnp.floating)
            }
            kind = dataclasses.replace(kind, module=kind.module.clone(**attrs) if attrs else kind.module)
        cast = jax.tree.map(
            lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x,
            self.tree.tree(),
        )
        return _TreeModel.of(kind, cast)


def _check_tree_params(model: _TreeModel, dtype: str) -> None:
    want = np.dtype(parameter_dtype(dtype))
    for name, (_, have, required) in model.tree.variables().items():
        if required and np.issubdtype(have, np.floating) and have != want:
            hint = " under jax.enable_x64(True)" if want == np.float64 else ""
            where = "variable" if isinstance(model.kind, Linen) else "params leaf"
            raise ValueError(
                f"compare_modules(dtype={dtype!r}): flax {where} {name!r} is {have}, expected {want}: "
                f"initialise the flax side's parameters in {want}{hint}"
            )


@dataclasses.dataclass
class TreeSide(_Side):
    """The flax side as a :class:`Linen` module or a :class:`Function`, its variables filled (on a copy) with a
    :class:`TorchSide`'s weights through the key map ``weights`` (``plan`` the map resolved)."""

    kind: Linen | Function
    model: _TreeModel
    inputs: tuple[np.ndarray, ...]
    orders: list[tuple[int, ...]]
    weights: KeyMap
    plan: KeyPlan

    @classmethod
    def load(
        cls, kind: Linen | Function, side: TorchSide, flax_inputs: Sequence[np.ndarray] | None, weights: KeyMap
    ) -> TreeSide:
        """Check the parameters' dtype, fill a copy of the variables through ``weights``, pair the inputs."""
        inputs, orders = _orders(side, flax_inputs)
        empty = _TreeModel.of(kind, kind.variables if isinstance(kind, Linen) else kind.params)
        _check_tree_params(empty, side.dtype)
        model = empty.filled(side.state_dict, weights)
        plan = weights.resolve(model.tree, side.state_dict, ties=_ties(side))
        return cls(kind, model, inputs, orders, weights, plan)

    def _parts(self, model) -> _Parts:
        return model.parts()

    def _param_tangents(self, model, state_dict):
        return model.filled(state_dict, self.weights).parts().params

    def _float64(self, model):
        return model.float64()


def load_side(
    flax_module: nnx.Module | Linen | Function,
    side: TorchSide,
    flax_inputs: Sequence[np.ndarray] | None,
    weights: KeyMap | None,
) -> NNXSide | TreeSide:
    """The flax side of the right kind, loaded with ``side``'s weights."""
    if isinstance(flax_module, (Linen, Function)):
        assert weights is not None  # check_flax_side
        return TreeSide.load(flax_module, side, flax_inputs, weights)
    return NNXSide.load(flax_module, side, flax_inputs, weights)
