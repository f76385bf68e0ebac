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
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from flax_ln.convert import KeyMap, KeyPlan, fill_tree, load_torch_state_dict, rules, to_torch_state_dict
from flax_ln.convert.trees import NNXTree
from flax_ln.parity.call import is_float
from flax_ln.parity.capture import WHOLE_MODEL, Calls, Records, Unsupported, floating_leaves
from flax_ln.parity.flax_side import (
    FlaxSide,
    Parts,
    Run,
    as_float64,
    paired_inputs,
    require_differentiable,
    require_key_map,
    torch_ties,
    write_through,
)
from flax_ln.parity.pairing import NO_HOLDER, Pairs, ParameterGroups
from flax_ln.parity.policy import parameter_dtype
from flax_ln.parity.torch_side import TorchSide


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


def capture_nnx(model: nnx.Module, call: Callable[[], Any]) -> Records:
    """Run ``call`` eagerly with the (inputs, outputs) of every submodule of ``model`` recorded by path.

    Dict order is execution order (a module is recorded when its outermost call returns).
    Only ``model``'s own submodule instances are recorded; see the module docstring.
    """
    paths = {id(m): ".".join(map(str, p)) or WHOLE_MODEL for p, m in nnx.iter_modules(model)}
    codes = set().union(*(_method_codes(type(m)) for _, m in nnx.iter_modules(model)))
    records: Records = {}
    open_calls: dict[int, tuple[int, list[np.ndarray]]] = {}  # id(frame) -> (id(module), inputs)
    active: set[int] = set()  # modules with a recorded call in progress

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            local = frame.f_locals
            code = frame.f_code
            owner = id(local.get(code.co_varnames[0]))
            if owner in paths and owner not in active:
                n_args = (
                    code.co_argcount
                    + code.co_kwonlyargcount
                    + bool(code.co_flags & inspect.CO_VARARGS)
                    + bool(code.co_flags & inspect.CO_VARKEYWORDS)
                )
                args = [local[name] for name in code.co_varnames[1:n_args] if name in local]
                active.add(owner)
                open_calls[id(frame)] = (owner, floating_leaves(args))
        elif event == "return" and id(frame) in open_calls:
            owner, inputs = open_calls.pop(id(frame))
            active.discard(owner)
            outputs = floating_leaves(arg)  # arg is None when the frame exits by an exception
            if outputs:
                records.setdefault(paths[owner], (inputs, outputs))
        if previous is not None:
            previous(frame, event, arg)

    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return records


def _check_flax_params(model: nnx.Module, dtype: str) -> None:
    want = np.dtype(parameter_dtype(dtype))
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and jnp.issubdtype(node.dtype, jnp.floating) and np.dtype(node.dtype) != want:
            hint = " under jax.enable_x64(True)" if want == np.float64 else ""
            raise ValueError(
                f"compare_modules(dtype={dtype!r}): flax parameter {'.'.join(map(str, path))!r} is {node.dtype}, "
                f"expected {want}: build the flax module with param_dtype=jnp.{want}{hint}"
            )


def _floating_param_dtypes(model: nnx.Module) -> set[np.dtype]:
    return {
        np.dtype(node.dtype)
        for _, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Param) and jnp.issubdtype(node.dtype, jnp.floating)
    }


def _float64_twin(model: nnx.Module, *, compute_dtypes: bool = True) -> nnx.Module:
    """A copy of ``model`` with every floating parameter and buffer in float64 and, with ``compute_dtypes``,
    every module's compute ``dtype`` set to float64 (call under x64). Without it a port's own float32 compute
    dtypes stay: its float32 islands, which lifting (or ``islands="keep"``) decides about."""
    twin = nnx.clone(model)
    graphdef, state = nnx.split(twin)
    state = as_float64(state)
    twin = nnx.merge(graphdef, state)
    for _, module in nnx.iter_modules(twin):
        for attr in ("dtype", "param_dtype") if compute_dtypes else ("param_dtype",):
            value = getattr(module, attr, None)
            if value is not None and jnp.issubdtype(value, jnp.floating):
                object.__setattr__(module, attr, jnp.float64)
    return twin


def _nnx_flat(state) -> dict[str, Any]:
    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(state)}


def _canonical_variables(root: nnx.Module) -> dict[int, str]:
    """id(variable) -> its canonical dotted path (the first path that reaches it, as ``nnx.state`` names it)."""
    names: dict[int, str] = {}
    for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Variable):
            names.setdefault(id(node), ".".join(map(str, path)))
    return names


def _positional_count(module) -> int | None:
    """How many positional arrays ``module``'s call needs (its positional parameters without defaults);
    ``None`` when it takes any number."""
    try:
        params = inspect.signature(module.__call__).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in params)


def _call_from_arrays(pairs: Pairs, path: str, module, args, kwargs, flax_record) -> tuple[list, dict] | str:
    """The arguments for the port's module (paired by its parameters) from torch's recorded call, or why there
    are none.

    torch's recorded arrays (positional ones; keyword ones, in call order, when it passed none
    positionally), as many as the module's signature needs; floating ones in its layout (the
    pair's own, the module type's, or the unique permutation onto the shape the port's module
    took in the full run). Torch's keyword arguments are torch's names and are not passed.
    """
    arrays = [a for a in args if isinstance(a, np.ndarray)] or [v for v in kwargs.values() if isinstance(v, np.ndarray)]
    need = _positional_count(module)
    need = len(arrays) if need is None else need
    if len(arrays) < need:
        return f"its call takes {need} positional arrays; torch's call has {len(arrays)}"
    flax_shapes = [np.shape(x) for x in (flax_record[0] if flax_record is not None else [])]
    out, j = [], 0
    for a in arrays[:need]:
        if is_float(a):
            moved = pairs.to_flax(path, a, flax_shapes[j] if j < len(flax_shapes) else None)
            if isinstance(moved, str):
                return f"input {j}: {moved}"
            out.append(jnp.asarray(moved))
            j += 1
        else:
            out.append(jnp.asarray(a))
    return out, {}


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

    needs_key_map: ClassVar[bool] = False
    buffers_as_values: ClassVar[bool] = True  # the converter checks the buffers flax recomputes against their values
    isolates_from_calls: ClassVar[bool] = True
    paths_named: ClassVar[str] = "as nnx.iter_modules"

    @classmethod
    def takes(cls, flax_module: Any) -> bool:
        """Any flax side not of another kind is taken as an NNX module (its load says what is wrong with it)."""
        return True

    @classmethod
    def check(cls, flax_module: Any, weights: KeyMap | None, mesh) -> None:
        """A Linen module passed as it is names :class:`~flax_ln.parity.flax_side.Linen`."""
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
        if side.dtype == "float64" and _floating_param_dtypes(flax_module) == {np.dtype(np.float32)}:
            flax_module = _float64_twin(flax_module, compute_dtypes=False)  # a copy: the caller's port is unchanged
        _check_flax_params(flax_module, side.dtype)
        if weights is None:
            plan = None
            load_torch_state_dict(flax_module, side.state_dict)
        else:
            key_map = require_key_map(weights)
            plan = fill_tree(NNXTree(flax_module), side.state_dict, key_map, ties=torch_ties(side), plan=plan)
        model = nnx.clone(flax_module)
        model.eval()
        return cls(inputs, orders, plan, flax_module, model)

    def variable_tree(self) -> NNXTree:
        return NNXTree(self.model)

    def parts(self) -> Parts:
        graphdef, params, rest = nnx.split(self.model, nnx.Param, ...)  # type: ignore[misc]  # nnx.split's result is typed as a variadic tuple
        return Parts(functools.partial(nnx.merge, graphdef), params, rest, _nnx_flat)

    def torch_gradients(self, parts: Parts, param_grads: Any, rest: Any) -> dict[str, Any]:
        """Through the converter's rules without a key map (the module tree mirrors torch's), else the plan."""
        if self.plan is None:
            return to_torch_state_dict(parts.build(param_grads, rest))
        return super().torch_gradients(parts, param_grads, rest)

    def param_tangents(self, state_dict: Mapping[str, np.ndarray]) -> Any:
        holder = nnx.clone(self.model)
        if self.plan is None:
            load_torch_state_dict(holder, state_dict)
        else:
            write_through(self.plan, NNXTree(holder), state_dict)
        return nnx.split(holder, nnx.Param, ...)[1]

    def float64(self) -> NNXSide:
        return dataclasses.replace(self, model=_float64_twin(self.model))

    # ---- its module tree

    def eager_model(self) -> nnx.Module:
        return self.model

    def record(self, forward: Callable[[], Any]) -> Records:
        return capture_nnx(self.model, forward)

    def module_paths(self, groups: ParameterGroups, recorded: Records) -> dict[str, Any]:
        """Every submodule (``nnx.iter_modules``), by its attribute path."""
        return {".".join(map(str, p)) or WHOLE_MODEL: m for p, m in nnx.iter_modules(self.model)}

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
        arrays and plain values as they are) for mirrored pairs, on torch's arrays only (see
        :func:`_call_from_arrays`) for pairs found by their parameters. A call with an argument that is not data
        (a callable, a module), or one the flax module does not accept, is not run: the reason comes back."""
        for path, (args, kwargs) in (torch_calls or {}).items():
            module = pairs.modules.get(path)
            t_outs = torch_records.get(path, ([], []))[1]
            unsupported = [v for v in [*args, *kwargs.values()] if isinstance(v, Unsupported)]
            if module is None:
                yield path, NO_HOLDER if pairs.by_parameters else "no flax twin at this path"
                continue
            if pairs.by_parameters:
                prepared = _call_from_arrays(pairs, path, module, args, kwargs, flax_records.get(path))
                if isinstance(prepared, str):
                    yield path, prepared
                    continue
                f_args, f_kwargs = prepared
            elif unsupported:
                yield path, f"takes a {unsupported[0]} argument, which a record cannot hold"
                continue
            else:
                f_args = [_in_rule_layout(module, a) for a in args]
                f_kwargs = {k: _in_rule_layout(module, v) for k, v in kwargs.items()}
            if t_outs:
                try:
                    out = module(*f_args, **f_kwargs)
                except Exception as err:  # noqa: BLE001 - any failure to call is reported as the reason it was skipped
                    yield path, f"the flax call on torch's arguments raised {type(err).__name__}: {str(err)[:120]}"
                    continue
                yield path, floating_leaves(out)
