"""The flax side as an ``nnx.Module``: :class:`NNXSide`, and the recording of its submodules' calls
(:func:`capture_nnx`). Imports no torch.

Recording patches nothing. For the duration of one call, a profile function
(:func:`sys.setprofile`, this thread only) watches for frames of the methods that the
model's own module classes define, and records a frame only when its ``self`` is one of
this model's submodules. Another instance of the same class, or flax's own
``nnx.Linear`` used elsewhere, runs exactly as before; no class, instance or method is
changed; the previous profile function is restored on exit, also when the call raises.

For each submodule the outermost call of any of its methods is recorded (``__call__``,
or e.g. GPT's ``attend`` when its parent calls that directly); a method it calls on
itself is part of that call. The first completed call with a floating output is kept.

Rematerialisation is transparent while recording (:func:`~flax_ln.parity.records.replay.transparent_remat`, as for
Linen): a block under ``nnx.remat`` or ``jax.checkpoint`` runs eagerly, on the copy of the module that NNX's
lifted transform merges, which holds the same arrays as the model's own module: the copy is recorded under that
module's path. A module called inside a trace that stays (``nnx.scan``/``nnx.vmap`` over stacked layers, a
``jax.checkpoint`` applied when its class was defined) holds no values: it is not recorded, and its path comes
back with the reason (``unrecorded``).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from flax_ln.convert import KeyMap, KeyPlan, Tie, fill_tree, rules
from flax_ln.convert.assign import is_floating
from flax_ln.convert.layouts import Permute
from flax_ln.convert.trees import NNXTree, value_dtype
from flax_ln.parity.core.call import is_float
from flax_ln.parity.core.policy import parameter_dtype
from flax_ln.parity.islands.island import Island
from flax_ln.parity.islands.jax import name_modules_of
from flax_ln.parity.islands.jax_internals import forget_traces
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records, Unsupported, floating_leaves
from flax_ln.parity.records.pairing import NO_HOLDER, Pairs, ParameterGroups
from flax_ln.parity.records.replay import (
    TRACED,
    PortCall,
    Replayed,
    call_names,
    method_name,
    replays,
    transparent_remat,
)
from flax_ln.parity.sides.flax import (
    FlaxSide,
    Parts,
    Run,
    as_float64,
    paired_inputs,
    require_differentiable,
    require_key_map,
    torch_ties,
    widens_to_float64,
    write_through,
)
from flax_ln.parity.sides.torch import TorchSide


def _method_codes(cls: type) -> set:
    """Code objects of the methods ``cls`` and its bases define below ``nnx.Module`` (no dunders but ``__call__``)."""
    codes = set()
    for owner in cls.__mro__:
        if owner in (nnx.Module, nnx.Pytree, object):
            break
        for name, attr in vars(owner).items():
            if name.startswith("__") and name != "__call__":
                continue
            fn = inspect.unwrap(attr) if callable(attr) else None
            code = getattr(fn, "__code__", None)
            if code is not None and code.co_argcount > 0:
                codes.add(code)
    return codes


def _bound_call(code, local: Mapping[str, Any]) -> tuple[str, list[Any], dict[str, Any]]:
    """The call a frame of ``code`` was made with, from its locals at entry: (method name, args, kwargs); the method
    by the name its module's class holds it under (:func:`~flax_ln.parity.records.replay.method_name`)."""
    names = code.co_varnames
    n_pos, n_kw = code.co_argcount, code.co_kwonlyargcount
    args = [local[n] for n in names[1:n_pos]]
    kwargs = {n: local[n] for n in names[n_pos : n_pos + n_kw]}
    at = n_pos + n_kw
    if code.co_flags & inspect.CO_VARARGS:
        args += list(local[names[at]])
        at += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local[names[at]])
    return method_name(type(local[names[0]]), code), args, kwargs


def _state_before(module: nnx.Module, args: list[Any], kwargs: dict[str, Any]) -> tuple | None:
    """A copy of ``(module, args, kwargs)`` as they are now: new variables over the same arrays (a call that then
    writes a cache, its own or one passed to it, or counts its RNG leaves the copy as it was), sharing kept; only
    the module where NNX cannot copy the arguments; ``None`` where it cannot copy the module either."""
    try:
        return nnx.clone((module, args, kwargs))
    except Exception:  # noqa: BLE001 - arguments NNX cannot copy are replayed as they are
        pass
    try:
        return nnx.clone(module), args, kwargs
    except Exception:  # noqa: BLE001 - a module NNX cannot copy is replayed on its live state, as before
        return None


def _joined(prefix: str, rel: tuple) -> str:
    if prefix == WHOLE_MODEL:
        return ".".join(map(str, rel)) or WHOLE_MODEL
    return ".".join([prefix, *map(str, rel)])


def _arrays(module: nnx.Module) -> frozenset[int]:
    """The ids of the arrays ``module``'s variables (its submodules' too) hold."""
    return frozenset(id(n.get_value()) for _, n in nnx.iter_graph(module) if isinstance(n, nnx.Variable))


def _shape(module: nnx.Module) -> tuple:
    """``module``'s submodules: (relative path, type), in order."""
    return tuple((tuple(map(str, p)), type(m)) for p, m in nnx.iter_modules(module))


def _holds_tracer(tree: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Module))
    return any(isinstance(x, jax.core.Tracer) for x in leaves)


def _module_tracers(module: nnx.Module) -> bool:
    return any(
        isinstance(n, nnx.Variable) and isinstance(n.get_value(), jax.core.Tracer) for _, n in nnx.iter_graph(module)
    )


class _Copies:
    """The model's modules by id, and the copies NNX's lifted transforms merge of them (``nnx.remat``,
    ``nnx.scan``), mapped to the module they copy: by the arrays they hold (the same arrays: an eager copy, whose
    values are the model's), else, for a copy holding tracers only (its calls are not recorded, only named), by
    its type and submodules where one module of the model has them."""

    def __init__(self, model: nnx.Module):
        found = list(nnx.iter_modules(model))
        self.modules = {id(m): m for _, m in found}
        self.paths = {id(m): ".".join(map(str, p)) or WHOLE_MODEL for p, m in found}
        self.by_arrays: dict[tuple, str | None] = {}
        self.by_shape: dict[tuple, str | None] = {}
        for p, m in found:
            path = ".".join(map(str, p)) or WHOLE_MODEL
            arrays = (type(m), _arrays(m))
            if arrays[1]:
                self.by_arrays[arrays] = None if arrays in self.by_arrays else path  # None: ambiguous
            shape = _shape(m)
            self.by_shape[shape] = None if shape in self.by_shape else path
        self.kept: list[nnx.Module] = []  # the mapped copies, alive while recording: their ids stay theirs

    def owner(self, obj: Any) -> tuple[int | None, bool]:
        """(id under which ``obj``'s path is known, or ``None``; whether it is a copy holding tracers)."""
        if id(obj) in self.paths:
            return id(obj), False
        if not isinstance(obj, nnx.Module):
            return None, False
        traced = _module_tracers(obj)
        path = self.by_arrays.get((type(obj), _arrays(obj))) if not traced else self.by_shape.get(_shape(obj))
        if path is None:
            return None, traced
        for rel, sub in nnx.iter_modules(obj):
            self.paths[id(sub)], self.modules[id(sub)] = _joined(path, rel), sub
            self.kept.append(sub)
        return id(obj), traced


def capture_nnx(
    model: nnx.Module,
    call: Callable[[], Any],
    calls: dict[str, PortCall] | None = None,
    unrecorded: dict[str, str] | None = None,
) -> Records:
    """Run ``call`` eagerly with the (inputs, outputs) of every submodule of ``model`` recorded by call name.

    Dict order is execution order (a call is recorded when it returns). Only ``model``'s own submodule instances
    are recorded; see the module docstring. Each method through which a module is called is a call of its own,
    named by :func:`~flax_ln.parity.records.replay.call_names` (``__call__`` by the module's path, ``attend`` after a
    lookup by ``path.attend``). With ``calls``, each recorded call is also kept there whole
    (:class:`~flax_ln.parity.records.replay.PortCall`: the method, its arguments as the port passed them, its place
    among the calls, and the module as it was just before it), so that isolation can make it again. ``nnx.remat`` and
    ``jax.checkpoint`` are transparent meanwhile; with ``unrecorded``, the path of each module called only inside
    a trace (``nnx.scan``, ``vmap``) is kept there with the reason.
    """
    copies = _Copies(model)
    modules, paths = copies.modules, copies.paths
    traced_paths: dict[str, str] = {}
    traced_types: set[type] = set()
    codes = set().union(*(_method_codes(type(m)) for _, m in nnx.iter_modules(model)))
    kept: dict[tuple[str, str], tuple[list[np.ndarray], list[np.ndarray]]] = {}  # (path, method) -> record
    own: dict[tuple[str, str], PortCall] = {}
    open_calls: dict[int, tuple[int, list[np.ndarray], PortCall]] = {}  # id(frame) -> (id(module), inputs, call)
    active: set[int] = set()  # modules with a recorded call in progress
    clock = itertools.count()  # entries and returns of recorded calls, in order

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            local = frame.f_locals
            code = frame.f_code
            owner, traced = copies.owner(local.get(code.co_varnames[0]))
            if owner is None and traced:
                traced_types.add(type(local.get(code.co_varnames[0])))  # a copy of which of its modules: not known
            elif owner is not None and (traced or _holds_tracer([local.get(n) for n in code.co_varnames[1:]])):
                traced_paths.setdefault(paths[owner], TRACED)  # inside a trace: no values to record
            elif owner is not None and owner not in active:
                n_args = (
                    code.co_argcount
                    + code.co_kwonlyargcount
                    + bool(code.co_flags & inspect.CO_VARARGS)
                    + bool(code.co_flags & inspect.CO_VARKEYWORDS)
                )
                args = [local[name] for name in code.co_varnames[1:n_args] if name in local]
                active.add(owner)
                method, f_args, f_kwargs = _bound_call(code, local)
                state = None
                if calls is not None and (paths[owner], method) not in kept:
                    state = _state_before(modules[owner], f_args, f_kwargs)
                positional = tuple(code.co_varnames[1 : code.co_argcount])
                port_call = PortCall(method, f_args, f_kwargs, positional, next(clock), state=state)
                open_calls[id(frame)] = (owner, floating_leaves(args), port_call)
        elif event == "return" and id(frame) in open_calls:
            owner, inputs, port_call = open_calls.pop(id(frame))
            active.discard(owner)
            port_call.end = next(clock)
            outputs = floating_leaves(arg)  # arg is None when the frame exits by an exception
            key = (paths[owner], port_call.method)
            if outputs and key not in kept:
                kept[key] = (inputs, outputs)
                own[key] = port_call
        if previous is not None:
            previous(frame, event, arg)

    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        with transparent_remat():
            forget_traces()  # a jax.checkpoint applied once is traced again: its modules are seen, and named
            call()
    finally:
        sys.setprofile(previous)
    if unrecorded is not None:
        recorded = {path for path, _ in kept}
        for p, m in nnx.iter_modules(model):  # modules of a type seen traced, as copies that could not be told apart
            if type(m) in traced_types and callable(m):
                traced_paths.setdefault(".".join(map(str, p)) or WHOLE_MODEL, TRACED)
        unrecorded.update({p: why for p, why in traced_paths.items() if p not in recorded})
    names = call_names(sorted(own, key=lambda key: own[key].start))
    if calls is not None:
        calls.update({names[key]: port_call for key, port_call in own.items()})
    return {names[key]: record for key, record in kept.items()}


def _check_flax_params(model: nnx.Module, dtype: str) -> None:
    want = np.dtype(parameter_dtype(dtype))
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and jnp.issubdtype(have := value_dtype(node), jnp.floating) and have != want:
            hint = " under jax.enable_x64(True)" if want == np.float64 else ""
            raise ValueError(
                f"compare_modules(dtype={dtype!r}): flax parameter {'.'.join(map(str, path))!r} holds {have} "
                f"values, expected {want}: build the flax module with param_dtype=jnp.{want}{hint}"
            )


def _floating_param_dtypes(model: nnx.Module) -> set[np.dtype]:
    return {
        have
        for _, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Param) and jnp.issubdtype(have := value_dtype(node), jnp.floating)
    }


def _float64_twin(model: nnx.Module, *, compute_dtypes: bool = True) -> nnx.Module:
    """A copy of ``model`` with every floating parameter and buffer in float64 (a variable's ``dtype`` metadata
    follows its value) and, with ``compute_dtypes``, every module's compute ``dtype`` set to float64 (call under
    x64). Without it a port's own float32 compute dtypes stay: its float32 islands, which lifting (or
    ``islands="keep"``) decides about."""
    twin = nnx.clone(model)
    graphdef, state = nnx.split(twin)
    state = as_float64(state)
    twin = nnx.merge(graphdef, state)
    for _, node in nnx.iter_graph(twin):
        if isinstance(node, nnx.Variable) and node.has_metadata("dtype") and is_floating(value_dtype(node)):
            node.set_metadata("dtype", value_dtype(node))
    for _, module in nnx.iter_modules(twin):
        for attr in ("dtype", "param_dtype") if compute_dtypes else ("param_dtype",):
            value = getattr(module, attr, None)
            if value is not None and jnp.issubdtype(value, jnp.floating):
                object.__setattr__(module, attr, jnp.float64)
    return twin


def _float32_constants(model: nnx.Module) -> list[Island]:
    """The float32 arrays ``model`` holds outside its variables (``nnx.data(jnp.array(..., jnp.float32))``, a
    plain array attribute): built before the comparison, so already rounded; a float64 run holds them widened."""
    islands = []
    for path, value in nnx.to_flat_state(nnx.state(model)):
        dtype = getattr(value, "dtype", None)
        if not isinstance(value, nnx.Variable) and isinstance(dtype, np.dtype) and dtype == np.float32:
            module, leaf = ".".join(map(str, path[:-1])) or WHOLE_MODEL, str(path[-1])
            what = (
                f"a float32 constant {tuple(np.shape(value))} built before the comparison: its value is already "
                f"rounded (attribute {leaf}; build the port under lifting: flax_factory=)"
            )
            islands.append(Island("flax", module, what, lifted=False))
    return islands


def _nnx_flat(state) -> dict[str, Any]:
    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(state)}


def _canonical_variables(root: nnx.Module) -> dict[int, str]:
    """id(variable) -> its canonical dotted path (the first path that reaches it, as ``nnx.state`` names it)."""
    names: dict[int, str] = {}
    for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Variable):
            names.setdefault(id(node), ".".join(map(str, path)))
    return names


def _in_rule_layout(module, value):
    """A recorded torch argument for the mirrored flax ``module``: floating arrays in its rule's activation layout,
    other arrays as they are, plain values unchanged."""
    if isinstance(value, np.ndarray):
        return jnp.asarray(rules.flax_activation(module, value) if is_float(value) else value)
    if isinstance(value, (tuple, list)):
        return type(value)(_in_rule_layout(module, v) for v in value)
    return value


@dataclasses.dataclass
class NNXSide(FlaxSide):
    """The flax side as an NNX module, loaded with a :class:`TorchSide`'s weights.

    ``module`` is the caller's (its weights are replaced in place by the strict converter, or through the key
    map); ``model`` an eval-mode copy, which is what runs (the caller's module keeps its mode).
    """

    module: nnx.Module
    model: nnx.Module
    own_calls: dict[str, PortCall] = dataclasses.field(default_factory=dict)  # by flax call name, from record()
    aliases: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # torch's ties, by the rules
    constants: list[Island] = dataclasses.field(default_factory=list)  # float32 arrays held outside variables
    traced: dict[str, str] = dataclasses.field(default_factory=dict)  # paths not recorded, and why, from record()

    needs_key_map: ClassVar[bool] = False
    buffers_as_values: ClassVar[bool] = True  # the converter checks the buffers flax recomputes against their values
    isolates_from_calls: ClassVar[bool] = True
    paths_named: ClassVar[str] = "as nnx.iter_modules"

    @classmethod
    def takes(cls, flax_module: Any) -> bool:
        """An ``nnx.Module``; a bare Linen module too, for :meth:`check` to name the wrapper it needs."""
        return isinstance(flax_module, (nnx.Module, linen.Module))

    @classmethod
    def check(cls, flax_module: Any, weights: KeyMap | None, mesh) -> None:
        """A Linen module passed as it is names :class:`~flax_ln.parity.sides.flax.Linen`."""
        if isinstance(flax_module, linen.Module):
            raise TypeError(
                f"{type(flax_module).__name__} is a Linen module: pass flax_ln.parity.Linen(module, variables, "
                "method=None) with weights=KeyMap(...)"
            )
        fix = "Hold it in an nnx.Variable that is not an nnx.Param (e.g. nnx.Variable(...)), so that it is state"
        require_differentiable(nnx.state(flax_module, nnx.Param), "nnx.Param", fix)

    @classmethod
    def load(
        cls,
        flax_module: nnx.Module,
        side: TorchSide,
        flax_inputs: Sequence[np.ndarray] | None,
        weights: KeyMap | None = None,
        plan: KeyPlan | None = None,
    ) -> NNXSide:
        """Check the flax parameters' dtype, load the torch weights into the caller's module (through ``weights``,
        a key map, when given; else the converter's rules), and pair each input with torch's."""
        inputs, orders = paired_inputs(side, flax_inputs)
        constants = _float32_constants(flax_module) if side.dtype == "float64" else []
        if side.dtype == "float64" and widens_to_float64(_floating_param_dtypes(flax_module)):
            flax_module = _float64_twin(flax_module, compute_dtypes=False)  # a copy: the caller's port is unchanged
        _check_flax_params(flax_module, side.dtype)
        aliases = torch_ties(side)
        if weights is None:
            plan = None
            rules.load_with_rules(flax_module, side.state_dict, ties=aliases)
        else:
            key_map = require_key_map(weights)
            plan = fill_tree(NNXTree(flax_module), side.state_dict, key_map, ties=torch_ties(side), plan=plan)
        model = nnx.clone(flax_module)
        model.eval()
        return cls(inputs, orders, plan, flax_module, model, aliases=aliases, constants=constants)

    def variable_tree(self) -> NNXTree:
        return NNXTree(self.model)

    def ties(self) -> dict[str, Tie]:
        """Through the rules without a key map, as a plan lists them."""
        return rules.rule_ties(self.model, self.aliases) if self.plan is None else super().ties()

    def parts(self) -> Parts:
        graphdef, params, rest = nnx.split(self.model, nnx.Param, ...)  # type: ignore[misc]  # nnx.split's result is typed as a variadic tuple
        return Parts(lambda p, r: name_modules_of(nnx.merge(graphdef, p, r, copy=True)), params, rest, _nnx_flat)

    def torch_gradients(self, parts: Parts, param_grads: Any, rest: Any) -> dict[str, Any]:
        """Through the converter's rules without a key map (the module tree mirrors torch's; read-only views of the
        gradients' buffers, no copies), else the plan."""
        if self.plan is None:
            return rules.export_with_rules(parts.build(param_grads, rest), views=True)
        return super().torch_gradients(parts, param_grads, rest)

    def param_tangents(self, state_dict: Mapping[str, np.ndarray]) -> Any:
        holder = nnx.clone(self.model)
        if self.plan is None:
            rules.load_with_rules(holder, state_dict, ties=self.aliases)
        else:
            write_through(self.plan, NNXTree(holder), state_dict)
        return nnx.split(holder, nnx.Param, ...)[1]

    def float64(self) -> NNXSide:
        return dataclasses.replace(self, model=_float64_twin(self.model))

    # ---- its module tree

    def rounded_tables(self) -> list[Island]:
        """And the float32 arrays the port holds outside its variables (``nnx.data``, plain attributes)."""
        return [*super().rounded_tables(), *self.constants]

    def eager_model(self) -> nnx.Module:
        return name_modules_of(self.model)

    def record(self, forward: Callable[[], Any]) -> Records:
        """And each submodule's own call, kept whole for isolation."""
        self.own_calls, self.traced = {}, {}
        name_modules_of(self.model)
        return capture_nnx(self.model, forward, self.own_calls, self.traced)

    def unrecorded(self) -> dict[str, str]:
        return dict(self.traced)

    def module_paths(self, groups: ParameterGroups, recorded: Records) -> dict[str, Any]:
        """Every callable submodule (``nnx.iter_modules``; an ``nnx.List`` is a container), by attribute path."""
        found = {".".join(map(str, p)) or WHOLE_MODEL: m for p, m in nnx.iter_modules(self.model) if callable(m)}
        return {**found, **{name: found[owner] for name, owner in self.method_calls().items() if owner in found}}

    def method_calls(self) -> dict[str, str]:
        """Each recorded call through a module's second method (``embed_tokens.attend``) -> the module's path."""
        modules = {".".join(map(str, p)) or WHOLE_MODEL for p, _ in nnx.iter_modules(self.model)}
        return {name: name.rsplit(".", 1)[0] for name in self.own_calls if name not in modules}

    def type_layout(self, handle: Any) -> Permute | None:
        """The converter's activation layout for the module's type (channels-last ``nnx.Conv``)."""
        return rules.activation_layout(handle)

    def mirrored_paths(self) -> dict[str, str]:
        """A flax path mapped through the converter's registered renames
        (:func:`flax_ln.convert.rules.torch_module_paths`), else kept as it is."""
        torch_paths = rules.torch_module_paths(self.model)  # flax path -> torch path
        flax_paths = {}
        for p, _ in nnx.iter_modules(self.model):
            path = ".".join(map(str, p))
            flax_paths[torch_paths.get(path, path) or WHOLE_MODEL] = path or WHOLE_MODEL
        return flax_paths

    def parameter_groups(self, filled: set[str], recorded: Records) -> ParameterGroups:
        """The filled variables of each submodule (by canonical path: a shared variable is one) -> their paths."""
        canonical = _canonical_variables(self.model)
        flax_groups: ParameterGroups = {}
        for path, module in nnx.iter_modules(self.model):
            if not callable(module):  # a container (nnx.List, nnx.Dict) has no output to pair
                continue
            own = frozenset(
                canonical[id(node)]
                for _, node in nnx.iter_graph(module)
                if isinstance(node, nnx.Variable) and canonical.get(id(node)) in filled
            )
            if own:
                flax_groups.setdefault(own, []).append(tuple(map(str, path)))
        return flax_groups

    def run_alone(
        self,
        pairs: Pairs,
        torch_records: Records,
        torch_calls: Calls | None,
        flax_records: Records,
        forward: Callable[[], Any],
    ) -> Iterator[tuple[str, Run]]:
        """Each recorded torch call made again, eagerly, on the paired flax module: on the same arguments
        (floating arrays in the flax layout by :func:`flax_ln.convert.rules.flax_activation`; integer and boolean
        arrays and plain values as they are) for mirrored pairs; for pairs found by their parameters, the port's
        own recorded call of the module (the same method), with its floating arguments replaced by torch's values
        (:func:`~flax_ln.parity.records.replay.replay_arguments`: by provenance, else by correspondence), on copies of
        the module and of the arguments as they were just before that call (its caches and counters, and a cache passed
        to it, as the call found them; the model and the recorded call are not changed). A call with an argument
        that is not data (a callable, a module), or one the flax module does not accept, is not run: the reason
        comes back."""
        prepare = replays(pairs, torch_records, torch_calls, flax_records, self.own_calls)
        for path, (args, kwargs) in (torch_calls or {}).items():
            module = pairs.modules.get(path)
            t_outs = torch_records.get(path, ([], []))[1]
            unsupported = [v for v in [*args, *kwargs.values()] if isinstance(v, Unsupported)]
            if module is None:
                yield path, pairs.unpaired.get(path, NO_HOLDER if pairs.by_parameters else "no flax twin at this path")
                continue
            method, kept = "__call__", []
            if pairs.by_parameters:
                own = self.own_calls.get(pairs.flax_paths[path])
                if own is None:
                    yield path, "its flax twin was not called (with a floating output) in the flax run"
                    continue
                if own.state is not None:  # a fresh copy of the module and its arguments as the call found them
                    module, args_then, kwargs_then = nnx.clone(own.state)
                    own = dataclasses.replace(own, args=list(args_then), kwargs=dict(kwargs_then))
                prepared = prepare(path, own)
                if isinstance(prepared, str):
                    yield path, prepared
                    continue
                method, f_args, f_kwargs, kept = own.method, prepared.args, prepared.kwargs, prepared.kept
            elif unsupported:
                yield path, f"takes a {unsupported[0]} argument, which a record cannot hold"
                continue
            else:
                f_args = [_in_rule_layout(module, a) for a in args]
                f_kwargs = {k: _in_rule_layout(module, v) for k, v in kwargs.items()}
            if t_outs:
                try:
                    out = getattr(module, method)(*f_args, **f_kwargs)
                except Exception as err:  # noqa: BLE001 - any failure to call is reported as the reason it was skipped
                    yield path, f"the flax call on torch's arguments raised {type(err).__name__}: {str(err)[:120]}"
                    continue
                yield path, Replayed(floating_leaves(out), kept)
