"""Scaled dot-product attention shared by the encoder-decoder and the GPT attention modules."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def split_heads(x: Float[Array, "B T C"], num_heads: int) -> Float[Array, "B nh T hs"]:
    """Split the last axis into ``num_heads`` heads: (B, T, C) -> (B, nh, T, C // nh)."""
    batch, length, width = x.shape
    x = x.reshape(batch, length, num_heads, width // num_heads)  # (B, T, nh, hs)
    return x.transpose(0, 2, 1, 3)  # (B, nh, T, hs)


def merge_heads(x: Float[Array, "B nh T hs"]) -> Float[Array, "B T C"]:
    """Inverse of :func:`split_heads`: (B, nh, T, hs) -> (B, T, nh * hs)."""
    batch, num_heads, length, head_size = x.shape
    x = x.transpose(0, 2, 1, 3)  # (B, T, nh, hs)
    return x.reshape(batch, length, num_heads * head_size)  # (B, T, C)


def scaled_dot_product_attention(
    q: Float[Array, "B nh Tq hs"],
    k: Float[Array, "B nh Tk hs"],
    v: Float[Array, "B nh Tk hs"],
    mask: Bool[Array, "..."] | None,
    *,
    mask_value: float,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
    precision=None,
) -> Float[Array, "B nh Tq hs"]:
    """``softmax(where(mask, q kᵀ / sqrt(hs), mask_value)) v``, with optional dropout on the probabilities.

    ``mask`` broadcasts to ``(B, nh, Tq, Tk)`` and is True where a key may be attended
    to. The book's encoder-decoder fills masked scores with ``-1e9`` (a fully masked
    row then attends uniformly, as in torch); its GPT fills with ``-inf``. Scores and the
    softmax are computed in at least float32; the result has the dtype of ``v``.
    """
    compute_dtype = jnp.promote_types(q.dtype, jnp.float32)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=precision, preferred_element_type=compute_dtype)
    scores = scores / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.asarray(mask_value, compute_dtype))
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout is not None:
        probs = dropout(probs)
    return jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v, precision=precision)
