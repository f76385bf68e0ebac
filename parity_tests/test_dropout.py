"""flax_ln.models.dropout: the fused-mask Dropout draws exactly nnx.Dropout's masks.

Same keys, same bits, same state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_ln.models.dropout import Dropout, bernoulli


@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 2), (2, 4, 64, 64)])
@pytest.mark.parametrize("p", [0.9, 0.5, 0.1])
def test_bernoulli_is_jax_random_bernoulli_bit_for_bit(shape, p):
    for key in (jax.random.key(3), jax.random.fold_in(jax.random.key(4), 7), jax.random.PRNGKey(5)):
        expected = jax.random.bernoulli(key, p, shape)
        got = jax.jit(bernoulli, static_argnums=(1, 2))(key, p, shape)
        assert got.dtype == jnp.bool_ and got.shape == shape
        np.testing.assert_array_equal(got, expected)


def test_bernoulli_falls_back_to_jax_where_it_cannot_match(x64):
    """float64 probabilities (x64) and other key implementations go through jax.random.bernoulli itself."""
    key = jax.random.key(0)
    np.testing.assert_array_equal(bernoulli(key, 0.7, (4, 9)), jax.random.bernoulli(key, 0.7, (4, 9)))
    rbg = jax.random.key(0, impl="rbg")
    np.testing.assert_array_equal(bernoulli(rbg, 0.7, (4, 9)), jax.random.bernoulli(rbg, 0.7, (4, 9)))


@pytest.mark.parametrize("broadcast_dims", [(), (1,), (-1,)])
def test_dropout_equals_nnx_dropout(broadcast_dims):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16, 32)), jnp.float32)
    ours = Dropout(0.3, broadcast_dims=broadcast_dims, rngs=nnx.Rngs(5))
    theirs = nnx.Dropout(0.3, broadcast_dims=broadcast_dims, rngs=nnx.Rngs(5))
    assert isinstance(ours, nnx.Dropout)  # model code that looks for nnx.Dropout still finds it
    for _ in range(3):  # each call draws a fresh key from the stream, the same one in both
        y = ours(x)
        np.testing.assert_array_equal(y, theirs(x))
    kept = np.asarray(y != 0)
    np.testing.assert_allclose(np.asarray(y)[kept], np.asarray(x)[kept] / 0.7, rtol=1e-6)
    assert 0.6 < kept.mean() < 0.8
    ours_state, theirs_state = nnx.state(ours), nnx.state(theirs)
    assert jax.tree.structure(ours_state) == jax.tree.structure(theirs_state)
    assert int(ours_state["rngs"]["count"][...]) == int(theirs_state["rngs"]["count"][...]) == 3
    # key arguments, deterministic and the edge rates behave as nnx.Dropout's
    key = jax.random.key(9)
    np.testing.assert_array_equal(ours(x, rngs=key), theirs(x, rngs=key))
    np.testing.assert_array_equal(ours(x, deterministic=True), x)
    np.testing.assert_array_equal(Dropout(0.0, rngs=nnx.Rngs(0))(x), x)
    np.testing.assert_array_equal(Dropout(1.0, rngs=nnx.Rngs(0))(x), jnp.zeros_like(x))
    with pytest.raises(ValueError, match="deterministic is None"):
        Dropout(0.5, deterministic=None, rngs=nnx.Rngs(0))(x)
    with pytest.raises(ValueError, match="no rngs"):
        Dropout(0.5)(x)


def test_dropout_under_jit_and_grad():
    """Inside a jitted gradient the mask is the same as nnx.Dropout's, so training is unchanged."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 64)), jnp.float32)

    def grad_of(module):
        graphdef, state = nnx.split(module)

        def f(x):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, state, copy=True)(x)))

        return jax.jit(jax.grad(f))(x)

    np.testing.assert_array_equal(
        grad_of(Dropout(0.25, rngs=nnx.Rngs(2))), grad_of(nnx.Dropout(0.25, rngs=nnx.Rngs(2)))
    )


def test_the_mask_is_hashed_once_in_a_compiled_training_step():
    """XLA:CPU duplicates an element-wise hash into every fusion that uses the mask (forward,
    backward, transposed copies for the weight gradient); the packed mask keeps it to one."""
    rngs = nnx.Rngs(0)
    w1, w2 = (jnp.asarray(np.random.default_rng(i).normal(size=(64, 64)), jnp.float32) for i in (1, 2))

    def loss(w1, w2, x, key):
        hidden = Dropout(0.1)(jax.nn.relu(x @ w1), rngs=key)
        return jnp.sum((hidden @ w2) ** 2)

    x = jnp.ones((4, 16, 64))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w1, w2, x, rngs.dropout()).compile().as_text()
    # every computation (fused or not) that holds the hash's 20 rotations, each a shift-left
    computations = hlo.split("\n\n")
    hashing = [c for c in computations if c.count("shift-left(") >= 20]
    assert len(hashing) == 1, [c.splitlines()[0] for c in hashing]
