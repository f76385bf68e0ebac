"""Linen adapters give the same numbers as the NNX modules they wrap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_ln
import flax_ln.linen


@pytest.mark.parametrize("name", ["LayerNorm", "TorchLayerNorm"])
def test_linen_matches_nnx(name):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16)) + 2, jnp.float32)
    linen_mod = getattr(flax_ln.linen, name)(16)
    variables = linen_mod.init(jax.random.key(0), x)
    params = variables["params"]
    nnx_mod = getattr(flax_ln, name)(16)
    rng = np.random.default_rng(1)
    new_params = {}
    for leaf, value in params.items():  # random affine so the comparison is not trivial
        value = jnp.asarray(rng.normal(size=np.shape(value)), jnp.float32)
        new_params[leaf] = value
        getattr(nnx_mod, leaf)[...] = value
    y_linen = linen_mod.apply({"params": new_params}, x)
    np.testing.assert_array_equal(np.asarray(y_linen), np.asarray(nnx_mod(x)))
    assert set(new_params) == ({"a_2", "b_2"} if name == "LayerNorm" else {"scale", "bias"})
