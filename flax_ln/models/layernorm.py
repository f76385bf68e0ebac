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
        raise ValueError(
            f"{module}: features must be a positive int (the size of the last axis), got {features!r}"
        )
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


# Rows whose magnitude (the larger of |first element| and |mean|) exceeds this are scaled down
# to it before squaring; below it the scale is exactly 1 and changes no rounding.
_SCALE_THRESHOLD = 2.0**40


def _scaled_statistics(x: jax.Array, ddof: int):
    """Centred, scaled rows, their variance and the scale: ``((x - mean) * k, var * k**2, k)``.

    The two-pass algorithm with two cheap changes, each a few element-wise operations
    inside the same fused kernel (XLA:CPU keeps the whole normalisation in one), that
    make it accurate to a few roundings whatever a row's mean is against its spread:

    1. **Shift and correct.** ``mean0 = pivot + mean(x - pivot)`` with ``pivot =
       x[..., :1]``, then ``c = x - mean0`` and ``c -= mean(c)``. A float32 mean is at
       best ``ulp(mean) / 2`` from the truth, and on a row whose mean is large against
       its spread that error, shared by every ``x - mean``, is what limits the plain
       two-pass algorithm and torch's kernels. Here ``x - mean0`` is exact (Sterbenz)
       on such rows, so ``mean(c)`` recovers the mean's error from small numbers. The
       pivot makes ``x - pivot`` and ``mean0`` accurate to begin with; the sum is taken
       at the pivot's scale (the ``k`` below, from ``|pivot|`` alone) so that it cannot
       overflow.
    2. **Scale.** ``c`` is multiplied by ``k = T / max(magnitude, T)`` with
       ``magnitude = max(|pivot|, |mean0|)`` and ``T = 2**40``: ``k`` is exactly 1
       below ``T``, and above it keeps ``c**2`` finite for rows up to the float32
       maximum (``x * 1e30``). The normalised row ``c / sqrt(var + eps * k**2)`` does
       not depend on ``k``.

    ``pivot``, the correction ``mean(c)`` and ``k`` are held constant for
    differentiation: the normalised row does not depend on them mathematically (shift
    and scale invariance; the correction is a rounding error), so its derivatives are
    those of the book's formula. A row whose squares overflow even after scaling
    (values beyond 1e17, with a first element and a mean both below about 1e-5 of the
    row's spread) gets an infinite variance, and its normalised row is 0 or NaN.
    """
    n = x.shape[-1]
    pivot = jax.lax.stop_gradient(x[..., :1])  # (..., 1)
    # Summed at the pivot's scale (1 below T), so that the sum cannot overflow near the float maximum.
    pivot_scale = _SCALE_THRESHOLD / jnp.maximum(jnp.abs(pivot), _SCALE_THRESHOLD)  # (..., 1)
    mean0 = pivot + jnp.sum((x - pivot) * pivot_scale, axis=-1, keepdims=True) / (n * pivot_scale)
    magnitude = jax.lax.stop_gradient(jnp.maximum(jnp.abs(pivot), jnp.abs(mean0)))
    k = _SCALE_THRESHOLD / jnp.maximum(magnitude, _SCALE_THRESHOLD)  # (..., 1)
    centered = (x - mean0) * k
    centered = centered - jax.lax.stop_gradient(jnp.mean(centered, axis=-1, keepdims=True))
    var = jnp.sum(centered * centered, axis=-1, keepdims=True) / (n - ddof)  # (..., 1)
    return centered, var, k


def _normalize_forward(x, scale, offset, eps, ddof):
    """The book's formula on ``x``, ``scale`` and ``offset`` already in the compute dtype."""
    centered, var, k = _scaled_statistics(x, ddof)
    # Same association as the book: (scale * centered) / sqrt(var + eps) + offset.
    return scale * centered / jnp.sqrt(var + eps * k * k) + offset


_affine_normalize = jax.custom_jvp(_normalize_forward, nondiff_argnums=(3, 4))


@_affine_normalize.defjvp
def _affine_normalize_jvp(eps, ddof, primals, tangents):
    """Hand-written JVP; reverse mode transposes it. With ``x̂ = (x - mean) / σ``,
    ``σ = sqrt(var + eps)`` and ``m(v) = sum(v) / (n - ddof)``::

        dy = dscale * x̂ + doffset + (scale / σ) * (dx - mean(dx) - x̂ * m(x̂ * dx))

    (``m(x̂ * dx)`` equals ``m(x̂ * (dx - mean(dx)))`` because ``sum(x̂) = 0``).

    The two tangent terms that need ``x̂`` are each a ``jax.checkpoint`` of ``x``: in
    reverse mode the backward pass keeps only ``x`` (alive anyway) and ``scale`` and
    recomputes the row statistics inside each of its two kernels, ``d_scale =
    sum_rows(g * x̂)`` and ``d_x``. Their optimisation barriers keep XLA from sharing
    the recomputed ``x̂`` between the two, which made XLA:CPU store it (and ``x -
    mean``) as full-size temporaries: 32-64 MB for a float32 8192x1024 forward+backward
    against 0.2 MB this way. Plain autodiff of the forward code would also
    differentiate the shift, the mean correction and the scaling (all with zero derivative).
    The rule is plain JAX, so it can be differentiated again in either mode
    (``jax.hessian``, Hessian-vector products).
    """
    x, scale, offset = primals
    dx, dscale, doffset = tangents
    y = _normalize_forward(x, scale, offset, eps, ddof)
    return y, _scale_tangent(eps, ddof, x, dscale) + doffset + _input_tangent(eps, ddof, x, scale, dx)


def _normalized(x, eps: float, ddof: int):
    """``(x̂, 1/σ)``: the normalised rows ``(x - mean) / sqrt(var + eps)`` and ``1/σ`` per row, (..., 1)."""
    centered, var, k = _scaled_statistics(x, ddof)
    sigma = jnp.sqrt(var + eps * k * k)  # (..., 1), of the scaled row
    return centered / sigma, k / sigma


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

    The statistics are those of the pivot-shifted row, with the mean's own rounding
    error taken out by one more row sum and rows beyond 2**40 scaled down before
    squaring (see :func:`_scaled_statistics`): the same math and the same passes over
    ``x`` (in one fused kernel on XLA:CPU) as the plain two-pass algorithm, but
    accurate to a few roundings on rows whose mean is large against their spread
    (where the plain algorithm and torch lose digits to the rounding of the mean),
    and finite for inputs up to the float maximum.

    Derivatives come from a ``jax.custom_jvp`` rule (:func:`_affine_normalize_jvp`),
    so every transformation applies: ``jax.grad``/``vjp``/``jacrev`` (by transposing
    the rule), ``jax.jvp``/``jacfwd``/``linearize``, ``jax.hessian``, ``vmap``,
    ``scan`` and ``checkpoint``, nested in any order.
    """
    out_dtype = dtype if dtype is not None else jnp.result_type(x, scale, offset)
    compute_dtype = jnp.promote_types(x.dtype, jnp.float32)
    y = _affine_normalize(
        x.astype(compute_dtype), scale.astype(compute_dtype), offset.astype(compute_dtype), eps, ddof
    )
    return y.astype(out_dtype)


_ACCURACY_NOTE = """
    Statistics are computed in at least float32 and the result is cast to the output
    dtype last. They are accurate to a few roundings whatever a row's mean is against
    its spread (see :func:`normalize`), where torch's kernels lose digits to the
    rounding of the mean: against float64 truth the flax error is never above torch's
    (or a few float32 roundings, whichever is larger).

    Inputs near the float32 maximum (e.g. ``x * 1e30``) deliberately deviate from
    torch: torch's variance overflows and it returns NaN (``nn.LayerNorm``) or zeros
    (the book's formula), where the exact answer is an ordinary normalised row. Here
    the row is scaled down before squaring, so the output (and its gradient, where
    that is a normal float32) is the finite float64-truth answer whenever the row's
    values and ``x - mean`` are representable. Mirroring the book's *math* is the
    contract (DESIGN §5); reproducing an overflow is not. A row whose squares still
    overflow after that scaling (see ``_scaled_statistics``) gives ``offset`` or NaN.
"""


class LayerNorm(nnx.Module):
    __doc__ = """The book's chapter-9 LayerNorm: ``a_2 * (x - mean) / sqrt(std**2 + eps) + b_2``.

    ``std`` is the *unbiased* standard deviation over the last axis (divisor n - 1),
    and ``eps`` is added to the unbiased variance inside the square root.

    How it differs from its look-alikes:

    * ``torch.nn.LayerNorm`` / :class:`TorchLayerNorm`: biased variance, eps 1e-5.
    * The Annotated Transformer: ``(x - mean) / (std + eps)``, eps outside the root.
    * ``flax.nnx.LayerNorm``: biased variance via the fast ``E[x^2] - E[x]^2``.

    With ``features == 1`` the unbiased variance is 0/0, so the output is NaN, exactly
    as in PyTorch.
""" + _ACCURACY_NOTE + """
    Args:
      features: size of the last axis, a positive int.
      eps: added to the unbiased variance, default 1e-6.
      dtype: output dtype; ``None`` infers it from the input and parameters.
      param_dtype: dtype of ``a_2`` and ``b_2``.
      rngs: accepted for a uniform constructor; the parameters are deterministic.
    """

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


class TorchLayerNorm(nnx.Module):
    __doc__ = """A twin of ``torch.nn.LayerNorm(features)``: ``scale * (x - mean) / sqrt(var + eps) + bias``.

    ``var`` is the *biased* variance (divisor n), computed two-pass, unlike
    ``flax.nnx.LayerNorm``'s fast ``E[x^2] - E[x]^2``. Default eps 1e-5, as torch.
    Used by the GPT blocks (``ln_1``, ``ln_2``, ``ln_f``). Parameters follow flax
    naming: ``scale`` is torch's ``weight``, ``bias`` is torch's ``bias``.
""" + _ACCURACY_NOTE + """
    Args:
      features: size of the last axis, a positive int.
      eps: added to the biased variance, default 1e-5.
      dtype: output dtype; ``None`` infers it from the input and parameters.
      param_dtype: dtype of ``scale`` and ``bias``.
      rngs: accepted for a uniform constructor; the parameters are deterministic.
    """

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
