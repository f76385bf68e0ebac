"""The book's masks and greedy decoding for the encoder-decoder :class:`~flax_ln.Transformer`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Int

from flax_ln.models.checks import check_scalar_id
from flax_ln.models.encoder_decoder.model import Transformer


def subsequent_mask(size: int) -> Bool[Array, "1 size size"]:
    """(1, size, size) boolean mask, True on and below the diagonal: position i may attend to j <= i."""
    return jnp.tril(jnp.ones((1, size, size), jnp.bool_))


def make_std_mask(tgt: Int[Array, "B T"], pad: int) -> Bool[Array, "B T T"]:
    """The target mask of the book's batches: not padding AND causal, shape (B, T, T)."""
    return (tgt != pad)[:, None, :] & subsequent_mask(tgt.shape[-1])  # (B, T, T)


def make_src_mask(src: Int[Array, "B S"], pad: int) -> Bool[Array, "B 1 S"]:
    """The source mask of the book's batches: ``(src != pad)[:, None, :]``, shape (B, 1, S)."""
    return (src != pad)[:, None, :]  # (B, 1, S)


def greedy_decode(
    model: Transformer, src: Int[Array, "B S"], src_mask: Bool[Array, "#B 1 S"], max_len: int, start_symbol: int
) -> Int[Array, "B max_len"]:
    """Greedy decoding, the book's ``greedy_decode``: ``max_len`` tokens, starting with ``start_symbol``.

    ``memory = model.encode(src, src_mask)`` once, then for ``i = 0 .. max_len - 2`` the
    token at ``i + 1`` is ``argmax model.generator(model.decode(memory, src_mask, ys,
    causal)[:, i])``. Unlike the book's loop, which grows ``ys`` by one column per step,
    ``ys`` is a fixed (B, max_len) buffer decoded under the causal mask, so the whole loop
    is one ``jax.jit`` with a ``lax.fori_loop`` (compiled once per model structure, batch
    shape and ``max_len``); positions after ``i`` are masked with -1e9 and get exactly
    zero attention weight, so each step sees what the book's would. Decoding does not
    stop at an end-of-sequence token: cut each row at the first one. Dropout is off,
    whatever the model's mode; ``model`` is not modified.

    Args:
      model: a :class:`Transformer` (e.g. from :func:`make_model`).
      src: source token ids in ``[0, src_vocab)``, (B, S).
      src_mask: source mask, e.g. :func:`make_src_mask` (B, 1, S).
      max_len: length of the output, start symbol included (>= 1).
      start_symbol: the first target token, an int in ``[0, tgt_vocab)`` (the book's 1; a begin-of-sequence id).

    Returns:
      (B, max_len) token ids in ``src``'s dtype; column 0 is ``start_symbol``.
    """
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError(f"greedy_decode: max_len must be an int >= 1, got {max_len!r}")
    src_mask = jnp.asarray(src_mask)
    src = model._check_encode(src, src_mask, "greedy_decode")  # clear errors before tracing
    start_symbol = check_scalar_id(start_symbol, "start_symbol", owner="greedy_decode", vocab=model.tgt_embed[0].vocab)
    if max_len > model.tgt_embed[1].max_len:
        raise ValueError(
            f"greedy_decode: max_len={max_len} exceeds the positional table ({model.tgt_embed[1].max_len} positions)"
        )
    graphdef, state = nnx.split(model)
    return _greedy_decode(graphdef, state, src, src_mask, jnp.asarray(start_symbol, src.dtype), max_len=max_len)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _greedy_decode(graphdef, state, src, src_mask, start_symbol, *, max_len):
    def model(state):  # merged afresh inside each traced scope; the loop gets `state` through its carry
        m = nnx.merge(graphdef, state)
        m.eval()
        return m

    memory = model(state)._encode(src, src_mask)  # (B, S, d_model); greedy_decode checked the inputs
    ys = jnp.full((src.shape[0], max_len), start_symbol, src.dtype)  # (B, max_len)
    tgt_mask = subsequent_mask(max_len)  # (1, max_len, max_len)

    def step(i, carry):
        ys, state = carry
        m = model(state)
        out = m._decode(memory, src_mask, ys, tgt_mask)  # (B, max_len, d_model)
        h = jax.lax.dynamic_index_in_dim(out, i, axis=1, keepdims=False)  # (B, d_model)
        token = jnp.argmax(m.generator(h), axis=-1).astype(ys.dtype)  # (B,)
        return jax.lax.dynamic_update_index_in_dim(ys, token, i + 1, axis=1), state

    return jax.lax.fori_loop(0, max_len - 1, step, (ys, state))[0]
