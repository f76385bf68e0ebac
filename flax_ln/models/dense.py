"""The product inside every ``nnx.Linear`` of the models, with a derivative rule that suits XLA:CPU.

:func:`linear_dot_general` is passed as ``nnx.Linear(..., dot_general=linear_dot_general)``
by the GPT and the encoder-decoder. Its value is ``lax.dot_general``'s; what changes is
the kernel's gradient in reverse mode.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.custom_derivatives import SymbolicZero


def _product(inputs, kernel, precision, preferred_element_type):
    """``inputs @ kernel`` over the last axis of ``inputs``: (..., in) x (in, out) -> (..., out)."""
    return lax.dot_general(
        inputs,
        kernel,
        (((inputs.ndim - 1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _linear_product(inputs, kernel, precision, preferred_element_type):
    return _product(inputs, kernel, precision, preferred_element_type)


def _linear_product_jvp(precision, preferred_element_type, primals, tangents):
    """``d(x @ W) = dx @ W + x @ dW``, with ``x @ dW`` written as ``(xᵀ)ᵀ @ dW`` on a stored ``xᵀ``.

    Reverse mode transposes ``x @ dW`` into the kernel's gradient. Written plainly, that
    is ``dot_general(x, g)`` contracting both operands' leading axes, and XLA:CPU runs it
    with Eigen after writing the (tokens, out) cotangent ``g`` out a second time,
    transposed; for GPT-2's head that is a 50257 x tokens copy of the logits' gradient.
    Here ``xᵀ``, (in, tokens), is materialised in the forward pass behind an optimisation
    barrier (so XLA cannot fold the transpose back into the product), and the gradient
    becomes ``xᵀ @ g``, a plain row-major product on ``g`` as it is, which XLA:CPU runs
    as a YNNPACK matmul. ``xᵀ`` is kept for the backward pass instead of ``x``: the same
    size. On XLA:CPU the GPT-2 124M and chapter-10 encoder-decoder training steps take
    less time than with plain ``lax.dot_general`` (``benchmarks/RESULTS.md``, "the kernel
    gradient's form"). Inside a ``scan`` over layers XLA:CPU keeps the blocks' kernel gradients
    as Eigen dots all the same, so there only the head gains, and a model with a small
    head (a narrow vocabulary) pays the copies of ``xᵀ`` for nothing. Other backends also
    pay that one copy of each layer's input.
    The rule is plain JAX, so every transformation applies, higher derivatives included;
    a tangent that is known to be zero costs nothing.
    """
    inputs, kernel = primals
    inputs_dot, kernel_dot = tangents
    out = _product(inputs, kernel, precision, preferred_element_type)
    out_dot = None
    if not isinstance(inputs_dot, SymbolicZero):
        out_dot = _product(inputs_dot, kernel, precision, preferred_element_type)
    if not isinstance(kernel_dot, SymbolicZero):
        inputs_t = lax.optimization_barrier(inputs.reshape(-1, inputs.shape[-1]).T)  # (in, tokens)
        kernel_term = lax.dot_general(
            inputs_t,
            kernel_dot,
            (((0,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=preferred_element_type,
        )  # (tokens, out)
        kernel_term = kernel_term.reshape(*inputs.shape[:-1], kernel.shape[-1])  # (..., out)
        out_dot = kernel_term if out_dot is None else out_dot + kernel_term
    if out_dot is None:
        out_dot = SymbolicZero(jax.typeof(out).to_tangent_aval())
    return out, out_dot


_linear_product.defjvp(_linear_product_jvp, symbolic_zeros=True)


def linear_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """``lax.dot_general`` for ``nnx.Linear``: the same value; a kernel gradient XLA:CPU runs faster.

    ``nnx.Linear`` contracts the last axis of its input with the first of its (in, out)
    kernel; that product goes through :func:`_linear_product_jvp`'s rule. Any other
    contraction, or an explicit ``out_sharding``, is passed to ``lax.dot_general`` as it is.
    """
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
    if (
        tuple(lhs_contracting) == (lhs.ndim - 1,)
        and tuple(rhs_contracting) == (0,)
        and not lhs_batch
        and not rhs_batch
        and rhs.ndim == 2
        and out_sharding is None
    ):
        return _linear_product(lhs, rhs, precision, preferred_element_type)
    return lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )
