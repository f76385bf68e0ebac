"""Rematerialisation run eagerly while localising (:func:`eager_checkpoints`), and the JAX internals it reaches,
each looked up here and checked by one probe call, beside :mod:`flax_ln.parity.islands.jax_internals`.

A function wrapped in ``jax.checkpoint`` / ``jax.remat`` (also by ``eqx.filter_checkpoint``, and when it was wrapped
at definition time, so that no later patch of ``jax.checkpoint`` reaches it) traces its function on every call,
also under ``jax.disable_jit()``: the modules inside see tracers, so a scan over stacked layers cannot tell its
layers apart and nothing in it is recorded. Rematerialisation changes when values are computed, never what they
are, so while :func:`eager_checkpoints` is active on a thread the wrapper calls its function on the arguments
instead. It reaches:

* ``jax._src.ad_checkpoint._trace_to_jaxpr(fun, in_tree, in_avals, debug)``: the wrapper's tracing of its function
  (replaced for the context: the function is kept, not traced);
* ``jax._src.ad_checkpoint.remat_p.bind``: the wrapper's bind of what it traced (an instance attribute shadows it
  for the context: a kept function is called on the arguments; anything else binds as before).

A JAX without them (or with ``jax_remat3`` on, which takes another path) leaves checkpoints traced: the layers in
them are then reported as not recorded (:data:`MISSING` says why).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

MISSING: list[str] = []  # the internals this JAX lacks, or whose signature differs: checkpoints stay traced


def _lookup() -> Any:
    try:
        module = importlib.import_module("jax._src.ad_checkpoint")
    except Exception:  # noqa: BLE001 - a moved internal raises ImportError or worse: all mean missing
        MISSING.append("jax._src.ad_checkpoint")
        return None
    if not callable(getattr(module, "_trace_to_jaxpr", None)):
        MISSING.append("jax._src.ad_checkpoint._trace_to_jaxpr")
    if not callable(getattr(getattr(module, "remat_p", None), "bind", None)):
        MISSING.append("jax._src.ad_checkpoint.remat_p.bind")
    return None if MISSING else module


_checkpoint = _lookup()
_on = threading.local()
_lock = threading.Lock()
_saved: dict[str, Any] = {}
_probed: list[str] = []  # after the first context: why checkpoints stay traced ("": they run eagerly)
_ONE_LEAF = jax.tree_util.tree_structure(0)  # unflattens [value] to value itself, whatever value is


class _Kept:
    """The function a checkpoint wrapper would have traced, kept to be called on the wrapper's arguments."""

    def __init__(self, fun: Callable[..., Any], in_tree: Any):
        self.fun, self.in_tree = fun, in_tree


def _trace(original: Callable[..., Any]) -> Callable[..., Any]:
    # JAX's tracer is a C++ cache with no readable signature: the first two parameters are the ones read here, and
    # every other one JAX passes is forwarded as it came (the probe checks the whole path once)
    def trace(fun: Callable[..., Any], in_tree: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_on, "depth", 0):
            return _Kept(fun, in_tree), (), _ONE_LEAF
        return original(fun, in_tree, *args, **kwargs)

    trace.cache_clear = getattr(original, "cache_clear", lambda: None)  # type: ignore[attr-defined]
    return trace


def _bind(original: Callable[..., Any]) -> Callable[..., Any]:
    def bind(*args: Any, jaxpr: Any, **params: Any) -> Any:
        if isinstance(jaxpr, _Kept):
            f_args, f_kwargs = jaxpr.in_tree.unflatten(args)
            return [jaxpr.fun(*f_args, **f_kwargs)]
        return original(*args, jaxpr=jaxpr, **params)

    return bind


def _probe() -> str:
    """Why a checkpointed function does not run eagerly under the patches (``""``: it does): one tiny call."""
    seen: list[bool] = []

    def f(x: Any) -> Any:
        seen.append(isinstance(x, jax.core.Tracer))
        return x + 1

    try:
        out = _checkpoint.checkpoint(f)(np.ones((), np.float32))
    except Exception as err:  # noqa: BLE001 - an internal that behaves differently may fail in any way
        return f"a checkpointed call raised {type(err).__name__}: {str(err)[:200]}"
    if seen != [False] or float(out) != 2.0:
        return f"a checkpointed function was traced (saw tracers: {seen}) or gave {out}"
    return ""


def supported() -> bool:
    """Whether checkpoints run eagerly in this JAX (its internals found and the probe passed, ``jax_remat3`` off):
    known after the first :func:`eager_checkpoints`; before it, whether the internals are there."""
    return _checkpoint is not None and not MISSING and not getattr(jax.config, "jax_remat3", False)


@contextlib.contextmanager
def eager_checkpoints() -> Iterator[None]:
    """While active on this thread, a ``jax.checkpoint``/``jax.remat`` wrapper (whenever it was applied) calls its
    function directly: the modules inside see the values a plain call gives them, one scan iteration at a time
    under ``jax.disable_jit()``. Other threads see JAX unchanged. Where it cannot (:func:`supported`), it changes
    nothing, and :data:`MISSING` says why."""
    if not supported():
        yield
        return
    with _lock:
        if not _saved:
            _saved["trace"], _saved["bind"] = _checkpoint._trace_to_jaxpr, _checkpoint.remat_p.bind
            _checkpoint._trace_to_jaxpr = _trace(_saved["trace"])
            _checkpoint.remat_p.bind = _bind(_saved["bind"])
        _saved["users"] = _saved.get("users", 0) + 1
    _on.depth = getattr(_on, "depth", 0) + 1
    try:
        if not _probed:
            _probed.append(_probe())
            if _probed[0]:
                MISSING.append(f"the probe: {_probed[0]}")
        yield
    finally:
        _on.depth -= 1
        with _lock:
            _saved["users"] -= 1
            if not _saved["users"]:
                _checkpoint._trace_to_jaxpr, _checkpoint.remat_p.bind = _saved["trace"], _saved["bind"]
                _saved.clear()
