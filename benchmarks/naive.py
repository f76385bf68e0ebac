"""The naive baseline both benchmark scripts compare against."""

import jax.numpy as jnp


def naive_normalize(x, scale, offset, eps=1e-6, ddof=1):
    """flax_ln's code path before issue 6: the book's formula, left to JAX autodiff and XLA."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = jnp.sum(centered * centered, axis=-1, keepdims=True) / (x.shape[-1] - ddof)
    return scale * centered / jnp.sqrt(var + eps) + offset
