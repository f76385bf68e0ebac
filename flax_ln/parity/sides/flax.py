"""The flax side of a comparison: :class:`FlaxSide`, what every kind of flax side gives the engine, and the runs
(forward, gradients, tangents; on a mesh; in float64) written once over it. Imports no torch.

A kind is one subclass, in a module of its own: :class:`~flax_ln.parity.sides.nnx.NNXSide` (an ``nnx.Module``),
:class:`~flax_ln.parity.sides.linen.LinenSide` (a :class:`Linen` module with its variables) and
:class:`~flax_ln.parity.sides.function.FunctionSide` (a :class:`Function` over a parameter pytree); the last two
share :class:`~flax_ln.parity.sides.tree.TreeSide` (variables filled on a copy through a key map). A kind owns:

* which objects it takes and what it refuses (``takes``, ``check``), and loading: checking the parameters'
  dtype, filling its variables from the torch state dict (the converter's rules, or a key map whose plan is
  built once, here, and kept as ``plan``), pairing its inputs with torch's (``load``);
* its differentiation (``parts``: what is differentiated, what is state, what the forward receives), its
  gradients under torch's names (``torch_gradients``), its parameter tangents (``param_tangents``) and its
  float64 copy (``float64``);
* its module tree, for localisation: the model an eager run calls (``eager_model``), the recording of every
  submodule's call (``record``), its module paths and the parameters each holds (``module_paths``,
  ``mirrored_paths``, ``parameter_groups``), and each submodule run alone on torch's inputs (``run_alone``).
  A kind without modules says why in ``localization_note``.

Pairing, localisation and isolation over this interface are :mod:`flax_ln.parity.localize.locate`'s; the kind of a
user's flax side is picked in :mod:`flax_ln.parity.sides.kinds`.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen

from flax_ln.convert import KeyMap, KeyPlan, Tie, find_ties
from flax_ln.convert.keymap_transfer import write_by_plan
from flax_ln.convert.layouts import Permute
from flax_ln.convert.trees import LinenTree, PytreeTree, VariableTree, is_python_number
from flax_ln.parity.core.call import (
    Call,
    check_same_outputs,
    flatten_outputs,
    is_float,
    numbers_as_arrays,
    run_forward,
    with_floats,
)
from flax_ln.parity.core.policy import parameter_dtype
from flax_ln.parity.islands.island import Island, float32_rounded
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records
from flax_ln.parity.records.pairing import Pairs, ParameterGroups
from flax_ln.parity.records.replay import PortCall
from flax_ln.parity.sides.outside_state import outside_state_error
from flax_ln.parity.sides.torch import TorchSide


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

    def variable_tree(self) -> LinenTree:
        """Its variables as the converter names them (``to_torch_state_dict(linen, weights=...)`` exports them)."""
        return LinenTree(self.variables)


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

    def variable_tree(self) -> PytreeTree:
        """Its params as the converter names them (``to_torch_state_dict(function, weights=...)`` exports them)."""
        return PytreeTree(self.params)


@dataclasses.dataclass
class Parts:
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


# ---------------------------------------------------------------------------------------------
# What loading shares: the key map, its plan under torch's names, the inputs


def require_key_map(weights: Any) -> KeyMap:
    """``weights`` when it is a :class:`~flax_ln.convert.KeyMap`, else the ``TypeError`` that says so."""
    if not isinstance(weights, KeyMap):
        raise TypeError(f"weights= takes a KeyMap, got {type(weights).__name__}")
    return weights


def torch_ties(side: TorchSide) -> dict[str, tuple[str, ...]]:
    """The torch side's ties (keys holding one tensor), each under the name ``named_parameters()`` gives it, first
    among its aliases: the name its gradient is compared under (a state dict alone names the first key)."""
    return find_ties(side.state_dict, named=[*side.param_names, *side.frozen])


def write_through(plan: KeyPlan, tree: VariableTree, state_dict: Mapping[str, np.ndarray]) -> None:
    """Write a torch-named ``state_dict`` (tangents of the weights ``plan`` loaded) into ``tree`` through ``plan``,
    each value in its targets' flax layouts (scaled by an affine change, with no offset), with no second plan: the
    plan checked the keys, shapes and dtypes. The key map's constants take a zero tangent."""
    variables = tree.variables()
    write_by_plan(
        plan,
        tree,
        lambda target: np.asarray(target.tangent_to_flax(state_dict[target.key])),
        lambda path: np.zeros(variables[path][0], variables[path][1]),
    )


def require_differentiable(tree: Any, noun: str, fix: str, floating_only: bool = True) -> None:
    """Raise ``TypeError``, before any compute, naming the first leaf of ``tree`` (a pytree of parameters) that
    cannot be differentiated: one that is no array or number (a string), or, with ``floating_only``, an array
    whose dtype is not floating or complex (an integer). ``fix`` says how to keep it out of the parameters."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        name = name.removesuffix(".value")  # an nnx.Variable's own attribute
        dtype = getattr(leaf, "dtype", None)
        numeric = dtype is not None and getattr(dtype, "kind", "V") not in "USO"  # not strings or objects
        if dtype is None and isinstance(leaf, (bool, int, float, complex)):
            numeric, dtype = True, np.result_type(type(leaf))
        if numeric and dtype is not None and not (floating_only and not jnp.issubdtype(dtype, jnp.inexact)):
            continue
        found = f"an array of {dtype}" if numeric else f"{type(leaf).__name__} {leaf!r:.40}"
        raise TypeError(
            f"flax {noun} {name!r} holds {found}, expected a floating (or complex) array: parameters are "
            f"differentiated. {fix}"
        )


def as_float64(tree: Any) -> Any:
    """Every floating leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``) in float64 (call under x64); Python
    numbers (hyper-parameters) and leaves that are no array (an Equinox module's activation function, a string
    field: static) as they are."""

    def cast(x: Any) -> Any:
        if is_python_number(x) or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.float64)
        return jnp.asarray(x, jnp.float64)

    return jax.tree.map(cast, tree)


def widens_to_float64(dtypes: set[np.dtype]) -> bool:
    """Whether parameters of these floating ``dtypes`` are copied to float64 for a float64 comparison: float32 ones,
    alone or beside float64 ones (a port built partly under x64). Half precision is the port's own: refused."""
    return np.dtype(np.float32) in dtypes and dtypes <= {np.dtype(np.float32), np.dtype(np.float64)}


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


def paired_inputs(
    side: TorchSide, flax_inputs: Sequence[np.ndarray] | None
) -> tuple[tuple[np.ndarray, ...], list[tuple[int, ...]]]:
    """The flax side's inputs (``flax_inputs``, default torch's) and each one's axis permutation from torch's."""
    inputs = tuple(side.inputs) if flax_inputs is None else tuple(flax_inputs)
    if len(inputs) != len(side.inputs):
        raise ValueError(f"flax_inputs has {len(inputs)} arrays, inputs {len(side.inputs)}: give one per input")
    return inputs, [_axis_order(t, f, i) for i, (t, f) in enumerate(zip(side.inputs, inputs))]


# ---------------------------------------------------------------------------------------------
# The runs, whatever the kind


def _on_mesh(mesh, params, rest, arrays, flat):
    """The flax side placed on a ``(data, fsdp)`` mesh, as training places it (:mod:`flax_ln.sharding`).

    Parameters and the other state (buffers, RNG state) by the FSDP rule
    (:func:`flax_ln.sharding.state_shardings`); every other array (inputs, masks) split
    along its first axis over ``data`` when that axis divides evenly (the batch), else
    replicated (a mask broadcast over the batch, a scalar).

    ``flat`` names the parameters (see :class:`Parts`).

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


def _float64(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if is_float(v) else v for k, v in arrays.items()}


def _torch_output_shapes(side: TorchSide) -> dict[str, tuple[int, ...]]:
    return {k: tuple(np.shape(v)) for k, v in side.expected.items() if side.kinds[k] == "output"}


@dataclasses.dataclass
class _Split:
    """A flax side split for ``jax.jit``: the arrays that are traced, and what stays static."""

    parts: Parts
    params: Any
    rest: Any
    float_positions: list[int]
    float_inputs: list[Any]
    other_inputs: list[Any]
    array_kwargs: dict[str, Any]
    static_kwargs: dict[str, Any]

    @classmethod
    def of(cls, parts: Parts, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> _Split:
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
        try:
            raw = run_forward(forward, model, args, {**array_kwargs, **self.static_kwargs})
        except Exception as err:
            explained = outside_state_error(err, model)
            if explained is None:
                raise
            raise explained from err
        named, skipped = flatten_outputs(raw)
        named = numbers_as_arrays(named, parameter_dtype(side.dtype))
        check_same_outputs(_torch_output_shapes(side), {k: tuple(np.shape(v)) for k, v in named})
        dropped.update(skipped)
        return {k: jnp.asarray(v) for k, v in named}, raw


def _run_flax(flax: FlaxSide, parts: Parts, call: Call, side: TorchSide, mesh=None):
    """Outputs, dropped outputs, loss, gradients (same keys as the torch side) and the sharding record of
    the flax side, jitted; on ``mesh`` (see :func:`_on_mesh`) when given; named by ``flax.torch_gradients``."""
    split = _Split.of(parts, flax.inputs, call.kwargs)
    dropped: dict[str, str] = {}
    loss = call.loss
    # the cotangents are an argument, not constants of the program: a vocabulary's logits' cotangent embedded in it
    # doubled XLA's compile time of a GPT-2 (measured: 1.9 s against 0.9 s in float64)
    cotangents = {} if loss is not None else side.cotangents

    def objective(params, rest, float_inputs, other_inputs, array_kwargs, cotangents):
        outputs, raw = split.outputs(call.forward[1], params, float_inputs, other_inputs, array_kwargs, side, dropped)
        if loss is not None:
            return loss[1](raw), outputs
        value = sum((jnp.sum(outputs[k] * c.astype(outputs[k].dtype)) for k, c in cotangents.items()), jnp.zeros(()))
        return value, outputs

    sharding = split.place(mesh)
    grad_fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 2), has_aux=True))
    (value, outputs), (param_grads, input_grads) = grad_fn(
        split.params, split.rest, split.float_inputs, split.other_inputs, split.array_kwargs, cotangents
    )
    grads = {f"grad {call.input_names[i]}": np.asarray(g) for i, g in zip(split.float_positions, input_grads)}
    named = flax.torch_gradients(parts, param_grads, split.rest)
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


def _run_flax_jvp(parts: Parts, inputs, call: Call, side: TorchSide, tangents, param_tangents, mesh=None):
    """Outputs and output tangents (``tangent <output>``, as the torch side), the dropped outputs and the
    sharding record of the flax side: ``jax.jvp``, jitted; on ``mesh`` (see :func:`_on_mesh`) when given,
    each tangent placed like its primal.

    ``param_tangents`` (shaped like ``parts.params``) come from the torch-named tangents through the
    converter or the key map's plan, like weights (see :func:`_tangent_state_dict`), so they land in the flax
    layout; a tied alias takes its canonical parameter's tangent.
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


# ---------------------------------------------------------------------------------------------
# The interface


Run = list[np.ndarray] | str  # a submodule's floating outputs when run alone, or why it was not


@dataclasses.dataclass
class FlaxSide(abc.ABC):
    """One kind of flax side, loaded with a :class:`TorchSide`'s weights (see the module docstring).

    ``inputs``: the flax side's inputs; ``orders``: each one's axis permutation from torch's; ``plan``: the
    key map's plan, built once when the weights were loaded (``None``: the converter's rules).
    """

    inputs: tuple[np.ndarray, ...]
    orders: list[tuple[int, ...]]
    plan: KeyPlan | None

    needs_key_map: ClassVar[bool] = True  # its variables are filled only through a key map
    buffers_as_values: ClassVar[bool] = False  # see _tangent_state_dict
    localization_note: ClassVar[str | None] = None  # why it cannot be localised (no modules); None: it can
    isolates_from_calls: ClassVar[bool] = False  # run_alone needs torch's recorded calls, not only its records
    paths_named: ClassVar[str] = ""  # how its module paths are named, for an error about modules=

    # ---- which objects, and loading

    @classmethod
    @abc.abstractmethod
    def takes(cls, flax_module: Any) -> bool:
        """Whether the user's ``flax_module`` is of this kind."""

    @classmethod
    def weights_for(cls, flax_module: Any, torch_module: Any, weights: KeyMap | None) -> KeyMap | None:
        """The key map a comparison loads through: ``weights`` as given; a kind may make one where none is (an
        Equinox module whose paths mirror torch's names: the identity map), before any work."""
        return weights

    @classmethod
    def rebuilt_as(cls, built: Any, given: Any) -> Any:
        """``built`` (what ``flax_factory`` built) as a float64 run takes it in place of ``given`` (the caller's):
        itself, unless a kind names its variables by build (a Keras model's automatic numbering)."""
        return built

    @classmethod
    @abc.abstractmethod
    def check(cls, flax_module: Any, weights: KeyMap | None, mesh) -> None:
        """Raise a clear error for a flax side this kind cannot take with these options (before any torch run)."""

    @classmethod
    @abc.abstractmethod
    def load(
        cls,
        flax_module: Any,
        side: TorchSide,
        flax_inputs: Sequence[np.ndarray] | None,
        weights: KeyMap | None,
        plan: KeyPlan | None = None,
    ) -> FlaxSide:
        """Check the parameters' dtype, fill the variables from ``side.state_dict`` (through ``weights``, a key map,
        when given: its plan is built here, once, unless ``plan`` is one this comparison built already, e.g. in
        its float64 check), and pair the inputs with torch's."""

    @abc.abstractmethod
    def variable_tree(self) -> VariableTree:
        """Its variables, as the converter's tree (what the weights fill: the ``required`` ones)."""

    def rounded_tables(self) -> list[Island]:
        """Its float64 variables that the weights do not fill and whose values are all float32-rounded: tables
        built in float32 at construction (a rotary table), which a float64 comparison cannot lift."""
        tree, islands = self.variable_tree(), []
        for path, (_, dtype, required) in tree.variables().items():
            if required or not jnp.issubdtype(dtype, jnp.float64):  # PRNG keys and integers are not tables
                continue
            try:
                values = tree.read(path)
            except (TypeError, ValueError):  # an abstract variable (nnx.eval_shape): no values to judge
                continue
            if float32_rounded(values):
                module, _, leaf = path.rpartition(".")
                what = f"variable {leaf} holds float32-rounded values (built in float32): build the port in float64"
                islands.append(Island("flax", module or WHOLE_MODEL, what, lifted=False))
        return islands

    # ---- running

    @abc.abstractmethod
    def parts(self) -> Parts:
        """Its split for differentiation."""

    def ties(self) -> dict[str, Tie]:
        """The ties of torch's weights and the flax variables their keys fill (``report.ties``): the plan's."""
        return {} if self.plan is None else dict(self.plan.ties)

    def torch_gradients(self, parts: Parts, param_grads: Any, rest: Any) -> dict[str, Any]:
        """Parameter gradients (shaped like ``parts.params``) under torch's names: through the plan, tied copies
        summed, each through its inverse layout (a variable shared in two places counts once)."""
        assert self.plan is not None  # a kind without a plan names them itself
        return self.plan.torch_gradients({k: np.asarray(v) for k, v in parts.flat(param_grads).items()})

    @abc.abstractmethod
    def param_tangents(self, state_dict: Mapping[str, np.ndarray]) -> Any:
        """The tangents (a torch-named ``state_dict``) of its parameters, shaped like ``parts().params``: into the
        flax layout the way its weights went (the converter's rules, or the plan)."""

    @abc.abstractmethod
    def float64(self) -> FlaxSide:
        """A copy computing in float64 with the same weights (its variables cast, compute dtypes set to float64;
        call under x64); :meth:`float64_values` casts the inputs."""

    def values(self, side: TorchSide, call: Call, mesh=None) -> tuple[dict[str, np.ndarray], dict[str, str], Any]:
        """The flax side's values under the keys of ``side.expected`` (input gradients back in torch's axis
        order), its dropped outputs, and the sharding record when it ran on ``mesh``."""
        names = side.input_names
        if side.mode == "jvp":
            tangents = dict(side.tangents)
            for i, order in enumerate(self.orders):  # input tangents into the flax layout
                key = f"tangent {names[i]}"
                if key in tangents:
                    tangents[key] = np.transpose(tangents[key], order)
            state = _tangent_state_dict(side, tangents, self.plan, self.buffers_as_values)
            param_tangents = self.param_tangents(state)
            return _run_flax_jvp(self.parts(), self.inputs, call, side, tangents, param_tangents, mesh)
        outputs, dropped, value, grads, sharding = _run_flax(self, self.parts(), call, side, mesh)
        for i, order in enumerate(self.orders):
            key = f"grad {names[i]}"
            if key in grads:
                grads[key] = np.transpose(grads[key], np.argsort(order))
        return {**outputs, **({"loss": value} if call.loss is not None else {}), **grads}, dropped, sharding

    def float64_values(self, side: TorchSide, call: Call) -> dict[str, np.ndarray]:
        """:meth:`values` of the :meth:`float64` copy (same weights), for attribution; call under x64."""
        twin_side = dataclasses.replace(
            side,
            cotangents=_float64(side.cotangents),
            tangents=_float64(side.tangents),
            state_dict=_float64(side.state_dict),
        )
        inputs = tuple(x.astype(np.float64) if is_float(x) else x for x in self.inputs)
        return dataclasses.replace(self.float64(), inputs=inputs).values(twin_side, call)[0]

    # ---- its module tree: pairing, recording, isolation (not called when localization_note is set)

    def eager_model(self) -> Any:
        """What the flax forward receives as its first argument in an eager run over the filled variables."""
        raise NotImplementedError(f"{type(self).__name__} has no module tree")

    def record(self, forward: Callable[[], Any]) -> Records:
        """Run ``forward()`` (one eager forward of :meth:`eager_model`) with every submodule's (floating inputs,
        outputs) recorded by dotted flax path (:data:`~flax_ln.parity.records.capture.WHOLE_MODEL` for the root), in
        execution order."""
        raise NotImplementedError(f"{type(self).__name__} has no module tree")

    def recorded_calls(self) -> Mapping[str, PortCall]:
        """After :meth:`record`: each recorded submodule call whole, by call name (``{}`` where the kind keeps none)."""
        return {}

    def record_nudged(self, forward_of: Callable[[Any], Any]) -> Mapping[str, PortCall]:
        """The submodule calls of one more eager forward, ``forward_of(model)``, of a copy whose floating parameters
        are :func:`~flax_ln.parity.records.replay.nudged` (the caller nudges the inputs), by call name: what tells a
        call's activations from its constants (:func:`~flax_ln.parity.records.replay.constant_arguments`). ``{}``
        where the kind cannot (every floating argument is then taken for an activation)."""
        return {}

    def unrecorded(self) -> dict[str, str]:
        """After :meth:`record`: the flax paths of the modules that ran but were not recorded (called only inside a
        trace: a scan or vmap over layers), each with the reason."""
        return {}

    def module_paths(self, groups: ParameterGroups, recorded: Records) -> dict[str, Any]:
        """``{dotted flax path: handle}`` of its submodules (the handle :class:`Pairs` keeps), given the
        :meth:`parameter_groups` (``{}`` without a plan) and the :meth:`record`."""
        raise NotImplementedError(f"{type(self).__name__} has no module tree")

    def method_calls(self) -> dict[str, str]:
        """Each recorded call through a module's other method (``embed_tokens.attend``, named so by
        :func:`~flax_ln.parity.records.replay.call_names`) -> that module's path: a candidate wherever the module is."""
        return {}

    def type_layout(self, handle: Any) -> Permute | None:
        """How the activations of the module behind ``handle`` are laid out against torch's by its type alone
        (channels-last convolutions); ``None``: not known from its type."""
        return None

    def mirrored_paths(self) -> dict[str, str]:
        """torch path -> flax path of every submodule of a tree that mirrors torch's (no key map)."""
        raise NotImplementedError(f"{type(self).__name__} loads through a key map only")

    def parameter_groups(self, filled: set[str], recorded: Records) -> ParameterGroups:
        """The ``filled`` variables (the plan's) each submodule holds -> the submodules' path steps."""
        raise NotImplementedError(f"{type(self).__name__} has no module tree")

    def run_alone(
        self,
        pairs: Pairs,
        torch_records: Records,
        torch_calls: Calls | None,
        flax_records: Records,
        forward: Callable[[], Any],
    ) -> Iterator[tuple[str, Run]]:
        """Each paired submodule run alone on its torch twin's recorded inputs (``torch_calls``: every torch
        call whole, when :attr:`isolates_from_calls`; ``flax_records``: its own recorded call, by torch path;
        ``forward``: the eager forward): ``(torch path, its floating outputs or why it was not run)``, in the
        order the report lists them."""
        raise NotImplementedError(f"{type(self).__name__} has no module tree")
