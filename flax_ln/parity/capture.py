"""Record every submodule's inputs and outputs during one forward pass, in both frameworks.

torch: forward hooks on the submodules of one model, removed when the call ends.

Linen: :func:`capture_linen`, a method interceptor (``flax.linen.intercept_methods``) for
the duration of one call, keyed by scope path.

flax: nothing is patched. For the duration of one call, a profile function
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

import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

WHOLE_MODEL = "(whole model)"  # the path under which the root module's own call is recorded

Records = dict[str, tuple[list[np.ndarray], list[np.ndarray]]]  # path -> (inputs, outputs)
Calls = dict[str, tuple[list[Any], dict[str, Any]]]  # path -> (positional args, keyword args) of the first call


class Unsupported(str):
    """A recorded argument that is neither an array nor a plain value (a callable, a module): names its type."""


def plain_value(value: Any) -> Any:
    """A call argument as data: a NumPy array for a tensor, the value itself for None/bool/int/float/str
    (and tuples/lists of those), else :class:`Unsupported` naming its type."""
    if hasattr(value, "detach"):  # a torch.Tensor
        return value.detach().numpy().copy()
    if isinstance(value, (np.ndarray, jax.Array)):
        return np.array(value)  # a copy, as for a tensor
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = [plain_value(v) for v in value]
        return next((v for v in items if isinstance(v, Unsupported)), type(value)(items))
    return Unsupported(type(value).__name__)


def floating_leaves(tree: Any) -> list[np.ndarray]:
    """Floating array leaves of a (possibly nested) input or output, as NumPy copies taken at call time
    (a record must not change when the model later modifies a tensor in place); tracers are skipped."""
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in floating_leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in floating_leaves(item)]
    if isinstance(tree, jax.core.Tracer):
        return []  # inside a jit/scan trace: no values to record
    if hasattr(tree, "detach"):  # a torch.Tensor: copied now, so that a later in-place op cannot change the record
        tree = tree.detach().cpu().numpy().copy()
    if isinstance(tree, (np.ndarray, jax.Array)) and np.issubdtype(tree.dtype, np.floating):
        return [np.array(tree)]  # a copy: never a view of a caller's array or of a device buffer
    return []


def capture_torch(model, call: Callable[[], Any], calls: Calls | None = None) -> Records:
    """Run ``call`` with forward hooks on every submodule of the torch ``model``: path -> (inputs, outputs).

    Dict order is execution order (a module is recorded when its forward returns). With
    ``calls``, each module's first call is also stored there whole (every positional and
    keyword argument, by :func:`plain_value`), so the module can be called again on it.
    """
    import torch

    records: Records = {}
    handles = []
    for name, module in model.named_modules():

        def hook(mod, args, kwargs, output, name=name or WHOLE_MODEL):
            if name not in records and calls is not None:
                calls[name] = ([plain_value(a) for a in args], {k: plain_value(v) for k, v in kwargs.items()})
            records.setdefault(name, (floating_leaves(args), floating_leaves(output)))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            call()
    finally:
        for handle in handles:
            handle.remove()
    return records


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


def capture_flax(model: nnx.Module, call: Callable[[], Any]) -> Records:
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


def scope_path(module) -> str:
    """A bound Linen module's scope path, dotted (:data:`WHOLE_MODEL` for the root)."""
    return ".".join(map(str, module.path)) or WHOLE_MODEL


def capture_linen(call: Callable[[], Any]) -> Records:
    """Run ``call`` (one or more Linen ``apply``, eagerly) with the (positional inputs, outputs) of every
    submodule recorded by dotted scope path, through ``flax.linen.intercept_methods``.

    As for NNX: dict order is execution order, the outermost call of any of a module's methods is
    recorded (``setup`` aside), the first completed call with a floating output is kept, and a call
    traced inside a transform (an ``nn.scan`` body) holds no values and is not recorded.
    """
    from flax import linen

    records: Records = {}
    active: set[str] = set()

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        path = scope_path(context.module)
        if path in active:
            return next_fun(*args, **kwargs)
        active.add(path)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            active.discard(path)
        outputs = floating_leaves(out)
        if outputs and path not in records:
            records[path] = (floating_leaves(list(args)), outputs)
        return out

    with linen.intercept_methods(interceptor):
        call()
    return records
