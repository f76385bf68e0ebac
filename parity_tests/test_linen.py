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


# ---- whole models: the Linen adapters of the GPT and the encoder-decoder ----

from flax import nnx  # noqa: E402


def _randomize(module: nnx.Module, seed: int) -> dict:
    """Draw every parameter of ``module`` at random (not its default init) and return them as a pure dict."""
    rng = np.random.default_rng(seed)
    params = nnx.state(module, nnx.Param)
    nnx.update(module, jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype), params))
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _same_layout(linen_params, nnx_params) -> None:
    assert jax.tree.structure(linen_params) == jax.tree.structure(nnx_params)
    assert jax.tree.map(jnp.shape, linen_params) == jax.tree.map(jnp.shape, nnx_params)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_linen_gpt_matches_nnx(scan_layers):
    config = flax_ln.GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=12)
    rng = np.random.default_rng(0)
    idx = jnp.asarray(rng.integers(0, 37, (3, 12)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 37, (3, 12)), jnp.int32)
    linen_gpt = flax_ln.linen.GPT(config, scan_layers=scan_layers, deterministic=True)
    variables = linen_gpt.init(jax.random.key(0), idx)
    nnx_gpt = flax_ln.GPT(config, scan_layers=scan_layers, rngs=nnx.Rngs(1))
    nnx_gpt.eval()
    params = _randomize(nnx_gpt, 2)
    _same_layout(variables["params"], params)

    logits, loss = linen_gpt.apply({**variables, "params": params}, idx, targets)
    want_logits, want_loss = nnx_gpt(idx, targets)
    # same parameters, same ops in the same order: equal up to XLA's float32 fusion choices
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert logits.shape == (3, 12, 37) and logits.dtype == want_logits.dtype


def test_linen_gpt_dropout_needs_a_stream():
    config = flax_ln.GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=12)
    idx = jnp.zeros((3, 12), jnp.int32)
    linen_gpt = flax_ln.linen.GPT(config)  # training mode, as a fresh NNX model
    with pytest.raises(ValueError, match="'dropout' PRNG stream"):
        linen_gpt.init(jax.random.key(0), idx)
    variables = linen_gpt.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, idx)
    with pytest.raises(ValueError, match="deterministic=True"):
        linen_gpt.apply(variables, idx)
    a, b, c = (linen_gpt.apply(variables, idx, rngs={"dropout": jax.random.key(k)})[0] for k in (3, 3, 4))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same key gives the same dropout mask
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def _generator(model, x):
    """The encoder-decoder's log-probabilities, as an ``nnx_method`` for the Linen adapter."""
    return model.generator(x)


@pytest.mark.parametrize("ffn_activation", [None, "relu"])
def test_linen_encoder_decoder_matches_nnx(ffn_activation):
    sizes = dict(N=2, d_model=16, d_ff=32, h=2, dropout=0.1, ffn_activation=ffn_activation)
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(1, 11, (3, 7)), jnp.int32).at[0, 5:].set(0)  # some padding
    tgt = jnp.asarray(rng.integers(1, 13, (3, 6)), jnp.int32).at[1, 4:].set(0)
    src_mask, tgt_mask = flax_ln.make_src_mask(src, 0), flax_ln.make_std_mask(tgt, 0)
    linen_model = flax_ln.linen.make_model(11, 13, **sizes, deterministic=True)
    variables = linen_model.init(jax.random.key(0), src, tgt, src_mask, tgt_mask)
    nnx_model = flax_ln.make_model(11, 13, **sizes, rngs=nnx.Rngs(1))
    nnx_model.eval()
    params = _randomize(nnx_model, 2)
    _same_layout(variables["params"], params)
    variables = {**variables, "params": params}  # the positional tables stay in their own collection

    # same parameters, same ops in the same order: equal up to XLA's float32 fusion choices
    tol = dict(rtol=1e-6, atol=1e-6)
    out = linen_model.apply(variables, src, tgt, src_mask, tgt_mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(nnx_model(src, tgt, src_mask, tgt_mask)), **tol)
    memory = linen_model.apply(variables, src, src_mask, nnx_method="encode")
    np.testing.assert_allclose(np.asarray(memory), np.asarray(nnx_model.encode(src, src_mask)), **tol)
    log_probs = linen_model.apply(variables, out, nnx_method=_generator)
    np.testing.assert_allclose(np.asarray(log_probs), np.asarray(nnx_model.generator(out)), **tol)
    assert out.shape == (3, 6, 16) and log_probs.shape == (3, 6, 13)
