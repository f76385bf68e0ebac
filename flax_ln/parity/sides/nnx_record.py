"""The recording of an NNX model's submodule calls (:func:`capture_nnx`), for the NNX side
(:mod:`flax_ln.parity.sides.nnx`). Imports no torch.

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

import inspect
import itertools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from flax_ln.parity.islands.jax_internals import forget_traces
from flax_ln.parity.records.capture import WHOLE_MODEL, Records, floating_leaves
from flax_ln.parity.records.pairing import StackLayers
from flax_ln.parity.records.replay import (
    TRACED,
    PortCall,
    call_names,
    method_name,
    transparent_remat,
)


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
        self.layers = StackLayers()  # the layers of each scanned stack seen so far

    def owner(self, obj: Any) -> tuple[int | None, bool]:
        """(id under which ``obj``'s path is known, or ``None``; whether it is a copy holding tracers)."""
        if id(obj) in self.paths:
            return id(obj), False
        if not isinstance(obj, nnx.Module):
            return None, False
        traced = _module_tracers(obj)
        path = self.by_arrays.get((type(obj), _arrays(obj))) if not traced else self.by_shape.get(_shape(obj))
        if path is None and not traced:
            path = self._layer(obj)
        if path is None:
            return None, traced
        for rel, sub in nnx.iter_modules(obj):
            self.paths[id(sub)], self.modules[id(sub)] = _joined(path, rel), sub
            self.kept.append(sub)
        return id(obj), traced

    def _layer(self, obj: nnx.Module) -> str | None:
        """``stack[k]`` when ``obj`` is one layer of a scanned stack (``nnx.scan`` over a module whose variables are
        stacked on a leading layer axis, run eagerly under ``jax.disable_jit()``): the module of the model of its
        type and submodules whose every variable stacks ``obj``'s; ``k`` the slice its values equal, else the
        count of that stack's layers seen so far."""
        values = _values(obj)
        for path, module in ((p, self.modules[i]) for i, p in self.paths.items()):
            if type(module) is not type(obj) or "[" in path or _shape(module) != _shape(obj):
                continue
            layer = self.layers.layer(path, _values(module), values)
            if layer is not None:
                return f"{path}[{layer}]"
        return None


def _values(module: nnx.Module) -> list[Any]:
    """The arrays ``module``'s variables hold, in graph order."""
    return [n.get_value() for _, n in nnx.iter_graph(module) if isinstance(n, nnx.Variable)]


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


def module_name(name: str, method: str) -> str:
    """The module path of a recorded call's name (``path`` or ``path.method``)."""
    return name[: -len(method) - 1] if name.endswith("." + method) else name
