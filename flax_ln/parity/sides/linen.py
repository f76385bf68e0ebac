"""The flax side as a Linen module with its variables: :class:`LinenSide`, for a
:class:`~flax_ln.parity.sides.flax.Linen`. Its submodules are scope paths, recorded (:func:`capture_linen`) and
run on torch's inputs during one ``apply`` each, through ``flax.linen.intercept_methods``. Imports no torch."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen

from flax_ln.convert import LinenTree, PytreeTree, rules
from flax_ln.convert.layouts import Permute
from flax_ln.convert.trees import path_step
from flax_ln.parity.records.capture import WHOLE_MODEL, Calls, Records, floating_leaves
from flax_ln.parity.records.pairing import Pairs, ParameterGroups, StackLayers, layer_groups
from flax_ln.parity.records.replay import (
    TRACED,
    PortCall,
    Replayed,
    call_names,
    function_code,
    method_name,
    nudged,
    replays,
    transparent_remat,
)
from flax_ln.parity.sides.flax import Linen, Parts, Run
from flax_ln.parity.sides.tree import TreeSide


def _scope_path(module) -> str:
    """A bound Linen module's scope path, dotted (:data:`WHOLE_MODEL` for the root)."""
    return ".".join(map(str, module.path)) or WHOLE_MODEL


def _positional(module, method: str) -> tuple[str, ...]:
    """The names of ``method``'s positional parameters (``self`` aside), for naming a kept argument."""
    try:
        params = inspect.signature(getattr(type(module), method)).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)[1:]


def _method(context) -> str:
    """The method an intercepted call is made through: by the name the module's class holds it under
    (:func:`~flax_ln.parity.records.replay.method_name`: an aliased ``__call__`` is ``__call__``)."""
    code = function_code(context.orig_method)
    return context.method_name if code is None else method_name(type(context.module), code)


def _traced(args, kwargs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs)))


class _Layers:
    """The names of a Linen apply's module calls, a scanned stack's layers told apart: a module whose variables
    (every collection's, as the call sees them) are one slice of the ``variables`` held at its scope path
    (``nn.scan`` over layers with ``variable_axes``, run eagerly under ``jax.disable_jit()``) is layer ``k`` of
    the stack (``layers[k]``; its submodules ``layers[k].attn``), ``k`` the slice its values equal, else the count
    of its layers so far. A traced call (``nn.scan`` traces its body once, abstractly, first) is no layer."""

    def __init__(self, variables: Any):
        self.variables = variables
        self.layers = StackLayers()

    def name(self, module, traced: bool) -> tuple[str, bool]:
        """The name of ``module``'s call now, and whether it enters a layer (then :meth:`leave` after it)."""
        path = _scope_path(module)
        if traced or self.variables is None:
            return self.layers.name(path, lambda: None)
        return self.layers.name(path, lambda: self._layer(path, module))

    def leave(self) -> None:
        """The end of a layer's call."""
        self.layers.leave()

    def _layer(self, path: str, module) -> int | None:
        """The layer ``module``'s call holds, where its variables are one slice of those held at ``path``."""
        steps = () if path == WHOLE_MODEL else tuple(path.split("."))
        try:
            seen = dict(module.variables)
            held = {c: functools.reduce(lambda t, k: t[k], steps, self.variables[c]) for c in seen}
        except (KeyError, TypeError, AttributeError):  # a collection the module made itself: no stack
            return None
        return self.layers.layer(path, jax.tree_util.tree_leaves(held), jax.tree_util.tree_leaves(seen))


def capture_linen(
    call: Callable[[], Any],
    types: dict[str, type] | None = None,
    calls: dict[str, PortCall] | None = None,
    traced: dict[str, str] | None = None,
    variables: Any = None,
    unwrapped: dict[str, str] | None = None,
) -> Records:
    """Run ``call`` (one or more Linen ``apply``, eagerly) with the (inputs, outputs) of every submodule call
    recorded by name, through ``flax.linen.intercept_methods``; ``nn.remat`` is transparent meanwhile
    (:func:`~flax_ln.parity.records.replay.transparent_remat`), so the calls inside a rematerialised block are recorded.

    As for NNX (:func:`~flax_ln.parity.sides.nnx_record.capture_nnx`): dict order is execution order, the outermost
    call of each of a module's methods is recorded (``setup`` aside) and named by
    :func:`~flax_ln.parity.records.replay.call_names`, its inputs are its floating arguments (positional, then keyword),
    the first completed call with a floating output is kept. A call traced inside a transform (an ``nn.scan``
    body) holds no values: it is not recorded, and with ``traced`` its path is kept there with the reason, unless
    the layers of that scan are recorded (given the apply's ``variables``, see :class:`_Layers`). With
    ``unwrapped``, the scope paths of the modules around a recorded call whose ``__call__`` flax never wrapped (so no
    interceptor sees it) are kept there, with why (:func:`unwrapped_call`). With
    ``types``, each recorded name's module class is kept there; with ``calls``, each recorded call whole
    (:class:`~flax_ln.parity.records.replay.PortCall`).
    """
    kept: dict[tuple[str, str], tuple[list[np.ndarray], list[np.ndarray]]] = {}
    own: dict[tuple[str, str], tuple[PortCall, type]] = {}
    active: set[str] = set()
    clock = itertools.count()
    layers = _Layers(variables)
    unrolled: set[str] = set()  # the scope paths whose layers were recorded

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        path, scoped = layers.name(context.module, _traced(args, kwargs))
        parent = context.module.parent
        while unwrapped is not None and isinstance(parent, linen.Module):
            why = unwrapped_call(parent)
            if why is not None:
                unwrapped.setdefault(_scope_path(parent), why)
            parent = parent.parent
        try:
            return record(next_fun, args, kwargs, context, path)
        finally:
            if scoped:
                layers.leave()
                unrolled.add(_scope_path(context.module))

    def record(next_fun, args, kwargs, context, path):
        if path in active:
            return next_fun(*args, **kwargs)
        if _traced(args, kwargs):
            if traced is not None:
                traced.setdefault(path, TRACED)
            return next_fun(*args, **kwargs)
        active.add(path)
        method = _method(context)
        port_call = PortCall(method, list(args), dict(kwargs), _positional(context.module, method), next(clock))
        try:
            out = next_fun(*args, **kwargs)
        finally:
            active.discard(path)
        port_call.end = next(clock)
        outputs = floating_leaves(out)
        if outputs and (path, method) not in kept:
            kept[(path, method)] = (floating_leaves(list(args)) + floating_leaves(dict(kwargs)), outputs)
            own[(path, method)] = (port_call, type(context.module))
        return out

    with linen.intercept_methods(interceptor), transparent_remat():
        call()
    if traced is not None:  # a scan's abstract first pass, where its layers were recorded after it
        for path in [p for p in traced if any(p == u or p.startswith(u + ".") for u in unrolled)]:
            del traced[path]
    names = call_names(sorted(own, key=lambda key: own[key][0].start))
    if types is not None:
        types.update({names[key]: cls for key, (_, cls) in own.items()})
    if calls is not None:
        calls.update({names[key]: port_call for key, (port_call, _) in own.items()})
    return {names[key]: record for key, record in kept.items()}


def unwrapped_call(module: linen.Module) -> str | None:
    """Why ``module``'s calls are not seen by ``flax.linen.intercept_methods``, when its class's ``__call__`` is a
    plain function set on the class after flax made it (``setattr(cls, "__call__", f)``: flax wraps the methods a
    class body defines, once, when the class is made), else ``None``."""
    call = next((vars(k)["__call__"] for k in type(module).__mro__ if "__call__" in vars(k)), None)
    if call is None or getattr(call, "method_handler_wrapped", False):
        return None
    return (
        f"not called during the flax apply as flax sees calls: {type(module).__name__}.__call__ is a plain function "
        "set on the class after flax made it (setattr(cls, '__call__', f)), which flax never wrapped, so no Linen "
        "interceptor sees its calls (its submodules' calls are seen); define __call__ in the class body, or in a "
        "subclass, to have it recorded and run alone"
    )


def _linen_run(module: linen.Module, variables, method):
    def run(*args, **kwargs):
        return module.apply(variables, *args, method=method, **kwargs)

    return run


def _named_leaves(tree: PytreeTree, prefix: tuple[str, ...], pytree) -> dict[str, Any]:
    """``{dotted path in tree: leaf}`` of ``pytree``, a subtree of ``tree``'s at key path ``prefix``."""
    flat = jax.tree_util.tree_flatten_with_path(pytree)[0]
    return {tree.name_of((*prefix, *(path_step(k) for k in path))): leaf for path, leaf in flat}


_CONVOLUTIONS = (linen.Conv, linen.ConvTranspose, linen.ConvLocal)  # channels-last, as nnx.Conv


@dataclasses.dataclass
class LinenSide(TreeSide):
    """The flax side as a :class:`~flax_ln.parity.sides.flax.Linen` module: gradients with respect to the
    ``params`` collection (the others are state); its submodules are the scope paths that hold its parameters
    or ran."""

    wrapper_type: ClassVar[type] = Linen
    tree_type: ClassVar[type[PytreeTree]] = LinenTree
    variable_noun: ClassVar[str] = "variable"
    paths_named: ClassVar[str] = "Linen scope paths"
    module_types: dict[str, type] = dataclasses.field(default_factory=dict)  # by call name, from record()
    port_calls: dict[str, PortCall] = dataclasses.field(default_factory=dict)  # by call name, from record()
    traced: dict[str, str] = dataclasses.field(default_factory=dict)  # scope paths not recorded, and why
    unwrapped: dict[str, str] = dataclasses.field(default_factory=dict)  # scope paths flax never wrapped, and why

    @classmethod
    def variables_of(cls, wrapper: Any) -> Any:
        return wrapper.variables

    def parts(self) -> Parts:
        variables = self.tree.tree()
        module, method = self.wrapper.module, self.wrapper.method
        rest = {k: v for k, v in variables.items() if k != "params"}
        return Parts(
            lambda params, rest: _linen_run(module, {"params": params, **rest}, method),
            variables.get("params", {}),
            rest,
            functools.partial(_named_leaves, self.tree, ("params",)),
        )

    def float64(self) -> LinenSide:
        """And the module's ``dtype`` and ``param_dtype`` set to float64 where they are floating."""
        module = self.wrapper.module
        attrs = {
            a: jnp.float64
            for a in ("dtype", "param_dtype")
            if getattr(module, a, None) is not None and jnp.issubdtype(getattr(module, a), jnp.floating)
        }
        wrapper = dataclasses.replace(self.wrapper, module=module.clone(**attrs) if attrs else module)
        return dataclasses.replace(self, tree=self.float64_tree(), wrapper=wrapper)

    # ---- its module tree

    def eager_model(self) -> Any:
        """``run`` over the filled variables."""
        parts = self.parts()
        return parts.build(parts.params, parts.rest)

    def record(self, forward: Callable[[], Any]) -> Records:
        """And each recorded scope path's module class (for :meth:`type_layout`)."""
        self.module_types, self.port_calls, self.traced, self.unwrapped = {}, {}, {}, {}
        return capture_linen(
            forward, self.module_types, self.port_calls, self.traced, self.tree.tree(), unwrapped=self.unwrapped
        )

    def recorded_calls(self) -> Mapping[str, PortCall]:
        return self.port_calls

    def record_nudged(self, forward_of: Callable[[Any], Any]) -> Mapping[str, PortCall]:
        """Over a copy of the ``params`` collection, nudged."""
        parts = self.parts()
        run = parts.build(nudged(parts.params), parts.rest)
        calls: dict[str, PortCall] = {}
        capture_linen(lambda: forward_of(run), None, calls)
        return calls

    def method_calls(self) -> dict[str, str]:
        """Each recorded call through a module's second method -> the module's scope path."""
        calls = self.port_calls.items()
        return {name: _module_path(name, call.method) for name, call in calls if name.endswith("." + call.method)}

    def type_layout(self, handle: Any) -> Permute | None:
        """Channels-last for a Linen convolution (the handle is its scope path)."""
        cls = self.module_types.get(handle)
        return rules.CHANNELS_LAST if cls is not None and issubclass(cls, _CONVOLUTIONS) else None

    def module_paths(self, groups: ParameterGroups, recorded: Records) -> dict[str, Any]:
        """The scope paths that hold parameters or ran; a handle is its path."""
        known = {".".join(p) or WHOLE_MODEL for ps in groups.values() for p in ps} | set(recorded)
        return {p: p for p in known}

    def parameter_groups(self, filled: set[str], recorded: Records) -> ParameterGroups:
        """The filled variables under each scope path (every prefix of a variable's scope, and every module that
        ran) -> the scope paths."""
        tree = self.tree
        assert isinstance(tree, LinenTree)  # tree_type
        scopes = {name: tree.scope(name) for name in filled}
        paths = {scope[:i] for scope in scopes.values() for i in range(len(scope) + 1)}
        paths |= {tuple(p.split(".")) if p != WHOLE_MODEL else () for p in recorded}
        groups: ParameterGroups = {}
        for path in sorted(paths):
            own = frozenset(name for name, scope in scopes.items() if scope[: len(path)] == path)
            if own:
                groups.setdefault(own, []).append(path)
        for own, layer_paths in layer_groups(filled, recorded).items():  # the recorded layers of scanned stacks
            groups.setdefault(own, []).extend(layer_paths)
        return groups

    def unrecorded(self) -> dict[str, str]:
        return dict(self.traced)

    def run_alone(
        self,
        pairs: Pairs,
        torch_records: Records,
        torch_calls: Calls | None,
        flax_records: Records,
        forward: Callable[[], Any],
    ) -> Iterator[tuple[str, Run]]:
        """The recorded call of each paired submodule intercepted (``flax.linen.intercept_methods``) and made again
        with torch's values in it (:func:`~flax_ln.parity.records.replay.replay_arguments`: the port's recorded
        arguments, its floating ones replaced by provenance or correspondence, the others exactly as recorded), its own
        submodules running as usual; its output is recorded and passed on. One eager ``apply`` (``forward()``,
        from the recorded variables: every module meets the state it met) per nesting depth, so that no isolated
        module runs inside another; ``nn.remat`` is transparent. A module whose replayed call raises is skipped
        with the reason and its recorded call made instead, so its siblings are still isolated; a submodule whose
        call is traced (an ``nn.scan`` body), or whose inputs do not fit, is not run: the reason comes back
        (first, then the runs in torch's order, then the modules without a pair)."""
        prepare = replays(pairs, torch_records, torch_calls, flax_records, self.port_calls)
        names = {(_module_path(n, c.method), c.method): n for n, c in self.port_calls.items()}
        by_flax = {f: t for t, f in pairs.flax_paths.items() if t in pairs.modules and t in torch_records}
        outputs: dict[str, Replayed] = {}
        skipped: dict[str, str] = {}

        def depth(path: str) -> int:
            return 0 if path == WHOLE_MODEL else path.count(".") + 1

        levels = {depth(_module_path(f, self.port_calls[f].method)) for f in by_flax if f in self.port_calls}
        for level in sorted(levels):
            done: set[tuple[str, str]] = set()
            active: set[str] = set()
            layers = _Layers(self.tree.tree())

            def interceptor(next_fun, args, kwargs, context, level=level, done=done, active=active, layers=layers):
                if context.method_name == "setup":
                    return next_fun(*args, **kwargs)
                path, scoped = layers.name(context.module, _traced(args, kwargs))
                try:
                    return isolated(next_fun, args, kwargs, context, level, done, active, path)
                finally:
                    if scoped:
                        layers.leave()

            def isolated(next_fun, args, kwargs, context, level, done, active, path):
                key = (path, _method(context))
                torch_path = by_flax.get(names.get(key, ""))
                if torch_path is None or key in done or key[0] in active or depth(key[0]) != level:
                    return next_fun(*args, **kwargs)
                done.add(key)
                prepared = prepare(torch_path, self.port_calls[names[key]]) if not _traced(args, kwargs) else TRACED
                if isinstance(prepared, str):
                    skipped[torch_path] = prepared
                    return next_fun(*args, **kwargs)
                active.add(key[0])
                try:
                    out = next_fun(*prepared.args, **prepared.kwargs)
                except Exception as err:  # noqa: BLE001 - this module is skipped with the reason; its siblings go on
                    raised = f"{type(err).__name__}: {str(err)[:120]}"
                    skipped[torch_path] = f"the flax call on torch's arguments raised {raised}"
                    return next_fun(*args, **kwargs)
                finally:
                    active.discard(key[0])
                outputs[torch_path] = Replayed(floating_leaves(out), prepared.kept)
                return out

            try:
                with linen.intercept_methods(interceptor), transparent_remat():
                    forward()
            except Exception as err:  # noqa: BLE001 - any failure is reported as the reason these were not isolated
                reason = f"the flax apply on torch's inputs raised {type(err).__name__}: {str(err)[:120]}"
                skipped.update({t: reason for f, t in by_flax.items() if t not in outputs and t not in skipped})
        yield from skipped.items()
        for torch_path in torch_records:
            flax_path = pairs.flax_paths.get(torch_path, "")
            if torch_path in by_flax.values() and torch_path not in skipped:
                why = self.traced.get(flax_path, self.unwrapped.get(flax_path, "not called during the flax apply"))
                yield torch_path, outputs.get(torch_path, why)
        for torch_path in torch_records:
            if torch_path not in pairs.modules:
                yield torch_path, pairs.why_unpaired(torch_path)


def _module_path(name: str, method: str) -> str:
    """The scope path of the module whose recorded call is named ``name`` (``path`` or ``path.method``)."""
    return name[: -len(method) - 1] if name.endswith("." + method) else name
