"""Training pieces, optax-native: the Noam schedule, label smoothing, and a generic jitted train step.

The train step works on NNX's functional split: :func:`init_train_state` calls
``nnx.split`` once, and the step is one ``jax.jit`` of ``(graphdef, state, batch) ->
(state, loss)`` that calls ``nnx.merge`` inside, so no Python walks the module tree per
step. It is generic over the loss and the optax transformation::

    # chapter 10, the encoder-decoder
    tx = noam_adam(d_model=256)
    step = make_train_step(encoder_decoder_loss(padding_idx=0), tx)
    # chapters 12 and 14, a GPT: Adam 1e-4 after clipping the global norm to 1, as torch does
    tx = gpt_adam()
    step = make_train_step(gpt_loss, tx)

    graphdef, state = init_train_state(model, tx)
    for batch in batches:
        state, loss = step(graphdef, state, batch)
    nnx.update(model, state.params, state.rest)  # back into the module when needed
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from flax_ln.models.checks import check_id_values
from flax_ln.models.encoder_decoder import make_src_mask, make_std_mask
from flax_ln.sharding import gather_uneven_parameters

Batch = Any
LossFn = Callable[[nnx.Module, Batch], jax.Array]


def noam_schedule(d_model: int, factor: float = 1.0, warmup: int = 2000) -> optax.Schedule:
    """The Noam rate ``factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` as an optax schedule.

    Linear warm-up for ``warmup`` steps, then decay as ``step^-0.5``. The book's
    ``NoamOpt`` counts steps from 1 and optax counts updates from 0, so the schedule
    evaluates the formula at ``count + 1``: the first update uses the book's first rate.
    """

    def schedule(count):
        step = jnp.asarray(count, float) + 1.0
        return factor * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup**-1.5)

    return schedule


def noam_adam(
    d_model: int, factor: float = 1.0, warmup: int = 2000, *, b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9
) -> optax.GradientTransformation:
    """Chapter 10's optimizer: Adam (betas 0.9/0.98, eps 1e-9) under :func:`noam_schedule`.

    Same update as ``torch.optim.Adam`` with the rate set before each step: optax's
    ``lr * m̂ / (sqrt(v̂) + eps)`` equals torch's ``lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
    """
    return optax.adam(noam_schedule(d_model, factor, warmup), b1=b1, b2=b2, eps=eps)


def _squares_flattened(leaf: jax.Array) -> jax.Array:
    """The sum of ``leaf``'s squares, as a 1-D reduction of its flattened copy (in at least float32)."""
    flat = jax.lax.optimization_barrier(leaf.reshape(-1))  # (size,)
    flat = flat.astype(jnp.promote_types(flat.dtype, jnp.float32))
    return jnp.sum(flat * flat)


def _squares_in_place(leaf: jax.Array) -> jax.Array:
    """The sum of ``leaf``'s squares over its own shape (in at least float32): local however it is split."""
    leaf = jax.lax.optimization_barrier(leaf)
    leaf = leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
    return jnp.sum(leaf * leaf)


# The shardings of the gradients being clipped, while make_train_step traces its step (a pytree like them).
_GRADIENT_SHARDINGS: contextvars.ContextVar[Any] = contextvars.ContextVar("gradient_shardings", default=None)


def _flattening_is_local(leaf: jax.Array, sharding: Any) -> bool:
    """Whether ``leaf.reshape(-1)`` needs no communication: ``sharding`` splits at most its first axis."""
    if not isinstance(sharding, jax.sharding.Sharding) or not np.ndim(leaf):
        return True
    return tuple(sharding.shard_shape(np.shape(leaf)))[1:] == tuple(np.shape(leaf))[1:]


def global_norm(tree, shardings: Any = None) -> jax.Array:
    """``sqrt(sum of every leaf's squared entries)``, the value of ``optax.global_norm``.

    Each leaf's squares are summed behind an optimisation barrier, in at least float32, and
    the leaf is flattened first wherever that is a local operation. XLA:CPU lays some
    gradients out column-major (GPT-2's 768x50257 ``lm_head`` kernel, produced by a transposed
    matmul) and rewrites a sum over such a 2-D array into a padded 32x32 windowed reduction that
    runs single-threaded, a large share of a GPT-2 124M training step (benchmarks/RESULTS.md).
    Flattened (a copy only where the layout is not row-major), the sum is an ordinary 1-D
    reduction; on a TPU, too, the flattened sums hold less memory. But a leaf split along any
    axis but its first cannot be flattened in place: XLA gathers it whole onto every device
    for it. Such a leaf is summed in place. For GPT-2XL's scanned layers under FSDP, flattening
    held every layer's float32 gradient on every chip (``docs/tpu.md``).

    Args:
      tree: the arrays (traced or not).
      shardings: their shardings, a pytree like ``tree``; ``None``: the shardings of the
        gradients that :func:`make_train_step` is clipping, when it is tracing its step, else
        every leaf is taken to be whole on each device.
    """
    leaves = jax.tree.leaves(tree)
    shardings = _GRADIENT_SHARDINGS.get() if shardings is None else shardings
    placements = jax.tree.leaves(shardings) if shardings is not None else []
    if len(placements) != len(leaves):  # not these arrays' shardings (another tree): take each as whole
        placements = [None] * len(leaves)
    return jnp.sqrt(
        sum(
            _squares_flattened(leaf) if _flattening_is_local(leaf, sharding) else _squares_in_place(leaf)
            for leaf, sharding in zip(leaves, placements)
        )
    )


def clip_by_global_norm_like_torch(max_norm: float, eps: float = 1e-6) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_`` as an optax transformation: ``g * min(1, max_norm / (norm + eps))``.

    ``optax.clip_by_global_norm`` scales by ``max_norm / norm`` without the ``1e-6``;
    the two differ by ~1e-6 relative whenever clipping is active, which float64 parity
    of a training run would flag. Chapters 12 and 14 clip at 1.
    """

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        factor = jnp.minimum(1.0, max_norm / (norm + eps))
        return jax.tree.map(lambda g: (g * factor).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def gpt_adam(learning_rate: float = 1e-4, clip_norm: float = 1.0) -> optax.GradientTransformation:
    """Chapters 12 and 14's optimizer: clip the global gradient norm to 1 (as torch), then Adam(1e-4)."""
    return optax.chain(clip_by_global_norm_like_torch(clip_norm), optax.adam(learning_rate))


def label_smoothing_loss(
    log_probs: Float[Array, "*N V"],
    target: Int[Array, "*N"],
    *,
    padding_idx: int,
    smoothing: float = 0.1,
    debug_checks: bool = False,
) -> Float[Array, ""]:
    """Chapter 10's label-smoothed loss: ``KL(true_dist || p)`` summed over every token and class.

    ``true_dist`` gives the target class ``1 - smoothing``, every other class
    ``smoothing / (V - 2)`` (the target and the padding class are excluded), the padding
    class 0, and is all 0 on positions whose target is ``padding_idx``, which therefore
    add nothing. Summed like ``torch.nn.KLDivLoss(reduction="sum")``: ``sum(t log t - t
    log_probs)`` with ``0 log 0 = 0``; divide by the token count for the book's per-token
    loss. Unlike ``optax.smooth_labels`` + cross-entropy, the smoothing mass skips the
    padding class and the constant ``t log t`` (the target's entropy) is included.

    ``true_dist`` takes two values, so the sum is computed in closed form per position,
    without building the (tokens, V) target: the target's entropy (a constant) minus
    ``confidence * log_probs[target] + u * (sum(log_probs) - log_probs[target] -
    log_probs[padding_idx])``, ``u = smoothing / (V - 2)``. Equal to the book's sum up to
    float rounding; on non-finite ``log_probs`` the two can differ (``0 * -inf`` terms).

    Concrete targets outside ``[0, V)`` raise a ``ValueError`` (torch's ``scatter_`` fails on
    them); traced ones are checked only with ``debug_checks`` (:mod:`flax_ln.models.checks`),
    and otherwise make the loss NaN.

    Args:
      log_probs: log-probabilities, e.g. the :class:`~flax_ln.models.encoder_decoder.Generator` output.
      target: class ids in ``[0, V)``, the shape of ``log_probs`` without its last axis.
      padding_idx: the padding class id.
      smoothing: mass spread over the non-target classes, 0.1 in the book.
      debug_checks: check traced targets with ``jax.experimental.checkify``.
    """
    if target.shape != log_probs.shape[:-1] or not jnp.issubdtype(target.dtype, jnp.integer):
        raise ValueError(
            f"target: expected integer class ids of shape {log_probs.shape[:-1]} (log_probs without its last "
            f"axis), got shape {target.shape} dtype {target.dtype}."
        )
    size = log_probs.shape[-1]
    if size < 3:
        raise ValueError(
            f"label_smoothing_loss: needs at least 3 classes (the target, the padding class and one to smooth "
            f"over), got log_probs with {size} on its last axis."
        )
    check_id_values(target, "target", owner="label_smoothing_loss", vocab=size, debug=debug_checks)
    confidence, spread = 1.0 - smoothing, smoothing / (size - 2)
    entropy = _xlogx(confidence) + (size - 2) * _xlogx(spread)  # sum(t log t) of one non-padding position
    in_range = (target >= 0) & (target < size)
    at_target = jnp.take_along_axis(log_probs, jnp.clip(target, 0, size - 1)[..., None], axis=-1)[..., 0]  # (*N)
    at_target = jnp.where(in_range, at_target, jnp.nan)
    others = jnp.sum(log_probs, axis=-1) - at_target - log_probs[..., padding_idx]  # (*N)
    per_position = entropy - (confidence * at_target + spread * others)
    return jnp.sum(jnp.where(target == padding_idx, 0, per_position))


def _xlogx(value: float) -> float:
    """``value * log(value)`` with ``0 log 0 = 0``, in float64 on the host."""
    return value * math.log(value) if value > 0 else 0.0


def make_batch(src: Int[Array, "B S"], tgt: Int[Array, "B T+1"], pad: int) -> dict[str, jax.Array]:
    """The book's ``Batch``: decoder input ``tgt[:, :-1]``, labels ``tgt[:, 1:]``, both masks and the token count."""
    tgt_in, tgt_y = tgt[:, :-1], tgt[:, 1:]
    return {
        "src": src,
        "src_mask": make_src_mask(src, pad),
        "tgt": tgt_in,
        "tgt_y": tgt_y,
        "tgt_mask": make_std_mask(tgt_in, pad),
        "ntokens": jnp.sum(tgt_y != pad),
    }


def encoder_decoder_loss(padding_idx: int, smoothing: float = 0.1) -> LossFn:
    """Chapter 10's per-token loss for a :func:`make_batch` batch: label-smoothed KL sum / ``ntokens``."""

    def loss_fn(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
        out = model(batch["src"], batch["tgt"], batch["src_mask"], batch["tgt_mask"])
        log_probs = model.generator(out)  # type: ignore[attr-defined]  # an encoder-decoder Transformer's head
        loss = label_smoothing_loss(log_probs, batch["tgt_y"], padding_idx=padding_idx, smoothing=smoothing)
        return loss / batch["ntokens"]

    return loss_fn


def gpt_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    """Chapters 11-14's loss: the GPT's own cross-entropy of ``batch["idx"]`` against ``batch["targets"]``."""
    return model(batch["idx"], batch["targets"])[1]


class TrainState(NamedTuple):
    """Everything a step updates: trainable ``params``, the ``rest`` (buffers, dropout RNG counters), ``opt_state``."""

    params: nnx.State
    rest: nnx.State
    opt_state: optax.OptState


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, TrainState]:
    """Split ``model`` once into its static graph and a :class:`TrainState`; ``tx`` sees only ``nnx.Param``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]  # split's result is typed as a variadic tuple
    return graphdef, TrainState(params, rest, tx.init(params))


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    donate: bool = True,
    state_sharding: Any = None,
    batch_sharding: Any = None,
) -> Callable[[nnx.GraphDef, TrainState, Batch], tuple[TrainState, jax.Array]]:
    """A jitted ``step(graphdef, state, batch) -> (state, loss)`` for any loss and optax transformation.

    Inside the jit the model is rebuilt with ``nnx.merge``, ``loss_fn(model, batch)`` is
    differentiated with respect to the parameters, and ``tx`` is applied. Dropout runs
    as the model was split (``model.train()`` / ``model.eval()`` beforehand); its RNG
    counters advance and come back in ``state.rest``. ``graphdef`` is static, so the step
    compiles once per model structure and batch shape.

    Args:
      loss_fn: ``(model, batch) -> scalar loss``.
      tx: the optax transformation (e.g. :func:`noam_adam`, or clip + Adam for a GPT).
      donate: donate the input state's buffers to the output (do not reuse ``state`` after the call).
      state_sharding: shardings of the state, a pytree like it (e.g.
        :func:`flax_ln.sharding.state_shardings`); the step takes and returns the state so
        placed. ``None``: as the input arrays are placed (NumPy inputs: replicated). Given as a
        :class:`TrainState` of shardings, the parameters that it splits along an axis other than
        their largest are gathered whole where the loss uses them
        (:func:`flax_ln.sharding.gather_uneven_parameters`), each gradient is constrained
        to its parameter's sharding, and :func:`global_norm` is told those shardings.
      batch_sharding: sharding of the batch (a prefix of it, e.g. one ``NamedSharding``
        for every array); ``None``: as the input arrays are placed.
    """

    def step(graphdef: nnx.GraphDef, state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
        def loss_of(params):
            if isinstance(state_sharding, TrainState):
                params = gather_uneven_parameters(params, state_sharding.params)
            # copy=True: fresh Variables at this trace level, so dropout may advance its RNG counters
            model = nnx.merge(graphdef, params, state.rest, copy=True)
            loss = loss_fn(model, batch)
            return loss, nnx.split(model, nnx.Param, ...)[2]  # type: ignore[misc]  # as in init_train_state

        (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        param_shardings = state_sharding.params if isinstance(state_sharding, TrainState) else None
        if param_shardings is not None:
            # each gradient split as its parameter is: left to propagation, XLA chose other layouts too,
            # which held more per chip (GPT-2 124M on v5e:2x4, fsdp 8, norm in place: 1.16 -> 1.01 GiB)
            grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        token = _GRADIENT_SHARDINGS.set(param_shardings)
        try:  # global_norm reads how the gradients are split
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
        finally:
            _GRADIENT_SHARDINGS.reset(token)
        return TrainState(optax.apply_updates(state.params, updates), rest, opt_state), loss

    donate_argnums = (1,) if donate else ()
    if state_sharding is None and batch_sharding is None:
        return jax.jit(step, static_argnums=0, donate_argnums=donate_argnums)
    return jax.jit(
        step,
        static_argnums=0,
        donate_argnums=donate_argnums,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
    )
