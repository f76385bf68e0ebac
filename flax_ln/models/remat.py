"""Rematerialisation and the scan over layers for :class:`flax_ln.GPT`'s blocks.

:func:`remat_policy` turns ``GPT(remat=...)`` into a ``jax.checkpoint`` policy.
:func:`remat_block` runs one block of the unrolled layout under :func:`remat_in_backward`,
a ``jax.checkpoint`` whose recomputation stays in the backward pass on XLA:CPU too;
:func:`scan_blocks` runs the stacked blocks of ``scan_layers=True`` with ``jax.lax.scan``,
rematerialised with plain ``jax.checkpoint``. Both write the advanced dropout RNG state
back into the blocks only when some dropout is active.

What they need of a block is :class:`RematBlock`, so this module imports no model.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx


class RematBlock(Protocol):
    """What :func:`remat_block` and :func:`scan_blocks` need of a block: an ``nnx.Module`` with ``attend``.

    The block is split and merged with ``nnx.split``/``nnx.merge`` and searched for active
    ``nnx.Dropout`` modules; :class:`flax_ln.models.gpt.Block` is one.
    """

    def attend(self, x: jax.Array, cache: Any, pos: Any, layer: Any = 0) -> tuple[jax.Array, Any]:
        """``(x, cache)``: the block's output for ``x`` (B, T, C), whose first token is at absolute position ``pos``,
        and the all-layer KV cache ``cache`` with this block's ``layer`` written (``None`` stays ``None``)."""
        ...


def remat_policy(remat):
    """The ``jax.checkpoint`` policy :class:`flax_ln.GPT` wraps each block in: ``None`` (no remat) or a policy.

    ``False`` -> ``None``; ``True`` -> ``jax.checkpoint_policies.nothing_saveable`` (keep
    only each block's input, recompute the rest in the backward pass); a callable is
    taken as a policy, e.g. ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``.
    """
    if remat is False or remat is None:
        return None
    if remat is True:
        return jax.checkpoint_policies.nothing_saveable
    if callable(remat):
        return remat
    raise ValueError(
        f"GPT: remat must be False, True or a jax.checkpoint policy (e.g. "
        f"jax.checkpoint_policies.dots_with_no_batch_dims_saveable), got {remat!r}"
    )


def _dropout_active(node: object) -> bool:
    return any(isinstance(m, nnx.Dropout) and not m.deterministic and m.rate > 0 for _, m in nnx.iter_graph(node))


def remat_in_backward(fun, policy):
    """``jax.checkpoint(fun, policy=policy)`` whose recomputation stays in the backward pass on every backend.

    The backward pass keeps only the values ``policy`` saves (just the inputs with
    ``nothing_saveable``) and recomputes the rest of ``fun`` before differentiating it,
    so the gradients are those of ``fun``. Plain ``jax.checkpoint`` relies on
    ``optimization_barrier``s to keep XLA from merging the recomputation back into the
    forward pass; XLA's CPU pipeline removes them (``cse_barrier_expander``) before its
    last CSE pass, which then does exactly that, and no memory is saved (benchmarks/RESULTS.md).
    Here the residuals pass through ``where(isnan(sum(cotangent)), nan, r)`` first: a data
    dependency on the incoming cotangent that no compiler pass removes, costing one
    element-wise pass over the residuals. It changes nothing unless the cotangent holds a
    NaN, and then the gradients would be NaN anyway.

    Being a ``jax.custom_vjp``, it supports reverse mode only (``jax.grad``, ``jax.vjp``,
    ``jax.jacrev``, also nested); ``jax.jvp``, ``jax.jacfwd``, ``jax.linearize`` and
    ``jax.hessian`` raise. A data dependency on the cotangent cannot be expressed in a
    rule that JAX transposes (``custom_jvp``), and without it XLA:CPU schedules the
    recomputation inside the forward pass (benchmarks/RESULTS.md lists what else was
    tried). Only the unrolled layout uses it: the scanned
    layout's recomputation sits in the backward loop, where plain ``jax.checkpoint``
    works (:func:`scan_blocks`).
    """
    remat_fun = jax.checkpoint(fun, policy=policy, prevent_cse=False)

    @jax.custom_vjp
    def wrapped(*args):
        return fun(*args)

    def fwd(*args):
        return jax.vjp(remat_fun, *args)  # (outputs, residuals as a pytree: the vjp function)

    def bwd(vjp_fn, cotangents):
        floats = [c for c in jax.tree.leaves(cotangents) if jnp.issubdtype(c.dtype, jnp.inexact)]
        poisoned = jnp.isnan(sum(jnp.sum(c, dtype=jnp.float32) for c in floats))
        vjp_fn = jax.tree.map(
            lambda r: (
                jnp.where(poisoned, jnp.asarray(jnp.nan, r.dtype), r) if jnp.issubdtype(r.dtype, jnp.inexact) else r
            ),
            vjp_fn,
        )
        return vjp_fn(cotangents)

    wrapped.defvjp(fwd, bwd)
    return wrapped


def _pure_block(graphdef, pos, policy, remat=remat_in_backward):
    """``(block_state, x, cache, layer) -> (x, cache, rng_state)``: one block on the functional split, rematerialised
    with ``remat(fun, policy)`` (:func:`remat_in_backward` by default) unless ``policy`` is ``None``.

    Dropout masks are recomputed from the same keys, so the gradients are unchanged.
    """

    def run(block_state, x, cache, layer=0):
        block: RematBlock = nnx.merge(graphdef, block_state)
        x, cache = block.attend(x, cache, pos, layer)
        return x, cache, nnx.state(block, nnx.RngState)

    return run if policy is None else remat(run, policy)


def remat_block(block: RematBlock, x, pos, policy):
    """``block(x)`` rematerialised with :func:`remat_in_backward` and ``policy``; dropout RNG counters written back.

    ``pos`` is the absolute position of ``x``'s first token; no KV cache (decoding takes no gradients).
    """
    graphdef, state = nnx.split(block)
    x, _, rng_state = _pure_block(graphdef, pos, policy)(state, x, None)
    if _dropout_active(block):
        nnx.update(block, rng_state)
    return x


def scan_blocks(h: nnx.Module, x, cache, pos, policy=None):
    """Run stacked blocks (leading layer axis) with ``jax.lax.scan``; returns ``(x, cache)``.

    The KV cache (all layers) rides in the carry and each step writes its own layer in
    place; scanning over per-layer cache slices instead would rebuild the whole cache as
    the stacked output at every call. Each step merges one layer's slice into a fresh
    block (a :class:`RematBlock`), rematerialised with
    plain ``jax.checkpoint`` and ``policy`` unless it is ``None`` (inside the backward
    loop XLA cannot move the recomputation into the forward pass, and forward-mode
    autodiff works through it). Only when some dropout is active is the advanced
    RNG state written back into ``h``, so in eval mode the module is never mutated,
    exactly like the unrolled path (NNX forbids mutating Variables from another trace
    level, e.g. a model closed over inside ``jax.grad``).
    """
    graphdef, state = nnx.split(h)
    block = _pure_block(  # decoding takes no gradients
        graphdef, pos, None if cache is not None else policy, lambda fun, policy: jax.checkpoint(fun, policy=policy)
    )

    def step(carry, layer):
        x, cache = carry
        layer_state, index = layer
        x, cache, rng_state = block(layer_state, x, cache, index)
        return (x, cache), rng_state

    n_layer = jax.tree.leaves(state)[0].shape[0]
    (x, cache), rng_state = jax.lax.scan(step, (x, cache), (state, jnp.arange(n_layer)))
    if _dropout_active(h):
        nnx.update(h, rng_state)
    return x, cache
