"""A flax forward that changes NNX state made outside the run (a cache passed in through ``forward=``): NNX refuses it
inside ``jax.jit`` and ``jax.grad`` with a ``TraceContextError``; :func:`outside_state_error` says which module
did it and what to do. State the port holds itself (a counter, a cache given to its constructor) is copied into
every run and changes there freely. Imports no torch."""

from __future__ import annotations

import types
from typing import Any

from flax import errors, nnx


def _innermost_module_frame(tb: types.TracebackType | None) -> tuple[nnx.Module | None, str]:
    """The innermost frame of ``tb`` whose first argument (``self``) is an ``nnx.Module``: (that module, its
    method's name)."""
    found: tuple[nnx.Module | None, str] = (None, "")
    while tb is not None:
        code = tb.tb_frame.f_code
        owner = tb.tb_frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None  # a method's self
        if isinstance(owner, nnx.Module):
            found = (owner, code.co_name)
        tb = tb.tb_next
    return found


def outside_state_error(err: BaseException, model: Any) -> TypeError | None:
    """For NNX's ``TraceContextError`` raised while ``model`` (the merged NNX port) ran under the engine's trace, a
    ``TypeError`` naming the module that changed a variable made outside the run, and how to fix it; ``None`` for
    any other error (it is raised as it is)."""
    if not isinstance(err, errors.TraceContextError):
        return None
    module, method = _innermost_module_frame(err.__traceback__)
    where = "the flax forward"
    if module is not None:
        paths = {} if not isinstance(model, nnx.Module) else {id(m): p for p, m in nnx.iter_modules(model)}
        path = paths.get(id(module))
        place = "" if path is None else f" at {'.'.join(map(str, path)) or 'the root'}"
        where = f"{type(module).__name__}.{method}{place}"
    return TypeError(
        f"{where} changes an NNX variable made outside the compared run ({str(err).split(' (')[0]}): the engine "
        "runs the flax forward under jax.jit and jax.grad, where NNX refuses to change a variable created outside "
        "them (a cache passed in through forward=). Hold it in the port (an attribute of the module, made before "
        "the comparison: each run starts from a copy of it and its state as the call leaves it is the port's), or "
        "make it inside the forward (forward=(None, lambda model, x: model(x, cache=make_cache())))"
    )
