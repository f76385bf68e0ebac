"""Records of every submodule's inputs and outputs during one forward pass: what a record holds
(:data:`Records`, :data:`Calls`, :func:`floating_leaves`, :func:`plain_value`) and the torch side's
recording (:func:`capture_torch`: forward hooks on the submodules of one model, removed when the call ends).

Each kind of flax side records its own submodules (``FlaxSide.record``): an NNX module with
:func:`flax_ln.parity.sides.nnx_record.capture_nnx`, a Linen module with
:func:`flax_ln.parity.sides.linen.capture_linen`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from flax_ln.convert.assign import as_numpy, is_floating
from flax_ln.convert.trees import is_equinox_module

WHOLE_MODEL = "(whole model)"  # the path under which the root module's own call is recorded

Records = dict[str, tuple[list[np.ndarray], list[np.ndarray]]]  # path -> (inputs, outputs)
Calls = dict[str, tuple[list[Any], dict[str, Any]]]  # path -> (positional args, keyword args) of the first call


class Unsupported(str):
    """A recorded argument that is neither an array nor a plain value (a callable, a module): names its type."""


def plain_value(value: Any) -> Any:
    """A call argument as data: a NumPy array for a tensor, the value itself for None/bool/int/float/str
    (and tuples, lists, dicts and dataclasses of those: a pytree of arrays, its type kept), else
    :class:`Unsupported` naming its type."""
    if hasattr(value, "detach"):  # a torch.Tensor
        return as_numpy(value).copy()
    if isinstance(value, (np.ndarray, jax.Array)):
        return np.array(value)  # a copy, as for a tensor
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = [plain_value(v) for v in value]
        return next((v for v in items if isinstance(v, Unsupported)), type(value)(items))
    if isinstance(value, dict) or _data_fields(value):  # a pytree of arrays: its leaves as data, its type kept
        fields = value if isinstance(value, dict) else _data_fields(value)
        held = {k: plain_value(v) for k, v in fields.items()}
        bad = next((v for v in held.values() if isinstance(v, Unsupported)), None)
        if bad is not None:
            return bad
        try:
            return type(value)(held) if isinstance(value, dict) else dataclasses.replace(value, **held)
        except Exception:  # noqa: BLE001 - a container that cannot be rebuilt from its items: not data here
            return Unsupported(type(value).__name__)
    return Unsupported(type(value).__name__)


def is_array(value: Any) -> bool:
    """A NumPy, JAX (a tracer too) or torch array: a leaf, never opened, whose truth value is never asked."""
    return isinstance(value, (np.ndarray, jax.Array)) or hasattr(value, "detach")


def array_node(value: Any) -> bool:
    """A pytree node of JAX's registry other than a tuple, list, dict or array (a named-axis array, a dataclass
    wrapper registered with ``jax.tree_util``) whose leaves are all arrays: opened like a container, its arrays
    recorded, compared and replaced one by one. Its own truth value, equality and ``shape`` are never asked.
    A module or a variable (NNX, Equinox), a pytree too, is not data: it stays whole."""
    if value is None or is_array(value) or isinstance(value, (tuple, list, dict, bool, int, float, str)):
        return False
    if isinstance(value, (nnx.Pytree, nnx.Variable)) or is_equinox_module(value):
        return False
    try:
        leaves = jax.tree_util.tree_leaves(value)
    except Exception:  # noqa: BLE001 - a node that cannot be flattened is no pytree of arrays
        return False
    return bool(leaves) and not (len(leaves) == 1 and leaves[0] is value) and all(is_array(x) for x in leaves)


def _data_fields(value: Any) -> dict[str, Any]:
    """The fields of a dataclass instance that its constructor takes (``{}`` for anything else)."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return {}
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}


def floating_leaves(tree: Any) -> list[np.ndarray]:
    """Floating array leaves of a (possibly nested) input or output, as NumPy copies taken at call time
    (a record must not change when the model later modifies a tensor in place); tracers are skipped."""
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in floating_leaves(item)]
    if isinstance(tree, dict) or _data_fields(tree):
        items = tree if isinstance(tree, dict) else _data_fields(tree)
        return [leaf for item in items.values() for leaf in floating_leaves(item)]
    if array_node(tree):
        return [leaf for item in jax.tree_util.tree_leaves(tree) for leaf in floating_leaves(item)]
    if isinstance(tree, jax.core.Tracer):
        return []  # inside a jit/scan trace: no values to record
    if hasattr(tree, "detach"):  # a torch.Tensor: copied now, so that a later in-place op cannot change the record
        tree = as_numpy(tree).copy()
    if isinstance(tree, (np.ndarray, jax.Array)) and is_floating(tree.dtype):  # bfloat16 too
        return [np.array(tree)]  # a copy: never a view of a caller's array or of a device buffer
    return []


def capture_torch(
    model,
    call: Callable[[], Any],
    calls: Calls | None = None,
    watch: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> Records:
    """Run ``call`` with forward hooks on every submodule of the torch ``model``: path -> (inputs, outputs).

    Dict order is execution order (a module is recorded when its forward returns). A module's inputs are its
    positional floating arrays, or, when it was given none, its keyword arguments' (in call order). With
    ``calls``, each module's first call is also stored there whole (every positional and
    keyword argument, by :func:`plain_value`), so the module can be called again on it. With ``watch``
    (:func:`~flax_ln.parity.records.torch_trace.tracing` bound to a model and its trace), torch's own code around
    each module is read too: the hook it yields is told of each module's first output.
    """
    import torch

    watched = watch() if watch is not None else contextlib.nullcontext(None)

    records: Records = {}
    handles = []
    for name, module in model.named_modules():

        def hook(mod, args, kwargs, output, name=name or WHOLE_MODEL):
            if name not in records and calls is not None:
                calls[name] = ([plain_value(a) for a in args], {k: plain_value(v) for k, v in kwargs.items()})
            inputs = floating_leaves(args) or floating_leaves(kwargs)  # transformers passes hidden_states by name
            if name not in records and seen is not None:
                seen(name, output, (args, kwargs))
            records.setdefault(name, (inputs, floating_leaves(output)))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), watched as seen:
            call()
    finally:
        for handle in handles:
            handle.remove()
    return records
