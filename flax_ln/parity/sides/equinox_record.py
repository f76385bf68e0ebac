"""The recording of an Equinox module's submodule calls (:func:`instrumented`, :class:`EquinoxRecording`) and their
replay (:func:`call_again`). Imports neither torch nor, until a recorder is made, equinox.

Each callable submodule of a copy of the module is wrapped in a recorder. While a recording is on, the first call
of each submodule is kept whole (:class:`~flax_ln.parity.records.replay.PortCall`): its arguments, the module as
called, and its floating outputs, by dotted path.

- **Batch axes are kept.** A submodule called under ``jax.vmap`` (a model written per example and batched with
  ``jax.vmap(model)(batch)``, a norm run per token with ``jax.vmap(self.norm)(tokens)``) is recorded with every
  batch axis the vmaps add, outermost first, nested ones included: a per-token norm inside a per-example model
  records ``(batch, tokens, width)``. The values come through ``jax.debug.callback``, called once per batch
  element (innermost axis slowest); the axis sizes are read from the batch tracers, so the calls are put back in
  place.
- **Scanned stacks are recorded per iteration.** A submodule whose arrays are stacked on a leading layer axis
  (layers built with ``eqx.filter_vmap``) and that is called on one slice of them at a time (``jax.lax.scan``
  over the stacked arrays, run as a Python loop under ``jax.disable_jit()``) is recorded once per layer, as
  ``layers[k]``, and its submodules as ``layers[k].attn``; the layer is the slice whose values it holds.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_ln.convert.trees import is_equinox_module
from flax_ln.parity.records.capture import WHOLE_MODEL, Records
from flax_ln.parity.records.pairing import StackLayers
from flax_ln.parity.records.replay import PortCall


def batch_sizes(leaves: list[Any]) -> list[int]:
    """The sizes of the ``jax.vmap`` batch axes the leaves are mapped over, innermost first (the longest such
    chain among them); ``[]`` outside ``vmap``. Reads each batch tracer's ``val`` and ``batch_dim``."""
    best: list[int] = []
    for leaf in leaves:
        sizes, x = [], leaf
        while hasattr(x, "batch_dim") and hasattr(x, "val") and isinstance(x, jax.core.Tracer):
            if isinstance(x.batch_dim, int):
                sizes.append(int(np.shape(x.val)[x.batch_dim]))
            x = x.val
        best = sizes if len(sizes) > len(best) else best
    return best


def _is_key(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _traced(leaf: Any) -> bool:
    """Whether ``leaf`` is traced: a tracer that is not a ``jax.vmap`` batch tracer over values (whose ``val`` and
    ``batch_dim`` hold them)."""
    while isinstance(leaf, jax.core.Tracer) and hasattr(leaf, "batch_dim"):
        leaf = leaf.val
    return isinstance(leaf, jax.core.Tracer)


TRACED_STACK = (
    "a stack of layers called inside a trace (a scan that was not unrolled, or a jax.checkpoint that could not run "
    "eagerly in this JAX): its layers cannot be told apart, so none is recorded"
)


def _floating(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and hasattr(leaf, "shape") and jnp.issubdtype(leaf.dtype, jnp.floating)


@dataclasses.dataclass
class _Entry:
    """One recorded call: its arguments' leaves (``traced``: the positions whose values arrive through the
    callback, one per batch element), its outputs, the batch axis sizes (innermost first)."""

    call: PortCall
    leaves: list[Any]
    treedef: Any
    traced: list[int]
    keys: set[int]
    sizes: list[int]
    elements: list[tuple[list[np.ndarray], list[np.ndarray]]] = dataclasses.field(default_factory=list)
    outputs: list[np.ndarray] | None = None

    def batch_axes(self) -> list[int]:
        """The sizes of the batch axes the stored values fill (innermost first): none outside ``vmap``, or where
        the calls stored are not one per batch element."""
        return self.sizes if self.sizes and math.prod(self.sizes) == len(self.elements) else []

    def store(self, traced: list[Any], outputs: list[Any]) -> None:
        self.elements.append(([np.array(x) for x in traced], [np.array(x) for x in outputs]))


def _restack(arrays: list[np.ndarray], sizes: list[int]) -> np.ndarray:
    """One value per batch element (innermost axis slowest, as ``jax.debug.callback`` is called under nested
    ``vmap``) as one array, its batch axes (``sizes``, innermost first) first, outermost first."""
    stacked = np.stack(arrays)  # (calls, *element)
    if not sizes:
        return stacked
    lead = len(sizes)
    shaped = stacked.reshape(*sizes, *stacked.shape[1:])  # (inner, ..., outer, *element)
    return shaped.transpose(*reversed(range(lead)), *range(lead, shaped.ndim))  # (outer, ..., inner, *element)


class EquinoxRecording:
    """The calls recorded during one forward: ``stacked`` holds each submodule's array leaves (by dotted path),
    to tell a scanned layer's call (on one slice of them) from a plain one."""

    def __init__(self, stacked: dict[str, list[Any]]):
        self.stacked = stacked
        self.entries: dict[str, _Entry] = {}
        self.traced: dict[str, str] = {}  # the stacked submodules called inside a trace: not recorded, and why
        self.layers = StackLayers()
        self.clock = itertools.count()

    def name(self, path: str, inner: Any) -> tuple[str, bool]:
        """The recorded name of a call of the submodule at ``path`` (``layers[3].attn`` inside iteration 3 of
        ``layers``), and whether it is a scanned layer's iteration (then its scope is entered)."""
        return self.layers.name(path, lambda: self._layer(path, inner))

    def _layer(self, path: str, inner: Any) -> int | None:
        """The layer of a stacked submodule that ``inner`` (its copy in one iteration) holds: the slice its arrays
        equal (:class:`~flax_ln.parity.records.pairing.StackLayers`); ``None`` when ``inner`` holds the whole stack."""
        whole = self.stacked.get(path)
        parts = [x for x in jax.tree_util.tree_leaves(inner) if isinstance(x, (jax.Array, np.ndarray))]
        return None if whole is None else self.layers.layer(path, whole, parts)

    def traced_stack(self, path: str, inner: Any) -> bool:
        """Whether ``inner`` (a call of the submodule at ``path``) is a stack of layers whose arrays are traced (a
        scan that was not unrolled, a checkpoint that could not run eagerly): no layer can be told, so the call is
        not recorded, and its path is kept in :attr:`traced` with the reason."""
        whole = self.stacked.get(path) or []
        if not any(np.ndim(w) for w in whole) or not any(_traced(x) for x in jax.tree_util.tree_leaves(inner)):
            return False
        self.traced.setdefault(path, TRACED_STACK)
        return True

    def leave(self) -> None:
        """The end of a scanned layer's iteration."""
        self.layers.leave()

    def begin(self, name: str, inner: Any, args: tuple, kwargs: dict) -> tuple[_Entry, list[Any]] | None:
        """Start recording the call ``name`` (its first only): its entry and the traced leaves to send."""
        if name in self.entries:
            return None
        leaves, treedef = jax.tree_util.tree_flatten((list(args), dict(kwargs)))
        traced = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
        keys = {i for i in traced if _is_key(leaves[i])}
        try:
            params = inspect.signature(inner).parameters.values()
            positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        except (TypeError, ValueError):
            positional = ()
        call = PortCall("__call__", list(args), dict(kwargs), positional, next(self.clock), state=inner)
        sizes = batch_sizes([leaves[i] for i in traced])
        entry = _Entry(call, list(leaves), treedef, traced, keys, sizes)
        self.entries[name] = entry
        sent = [jax.random.key_data(leaves[i]) if i in keys else leaves[i] for i in traced]
        return entry, sent

    def finish(self, entry: _Entry, sent: list[Any], out: Any) -> None:
        """The call returned ``out``: its values stored now (concrete) or by callback (traced)."""
        entry.call.end = next(self.clock)
        outputs = [x for x in jax.tree_util.tree_leaves(out) if _floating(x)]
        entry.sizes = batch_sizes([*sent, *outputs]) if not entry.sizes else entry.sizes
        if not sent and not any(isinstance(x, jax.core.Tracer) for x in outputs):
            entry.store([], outputs)
        else:
            jax.debug.callback(entry.store, sent, outputs)

    def records(self) -> Records:
        """Each recorded call's floating inputs and outputs (batch axes first), in call order; the port calls are
        completed with the recorded values (:meth:`port_calls`)."""
        out: Records = {}
        for name, entry in sorted(self.entries.items(), key=lambda item: item[1].call.end):
            if not entry.elements:
                continue
            sizes = entry.batch_axes()
            columns = [list(xs) for xs in zip(*(e[0] for e in entry.elements))]
            leaves = list(entry.leaves)
            for i, values in zip(entry.traced, columns):
                value = _restack(values, sizes) if sizes else values[0]  # outside vmap: the first call's
                leaves[i] = jax.random.wrap_key_data(jnp.asarray(value)) if i in entry.keys else value
            args, kwargs = jax.tree_util.tree_unflatten(entry.treedef, leaves)
            entry.call.args, entry.call.kwargs = list(args), dict(kwargs)
            outputs = [_restack(list(xs), sizes) if sizes else xs[0] for xs in zip(*(e[1] for e in entry.elements))]
            if not outputs:
                continue
            inputs = [np.array(x) for x in leaves if _floating(x)]
            out[name] = (inputs, outputs)
            entry.outputs = outputs
        return out

    def port_calls(self) -> dict[str, tuple[PortCall, int, list[int]]]:
        """Each recorded call (after :meth:`records`): the call, its number of batch axes, and the positions of
        its leaves that carry them."""
        return {
            name: (e.call, len(e.batch_axes()), e.traced) for name, e in self.entries.items() if e.outputs is not None
        }


def call_again(module: Any, args: list[Any], kwargs: dict[str, Any], levels: int, batched: list[int]) -> Any:
    """Call ``module(*args, **kwargs)`` as the port called it: under ``levels`` nested ``jax.vmap`` over the
    leaves at positions ``batched`` (of the flattened ``(args, kwargs)``, their batch axes first); the other
    leaves (flags, keys, numbers) are passed as they are."""
    leaves, treedef = jax.tree_util.tree_flatten((list(args), dict(kwargs)))
    batched = [i for i in batched if i < len(leaves)] if levels else []

    def run(*mapped):
        filled = list(leaves)
        for i, value in zip(batched, mapped):
            filled[i] = value
        f_args, f_kwargs = jax.tree_util.tree_unflatten(treedef, filled)
        return module(*f_args, **f_kwargs)

    fn: Callable[..., Any] = run
    for _ in range(levels):
        fn = jax.vmap(fn)
    return fn(*(jnp.asarray(leaves[i]) for i in batched))


_RECORDINGS: list[EquinoxRecording] = []  # the recordings under way (the innermost last)


@functools.cache
def _recorder() -> type:
    import equinox as eqx

    class Recorder(eqx.Module):
        """A submodule as it is, its calls recorded while a recording is on."""

        inner: Any
        path: str = eqx.field(static=True)

        def __call__(self, *args, **kwargs):
            if not _RECORDINGS:
                return self.inner(*args, **kwargs)
            recording = _RECORDINGS[-1]
            if recording.traced_stack(self.path, self.inner):
                return self.inner(*args, **kwargs)
            name, scoped = recording.name(self.path, self.inner)
            try:
                started = recording.begin(name, self.inner, args, kwargs)
                out = self.inner(*args, **kwargs)
            finally:
                if scoped:
                    recording.leave()
            if started is not None:
                recording.finish(*started, out)
            return out

        def __getattr__(self, name: str) -> Any:  # the port's forward may call another method
            if name in ("inner", "path") or name.startswith("__"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    return Recorder


def recording(recorder: EquinoxRecording):
    """A context in which the recorders record into ``recorder``."""

    class _On:
        def __enter__(self):
            _RECORDINGS.append(recorder)
            return recorder

        def __exit__(self, *exc):
            _RECORDINGS.remove(recorder)

    return _On()


def instrumented(node: Any, path: tuple[str, ...] = ()) -> Any:
    """A copy of ``node`` with every callable ``equinox.Module`` in it wrapped in a recorder named by its dotted
    path (the root: :data:`WHOLE_MODEL`); the caller's module and its submodules are not changed."""
    if is_equinox_module(node):
        changed = {}
        for field in dataclasses.fields(node):
            if field.metadata.get("static", False):
                continue
            value = getattr(node, field.name, None)
            new = instrumented(value, (*path, field.name))
            if new is not value:
                changed[field.name] = new
        if changed:
            node = copy.copy(node)  # a shallow copy: the caller's module keeps its own fields
            for name, value in changed.items():
                object.__setattr__(node, name, value)
        return _recorder()(node, ".".join(path) or WHOLE_MODEL) if callable(node) else node
    if isinstance(node, (list, tuple)):
        items = [instrumented(item, (*path, str(i))) for i, item in enumerate(node)]
        if all(a is b for a, b in zip(items, node)):
            return node
        return type(node)(items) if not hasattr(node, "_fields") else type(node)(*items)
    if isinstance(node, dict):
        new_dict = {k: instrumented(v, (*path, str(k))) for k, v in node.items()}
        return node if all(new_dict[k] is node[k] for k in node) else type(node)(new_dict)
    return node
