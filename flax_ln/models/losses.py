"""The GPT's loss: token cross-entropy, and the output head and cross-entropy differentiated in one piece.

:func:`cross_entropy` is ``F.cross_entropy`` with ``ignore_index``. :func:`head_cross_entropy`
(and :func:`head_logits_and_cross_entropy`) compute ``cross_entropy(head(hidden), ...)``
under one ``jax.custom_jvp`` whose rule computes the loss's gradients with respect to
``hidden`` and the head's parameters in the forward pass, so reverse mode never keeps the
(tokens, vocab) logits for the backward pass. :class:`flax_ln.GPT` computes its loss with it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def cross_entropy(logits: jax.Array, targets: jax.Array, ignore_index: int) -> jax.Array:
    """Mean token cross-entropy over targets != ``ignore_index``, as ``F.cross_entropy``.

    Computed in at least float32. If every target is ignored the mean is 0/0 = NaN, as in
    torch. Targets are not checked here (:meth:`flax_ln.GPT.__call__` checks them): one outside
    ``[0, vocab)`` wraps around if in ``[-vocab, 0)`` and gives NaN otherwise (``jnp.take_along_axis``).
    """
    return _cross_entropy_parts(logits, targets, ignore_index)[0]


def _cross_entropy_parts(logits, targets, ignore_index):
    """``(loss, probs, valid, safe_targets, count)`` of :func:`cross_entropy`.

    The log-softmax as ``jax.nn.log_softmax`` computes it (the row's maximum, held constant
    for differentiation, taken out before ``exp``), with ``exp`` of the shifted logits
    computed once for both the normaliser and ``probs``: the loss's gradient needs the
    softmax, and recomputing ``exp`` from the log-probabilities would cost XLA:CPU a second
    pass over the (tokens, vocab) array.
    """
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # (..., V)
    exp_shifted = jnp.exp(shifted)
    normaliser = jnp.sum(exp_shifted, axis=-1, keepdims=True)  # (..., 1)
    valid = targets != ignore_index
    safe_targets = jnp.where(valid, targets, 0)
    picked = jnp.take_along_axis(shifted, safe_targets[..., None], axis=-1)[..., 0] - jnp.log(normaliser[..., 0])
    count = jnp.sum(valid)
    loss = -jnp.sum(jnp.where(valid, picked, 0.0)) / count
    return loss, exp_shifted / normaliser, valid, safe_targets, count


def head_cross_entropy(head: nnx.Module, hidden: jax.Array, targets: jax.Array, ignore_index: int) -> jax.Array:
    """``cross_entropy(head(hidden), targets, ignore_index)``, differentiated in one piece.

    The same value, and the same derivatives to rounding, as the composition; what
    changes is what a gradient computes and keeps. The rule's tangent is linear in the
    tangents of ``hidden`` and of ``head``'s parameters with coefficients that are the
    loss's gradients, ``d loss / d logits = (softmax(logits) - onehot(targets)) / count``
    pulled back through ``head``. So reverse mode computes both gradients in the forward
    pass, right after the softmax, and keeps them (``hidden``-sized and parameter-sized)
    instead of the (tokens, vocab) logits and log-probabilities; the backward pass has
    nothing left to do for the head. On a 2-core CPU this makes the GPT-2 124M training
    step faster (``benchmarks/RESULTS.md``). It is a ``custom_jvp``: forward mode,
    ``vmap`` and higher derivatives all work (the rule is plain JAX).

    Args:
      head: the output layer, any NNX module mapping ``hidden`` to logits (e.g. ``nnx.Linear``).
      hidden: its input, (..., C).
      targets: token ids, the leading shape of ``hidden``; ``ignore_index`` entries are skipped.
      ignore_index: the target id to skip.
    """
    return head_logits_and_cross_entropy(head, hidden, targets, ignore_index)[1]


def head_logits_and_cross_entropy(head: nnx.Module, hidden: jax.Array, targets: jax.Array, ignore_index: int):
    """``(head(hidden), loss)``: :func:`head_cross_entropy` that also returns the logits it computed.

    Under ``jit`` a caller that drops the logits pays nothing for them beyond the softmax's
    own need; outside ``jit`` the head runs once for both.
    """
    graphdef, params = nnx.split(head)
    return _head_logits_and_cross_entropy(graphdef, ignore_index, hidden, params, targets)


def _apply_head(graphdef, hidden, params):
    return nnx.merge(graphdef, params)(hidden)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _head_logits_and_cross_entropy(graphdef, ignore_index, hidden, params, targets):
    logits = _apply_head(graphdef, hidden, params)
    return logits, cross_entropy(logits, targets, ignore_index)


@_head_logits_and_cross_entropy.defjvp
def _head_logits_and_cross_entropy_jvp(graphdef, ignore_index, primals, tangents):
    hidden, params, targets = primals
    hidden_tangent, params_tangent, _ = tangents
    logits, head_linear = jax.linearize(functools.partial(_apply_head, graphdef), hidden, params)
    loss, probs, valid, safe_targets, count = _cross_entropy_parts(logits, targets, ignore_index)
    onehot = jax.nn.one_hot(safe_targets, probs.shape[-1], dtype=probs.dtype)  # (..., V)
    logits_grad = jnp.where(valid[..., None], (probs - onehot) / count, 0.0)  # (..., V)
    grads = jax.linear_transpose(head_linear, hidden, params)(logits_grad.astype(logits.dtype))
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves((hidden_tangent, params_tangent)))
    loss_tangent = sum(jnp.vdot(grad, tangent) for grad, tangent in pairs)
    return (logits, loss), (head_linear(hidden_tangent, params_tangent), loss_tangent)
