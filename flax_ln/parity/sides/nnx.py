"""The flax side as an ``nnx.Module``: :class:`NNXSide`, over the recording of its submodules' calls
(:func:`~flax_ln.parity.sides.nnx_record.capture_nnx`). Imports no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

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
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records, Unsupported, floating_leaves
from flax_ln.parity.records.pairing import Pairs, ParameterGroups, layer_groups, layer_of
from flax_ln.parity.records.replay import (
    PortCall,
    Replayed,
    nudged,
    replays,
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
from flax_ln.parity.sides.nnx_record import capture_nnx, module_name
from flax_ln.parity.sides.torch import TorchSide


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
    if isinstance(value, dict):
        return type(value)({k: _in_rule_layout(module, v) for k, v in value.items()})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a record's dataclass of arrays
        fields = {f.name: _in_rule_layout(module, getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
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

    def recorded_calls(self) -> Mapping[str, PortCall]:
        return self.own_calls

    def record_nudged(self, forward_of: Callable[[Any], Any]) -> Mapping[str, PortCall]:
        """On a copy of the model with its ``nnx.Param`` values nudged (the model is not changed)."""
        graphdef, params, rest = nnx.split(self.model, nnx.Param, ...)  # type: ignore[misc]  # a variadic tuple
        model = name_modules_of(nnx.merge(graphdef, nudged(params), rest))
        calls: dict[str, PortCall] = {}
        capture_nnx(model, lambda: forward_of(model), calls)
        return calls

    def module_paths(self, groups: ParameterGroups, recorded: Records) -> dict[str, Any]:
        """Every callable submodule (``nnx.iter_modules``; an ``nnx.List`` is a container), by attribute path."""
        found = {".".join(map(str, p)) or WHOLE_MODEL: m for p, m in nnx.iter_modules(self.model) if callable(m)}
        layers = {n: c.state[0] for n, c in self.own_calls.items() if n not in found and "[" in n and c.state}
        methods = {name: found[owner] for name, owner in self.method_calls().items() if owner in found}
        return {**found, **layers, **methods}

    def method_calls(self) -> dict[str, str]:
        """Each recorded call through a module's second method (``embed_tokens.attend``) -> the module's path."""
        modules = {".".join(map(str, p)) or WHOLE_MODEL for p, _ in nnx.iter_modules(self.model)}
        return {
            name: name.rsplit(".", 1)[0]
            for name, call in self.own_calls.items()
            if name not in modules and name.endswith("." + call.method)
        }

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
        for name in self.own_calls:  # the recorded layers of stacked blocks: torch's layer k
            base, layers = layer_of(name)
            torch_path = rules.torch_layer_path(self.model, base, layers[0]) if len(layers) == 1 else None
            if torch_path is not None and name == module_name(name, self.own_calls[name].method):
                flax_paths[torch_path] = name
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
        for own, paths in layer_groups(filled, recorded).items():  # the recorded layers of scanned stacks
            flax_groups.setdefault(own, []).extend(paths)
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
                yield path, pairs.why_unpaired(path)
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
