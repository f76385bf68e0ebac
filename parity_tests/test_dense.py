"""``linear_dot_general``: the same values and derivatives as ``lax.dot_general``, and the
kernel-gradient form it exists for (no transposed copy of the cotangent on XLA:CPU)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import flax_ln
from flax_ln.models.dense import linear_dot_general


def linear_pair(shape_in, features, use_bias):
    """Two ``nnx.Linear`` twins on the same parameters, float64: ours and plain ``lax.dot_general``."""
    ours = nnx.Linear(
        shape_in[-1],
        features,
        use_bias=use_bias,
        param_dtype=jnp.float64,
        dot_general=linear_dot_general,
        rngs=nnx.Rngs(0),
    )
    plain = nnx.Linear(shape_in[-1], features, use_bias=use_bias, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    return nnx.split(ours), nnx.split(plain)


@pytest.mark.parametrize("shape_in,use_bias", [((5, 4), True), ((2, 3, 4), False), ((4,), True)])
def test_values_and_every_derivative_match_lax_dot_general(x64, shape_in, use_bias):
    (graph_a, params_a), (graph_b, params_b) = linear_pair(shape_in, 3, use_bias)
    x = jnp.asarray(np.random.default_rng(1).normal(size=shape_in))

    def loss(graph):
        return lambda x, params: jnp.sum(jnp.tanh(nnx.merge(graph, params)(x)) ** 2)

    ours, plain = loss(graph_a), loss(graph_b)
    transforms = {
        "value": lambda f: f,
        "grad": lambda f: jax.grad(f, (0, 1)),
        "hessian": lambda f: jax.hessian(f, (0, 1)),
        "jacfwd": lambda f: jax.jacfwd(f, (0, 1)),
        "jvp": lambda f: lambda x, p: jax.jvp(f, (x, p), (jnp.ones_like(x), jax.tree.map(jnp.ones_like, p))),
        "vmap(grad)": lambda f: jax.vmap(jax.grad(f, 1), (0, None)),
    }
    for name, transform in transforms.items():
        xs = jnp.stack([x, 2 * x]) if name.startswith("vmap") else x
        got, want = transform(ours)(xs, params_a), transform(plain)(xs, params_b)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            # float64, the same products in the same association: only summation order may differ
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14, err_msg=name)


def test_other_contractions_pass_through_unchanged():
    a = jnp.arange(24.0).reshape(2, 3, 4)
    b = jnp.arange(40.0).reshape(2, 4, 5)
    batched = (((2,), (1,)), ((0,), (0,)))
    assert jnp.array_equal(linear_dot_general(a, b, batched), lax.dot_general(a, b, batched))
    leading = (((0,), (0,)), ((), ()))
    w = jnp.arange(10.0).reshape(2, 5)
    assert jnp.array_equal(linear_dot_general(a, w, leading), lax.dot_general(a, w, leading))


def test_an_input_only_gradient_makes_no_transposed_copy():
    linear = nnx.Linear(4, 3, dot_general=linear_dot_general, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 4))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(linear(x))))(x))
    assert "optimization_barrier" not in jaxpr  # the kernel's tangent is a symbolic zero: no x-transpose


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the layout XLA:CPU picks for an Eigen dot")
def test_the_kernel_gradient_reads_the_cotangent_as_it_is():
    # Reverse mode through a wide layer: plain lax.dot_general makes XLA:CPU write the (tokens, out)
    # cotangent a second time, transposed to (out, tokens), for the kernel's gradient.
    batch, length, width, out = 4, 16, 32, 1000
    tokens = batch * length

    def compiled_text(dot_general):
        linear = nnx.Linear(width, out, dot_general=dot_general, rngs=nnx.Rngs(0))
        graph, params = nnx.split(linear)

        def loss(x, params):
            return jnp.sum(jnp.exp(nnx.merge(graph, params)(x)))

        x = jax.ShapeDtypeStruct((batch, length, width), jnp.float32)
        return jax.jit(jax.grad(loss, (0, 1))).lower(x, params).compile().as_text()

    transposed = re.compile(rf"f32\[{out},{tokens}\]")
    assert transposed.search(compiled_text(lax.dot_general))  # the copy this rule avoids is real
    ours = compiled_text(linear_dot_general)
    assert not transposed.search(ours)
    # instead, the (small) input is stored transposed, so the product is a plain row-major one
    assert re.search(rf"f32\[{width},{tokens}\]", ours)


def test_the_models_linear_layers_use_it():
    gpt = flax_ln.GPT(flax_ln.GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=4), rngs=nnx.Rngs(0))
    encdec = flax_ln.make_model(src_vocab=7, tgt_vocab=9, N=1, d_model=8, d_ff=16, h=2, rngs=nnx.Rngs(0))
    linears = [m for model in (gpt, encdec) for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Linear)]
    assert len(linears) >= 5
    assert all(m.dot_general is linear_dot_general for m in linears)
