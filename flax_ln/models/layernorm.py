"""Layer normalisation in Flax NNX: the book's chapter-9 LayerNorm and a torch ``nn.LayerNorm`` twin.

Both modules share :func:`normalize`; they differ only in the variance divisor
(unbiased ``n - 1`` for the book, biased ``n`` for torch), their default ``eps``
and their parameter names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float


def _check_features(x: jax.Array, features: int, module: str) -> None:
    if x.ndim < 1 or x.shape[-1] != features:
        raise ValueError(
            f"{module}: expected input x with last axis of size {features} (features), "
            f"got shape {tuple(x.shape)}. Reshape the input or build the module with "
            f"features={x.shape[-1] if x.ndim else '...'}."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{module}: expected a floating-point input x, got dtype {x.dtype}. "
            "Cast it first, e.g. x.astype(jnp.float32)."
        )


def _statistics(x: jax.Array, ddof: int) -> tuple[jax.Array, jax.Array]:
    """Mean and two-pass variance ``sum((x - mean)**2) / (n - ddof)`` over the last axis."""
    n = x.shape[-1]
    mean = jnp.mean(x, axis=-1, keepdims=True)  # (..., 1)
    centered = x - mean
    var = jnp.sum(centered * centered, axis=-1, keepdims=True) / (n - ddof)  # (..., 1)
    return mean, var


def _normalize_forward(x, scale, offset, eps, ddof):
    """The book's formula on ``x`` already in the compute dtype."""
    mean, var = _statistics(x, ddof)
    # Same association as the book: (scale * centered) / sqrt(var + eps) + offset.
    return scale * (x - mean) / jnp.sqrt(var + eps) + offset


def _affine_normalize_fwd(x, scale, offset, eps, ddof):
    # Residuals are only the input (alive anyway) and the scale: the backward
    # recomputes the row statistics, two row reductions instead of stored temporaries.
    return _normalize_forward(x, scale, offset, eps, ddof), (x, scale)


def _affine_normalize_bwd(eps, ddof, residuals, g):
    """Hand-written VJP. With ``c = x - mean``, ``r = 1/sqrt(var + eps)``, ``h = g * scale``::

        d_offset = sum_rows(g)        d_scale = sum_rows(g * c * r)
        d_x = r * (h - mean(h)) - c * r**3 * sum(h * c) / (n - ddof)

    (the variance's derivative is ``2 c / (n - ddof)`` because ``sum(c) = 0``).

    The two ``optimization_barrier`` calls play the part they play in
    ``jax.checkpoint``: they stop XLA from merging these recomputed statistics with
    the forward pass's or with each other. Merged, ``x - mean`` and the broadcasts
    gained several consumers and XLA's CPU backend stored them as full-size
    temporaries (128 MB for a float32 8192x1024 forward+backward under autodiff);
    apart, the forward output, ``d_x`` and ``(d_scale, d_offset)`` are each computed
    with no full-size temporary (benchmarks/RESULTS.md). The backward is itself
    plain JAX, so it can be differentiated again (``jax.jacrev`` of ``jax.grad``).
    """
    n = g.shape[-1]
    x, scale = jax.lax.optimization_barrier(residuals)
    mean, var = _statistics(x, ddof)
    r = jax.lax.rsqrt(var + eps)  # (..., 1)
    h = g * scale
    h_sum = jnp.sum(h, axis=-1, keepdims=True)  # (..., 1)
    hc_sum = jnp.sum(h * (x - mean), axis=-1, keepdims=True)  # (..., 1)
    dx = h * r + (x - mean) * (-(r**3) * hc_sum / (n - ddof)) - r * h_sum / n

    x, g = jax.lax.optimization_barrier((x, g))
    mean, var = _statistics(x, ddof)
    rows = tuple(range(g.ndim - 1))
    # (g * r) * (x - mean), not g * (x - mean) * r: the same product, but XLA's CPU
    # backend gives the latter column reduction a full-size scratch buffer.
    d_scale = jnp.sum((g * jax.lax.rsqrt(var + eps)) * (x - mean), axis=rows)
    d_offset = jnp.sum(g, axis=rows)
    return dx, d_scale, d_offset


_affine_normalize = jax.custom_vjp(_normalize_forward, nondiff_argnums=(3, 4))
_affine_normalize.defvjp(_affine_normalize_fwd, _affine_normalize_bwd)


def normalize(
    x: jax.Array,
    scale: jax.Array,
    offset: jax.Array,
    *,
    eps: float,
    ddof: int,
    robust: bool = False,
    dtype=None,
) -> jax.Array:
    """Normalise over the last axis: ``scale * (x - mean) / sqrt(var + eps) + offset``.

    ``var = sum((x - mean)**2) / (n - ddof)`` is a two-pass variance computed in at
    least float32 (``promote_types(x.dtype, float32)``), so half-precision inputs never
    accumulate in half precision. The result is cast to ``dtype`` last; ``dtype=None``
    follows flax's convention, the result type of ``x``, ``scale`` and ``offset``.

    With ``robust=True`` each row is first shifted by its first element (a value
    inside the row's range, held constant for the gradient). The output is
    mathematically unchanged, but the mean and variance are then taken of small
    numbers, which keeps rows whose mean is large relative to their spread accurate.

    Reverse-mode derivatives (``jax.grad``, ``jax.vjp``, ``jax.jacrev``, also nested)
    use a hand-written VJP that recomputes the statistics instead of storing
    intermediates. Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) is not
    available through it, as for any ``jax.custom_vjp``; use ``jax.jacrev(jax.jacrev(f))``
    for second derivatives.
    """
    out_dtype = dtype if dtype is not None else jnp.result_type(x, scale, offset)
    compute_dtype = jnp.promote_types(x.dtype, jnp.float32)
    xc = x.astype(compute_dtype)
    if robust:
        xc = xc - jax.lax.stop_gradient(xc[..., :1])
    y = _affine_normalize(xc, scale.astype(compute_dtype), offset.astype(compute_dtype), eps, ddof)
    return y.astype(out_dtype)


class LayerNorm(nnx.Module):
    """The book's chapter-9 LayerNorm: ``a_2 * (x - mean) / sqrt(std**2 + eps) + b_2``.

    ``std`` is the *unbiased* standard deviation over the last axis (divisor n - 1),
    and ``eps`` is added to the unbiased variance inside the square root.

    How it differs from its look-alikes:

    * ``torch.nn.LayerNorm`` / :class:`TorchLayerNorm`: biased variance, eps 1e-5.
    * The Annotated Transformer: ``(x - mean) / (std + eps)``, eps outside the root.
    * ``flax.nnx.LayerNorm``: biased variance via the fast ``E[x^2] - E[x]^2``.

    With ``features == 1`` the unbiased variance is 0/0, so the output is NaN, exactly
    as in PyTorch. Statistics are computed in at least float32 and the result is cast
    to the output dtype last.

    Args:
      features: size of the last axis.
      eps: added to the unbiased variance, default 1e-6.
      robust: shift each row before taking statistics (see :func:`normalize`). Off by
        default, so the default mirrors the book.
      dtype: output dtype; ``None`` infers it from the input and parameters.
      param_dtype: dtype of ``a_2`` and ``b_2``.
      rngs: accepted for a uniform constructor; the parameters are deterministic.
    """

    def __init__(
        self,
        features: int,
        eps: float = 1e-6,
        *,
        robust: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        self.features = features
        self.eps = eps
        self.robust = robust
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.a_2 = nnx.Param(jnp.ones((features,), param_dtype))
        self.b_2 = nnx.Param(jnp.zeros((features,), param_dtype))

    def __call__(self, x: Float[Array, "*batch features"]) -> Float[Array, "*batch features"]:
        _check_features(x, self.features, "LayerNorm")
        return normalize(
            x, self.a_2[...], self.b_2[...], eps=self.eps, ddof=1, robust=self.robust, dtype=self.dtype
        )


class TorchLayerNorm(nnx.Module):
    """A twin of ``torch.nn.LayerNorm(features)``: ``scale * (x - mean) / sqrt(var + eps) + bias``.

    ``var`` is the *biased* variance (divisor n), computed two-pass, unlike
    ``flax.nnx.LayerNorm``'s fast ``E[x^2] - E[x]^2``. Default eps 1e-5, as torch.
    Used by the GPT blocks (``ln_1``, ``ln_2``, ``ln_f``). Parameters follow flax
    naming: ``scale`` is torch's ``weight``, ``bias`` is torch's ``bias``.

    Args:
      features: size of the last axis.
      eps: added to the biased variance, default 1e-5.
      robust: shift each row before taking statistics (see :func:`normalize`).
      dtype: output dtype; ``None`` infers it from the input and parameters.
      param_dtype: dtype of ``scale`` and ``bias``.
      rngs: accepted for a uniform constructor; the parameters are deterministic.
    """

    def __init__(
        self,
        features: int,
        eps: float = 1e-5,
        *,
        robust: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        self.features = features
        self.eps = eps
        self.robust = robust
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype))

    def __call__(self, x: Float[Array, "*batch features"]) -> Float[Array, "*batch features"]:
        _check_features(x, self.features, "TorchLayerNorm")
        return normalize(
            x, self.scale[...], self.bias[...], eps=self.eps, ddof=0, robust=self.robust, dtype=self.dtype
        )
