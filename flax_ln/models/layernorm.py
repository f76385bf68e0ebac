"""Layer normalisation in Flax NNX: the book's chapter-9 LayerNorm and a torch ``nn.LayerNorm`` twin.

Both modules share :func:`normalize`; they differ only in the variance divisor
(unbiased ``n - 1`` for the book, biased ``n`` for torch), their default ``eps``
and their parameter names.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float


def _check_features_argument(features, module: str) -> int:
    """``features`` as an int after checking it is a positive integer (bools refused)."""
    if isinstance(features, bool) or not isinstance(features, numbers.Integral):
        raise TypeError(
            f"{module}: features must be a positive int (the size of the last axis), "
            f"got {features!r} of type {type(features).__name__}; pass e.g. features=512"
        )
    if features < 1:
        raise ValueError(f"{module}: features must be a positive int (the size of the last axis), got {features!r}")
    return int(features)


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


def _row_statistics(x: jax.Array, eps: float, ddof: int):
    """``(mean, correction, sigma)``, each (..., 1): the corrected two-pass statistics of each row.

    ``mean`` is the row's mean as float32 computes it; ``correction = sum(x - mean) / n``
    is that mean's rounding error, measured on the row; the centred row is ``(x - mean) -
    correction`` (:func:`_centered`), ``var = sum(centred**2) / (n - ddof)`` and ``sigma =
    sqrt(var + eps)``.

    Why the correction: on a row whose mean is large against its spread, the rounding of
    ``mean`` is large against the spread too, and plain two-pass (and torch's kernels)
    subtract that same error from every element, which is what limits them on such rows.
    Here ``x - mean`` is exact (Sterbenz: each element lies within a factor of two of the
    mean on such rows) and ``correction``, a mean of small numbers, takes the error out to
    a few roundings of the spread. On a well-conditioned row the correction is a rounding
    of zero and changes nothing. Unlike a pivot taken from a few elements of the row, the
    row's own mean cannot sit far outside it, so no row is less accurate than plain
    two-pass.

    ``mean`` is held constant for differentiation (the centred row does not depend on it:
    shift invariance); ``correction`` and ``sigma`` are differentiable, so rules built on
    them can be differentiated again (Hessians).
    """
    n = x.shape[-1]
    mean = jax.lax.stop_gradient(jnp.mean(x, axis=-1, keepdims=True))  # (..., 1)
    deviations = x - mean
    correction = jnp.sum(deviations, axis=-1, keepdims=True) / n  # (..., 1)
    centered = deviations - correction
    var = jnp.sum(centered * centered, axis=-1, keepdims=True) / (n - ddof)  # (..., 1)
    return mean, correction, jnp.sqrt(var + eps)


def _centered(x, mean, correction):
    """``x - mean`` as ``(x - rounded mean) - correction``: the association that keeps it accurate."""
    return (x - mean) - correction


def _normalize_forward(x, scale, offset, eps, ddof):
    """The book's formula on ``x``, ``scale`` and ``offset`` already in the compute dtype."""
    mean, correction, sigma = _row_statistics(x, eps, ddof)
    # Same association as the book: (scale * centered) / sqrt(var + eps) + offset.
    return scale * _centered(x, mean, correction) / sigma + offset


_affine_normalize = jax.custom_jvp(_normalize_forward, nondiff_argnums=(3, 4))


@_affine_normalize.defjvp
def _affine_normalize_jvp(eps, ddof, primals, tangents):
    """Hand-written JVP; reverse mode transposes it. With ``x̂ = (x - mean) / σ``,
    ``σ = sqrt(var + eps)`` and ``m(v) = sum(v) / (n - ddof)``::

        dy = dscale * x̂ + doffset + (scale / σ) * (dx - mean(dx) - x̂ * m(x̂ * dx))

    (``m(x̂ * dx)`` equals ``m(x̂ * (dx - mean(dx)))`` because ``sum(x̂) = 0``).

    The two tangent terms that need ``x̂`` are each a ``jax.checkpoint`` of ``x``: in
    reverse mode the backward pass keeps only ``x`` (alive anyway) and ``scale``, and
    recomputes the row statistics inside each of its two kernels, ``d_scale =
    sum_rows(g * x̂)`` and ``d_x``, where they cost three row reductions of data the
    kernel reads anyway. Their optimisation barriers keep XLA from sharing ``x̂`` or the
    statistics between kernels, which made XLA:CPU store ``x - mean`` or ``x̂`` as
    full-size temporaries (32-64 MB for a float32 8192x1024 forward+backward). Plain
    autodiff of the forward code would also differentiate the rounded mean (zero
    derivative).
    The rule is plain JAX, so it can be differentiated again in either mode
    (``jax.hessian``, Hessian-vector products): the statistics inside it are
    differentiable functions of ``x``.
    """
    x, scale, offset = primals
    dx, dscale, doffset = tangents
    y = _normalize_forward(x, scale, offset, eps, ddof)
    return y, _scale_tangent(eps, ddof, x, dscale) + doffset + _input_tangent(eps, ddof, x, scale, dx)


def _normalized(x, eps: float, ddof: int):
    """``(x̂, 1/σ)``: the normalised rows ``(x - mean) / σ`` and ``1/σ`` per row, (..., 1).

    For the derivatives only: multiplying by ``1/σ`` is one rounding more than the
    forward's division, and cheaper than a division per element.
    """
    mean, correction, sigma = _row_statistics(x, eps, ddof)
    inv_sigma = 1 / sigma  # (..., 1)
    return _centered(x, mean, correction) * inv_sigma, inv_sigma


@functools.partial(jax.checkpoint, static_argnums=(0, 1))
def _scale_tangent(eps, ddof, x, dscale):
    """``dscale * x̂``, recomputed from ``x`` in the backward pass."""
    return dscale * _normalized(x, eps, ddof)[0]


@functools.partial(jax.checkpoint, static_argnums=(0, 1))
def _input_tangent(eps, ddof, x, scale, dx):
    """``(scale / σ) * (dx - mean(dx) - x̂ * m(x̂ * dx))``, recomputed from ``x`` in the backward pass."""
    n = x.shape[-1]
    x_hat, inv_sigma = _normalized(x, eps, ddof)
    projection = jnp.sum(x_hat * dx, axis=-1, keepdims=True) / (n - ddof)  # (..., 1)
    dx_centered = dx - jnp.mean(dx, axis=-1, keepdims=True)
    return scale * inv_sigma * (dx_centered - x_hat * projection)


def normalize(
    x: jax.Array,
    scale: jax.Array,
    offset: jax.Array,
    *,
    eps: float,
    ddof: int,
    dtype=None,
) -> jax.Array:
    """Normalise over the last axis: ``scale * (x - mean) / sqrt(var + eps) + offset``.

    ``var = sum((x - mean)**2) / (n - ddof)``, a two-pass variance computed in at least
    float32 (``promote_types(x.dtype, float32)``), so half-precision inputs never
    accumulate in half precision. The result is cast to ``dtype`` last; ``dtype=None``
    follows flax's convention, the result type of ``x``, ``scale`` and ``offset``.

    The statistics are the corrected two-pass ones (see :func:`_row_statistics`): one
    row reduction more than the plain two-pass algorithm, in the same fused kernel on
    XLA:CPU, and accurate to a few roundings on rows whose mean is large against their
    spread, where the plain algorithm and torch lose digits to the rounding of the mean.

    Derivatives come from a ``jax.custom_jvp`` rule (:func:`_affine_normalize_jvp`),
    so every transformation applies: ``jax.grad``/``vjp``/``jacrev`` (by transposing
    the rule), ``jax.jvp``/``jacfwd``/``linearize``, ``jax.hessian``, ``vmap``,
    ``scan`` and ``checkpoint``, nested in any order.
    """
    out_dtype = dtype if dtype is not None else jnp.result_type(x, scale, offset)
    compute_dtype = jnp.promote_types(x.dtype, jnp.float32)
    y = _affine_normalize(x.astype(compute_dtype), scale.astype(compute_dtype), offset.astype(compute_dtype), eps, ddof)
    return y.astype(out_dtype)


_ACCURACY_NOTE = """
    Statistics are computed in at least float32 and the result is cast to the output
    dtype last. They are accurate to a few roundings whatever a row's mean is against
    its spread (see :func:`normalize`), where torch's kernels lose digits to the
    rounding of the mean: against float64 truth the flax error is never above torch's
    (or a few float32 roundings, whichever is larger).

    Rows whose squared deviations from the mean overflow float32 (values beyond about
    1e19) get an infinite variance and normalise to ``offset``, as the book's torch
    formula does (``torch.nn.LayerNorm`` gives NaN). Scaling such rows down before
    squaring would cost an extra multiply per element on every row.
"""


class LayerNorm(nnx.Module):  # noqa: D101 - the docstring is assembled below (__doc__)
    __doc__ = (
        """The book's chapter-9 LayerNorm: ``a_2 * (x - mean) / sqrt(std**2 + eps) + b_2``.

    ``std`` is the *unbiased* standard deviation over the last axis (divisor n - 1),
    and ``eps`` is added to the unbiased variance inside the square root.

    How it differs from its look-alikes:

    * ``torch.nn.LayerNorm`` / :class:`TorchLayerNorm`: biased variance, eps 1e-5.
    * The Annotated Transformer: ``(x - mean) / (std + eps)``, eps outside the root.
    * ``flax.nnx.LayerNorm``: biased variance via the fast ``E[x^2] - E[x]^2``.

    With ``features == 1`` the unbiased variance is 0/0, so the output is NaN, exactly
    as in PyTorch.
"""
        + _ACCURACY_NOTE
        + """
    Args:
      features: size of the last axis, a positive int.
      eps: added to the unbiased variance, default 1e-6.
      dtype: output dtype; ``None`` infers it from the input and parameters.
      param_dtype: dtype of ``a_2`` and ``b_2``.
      rngs: accepted for a uniform constructor; the parameters are deterministic.
    """
    )

    def __init__(
        self,
        features: int,
        eps: float = 1e-6,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        self.features = _check_features_argument(features, "LayerNorm")
        self.eps = eps
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.a_2 = nnx.Param(jnp.ones((self.features,), param_dtype))
        self.b_2 = nnx.Param(jnp.zeros((self.features,), param_dtype))

    def __call__(self, x: Float[Array, "*batch features"]) -> Float[Array, "*batch features"]:
        _check_features(x, self.features, "LayerNorm")
        return normalize(x, self.a_2[...], self.b_2[...], eps=self.eps, ddof=1, dtype=self.dtype)


class TorchLayerNorm(nnx.Module):  # noqa: D101 - the docstring is assembled below (__doc__)
    __doc__ = (
        """A twin of ``torch.nn.LayerNorm(features)``: ``scale * (x - mean) / sqrt(var + eps) + bias``.

    ``var`` is the *biased* variance (divisor n), computed two-pass, unlike
    ``flax.nnx.LayerNorm``'s fast ``E[x^2] - E[x]^2``. Default eps 1e-5, as torch.
    Used by the GPT blocks (``ln_1``, ``ln_2``, ``ln_f``). Parameters follow flax
    naming: ``scale`` is torch's ``weight``, ``bias`` is torch's ``bias``.
"""
        + _ACCURACY_NOTE
        + """
    Args:
      features: size of the last axis, a positive int.
      eps: added to the biased variance, default 1e-5.
      dtype: output dtype; ``None`` infers it from the input and parameters.
      param_dtype: dtype of ``scale`` and ``bias``.
      rngs: accepted for a uniform constructor; the parameters are deterministic.
    """
    )

    def __init__(
        self,
        features: int,
        eps: float = 1e-5,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        self.features = _check_features_argument(features, "TorchLayerNorm")
        self.eps = eps
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.scale = nnx.Param(jnp.ones((self.features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((self.features,), param_dtype))

    def __call__(self, x: Float[Array, "*batch features"]) -> Float[Array, "*batch features"]:
        _check_features(x, self.features, "TorchLayerNorm")
        return normalize(x, self.scale[...], self.bias[...], eps=self.eps, ddof=0, dtype=self.dtype)
