"""Equinox as a flax side: an Equinox port of torch's ``nn.TransformerEncoderLayer`` (separate q/k/v
``eqx.nn.Linear``, ``jax.vmap`` over tokens) against torch's, through a key map with a split rule; loading,
export, float32 and float64, ``jvp``, localisation of a planted bug on both sides. Skipped only without equinox."""

import numpy as np
import pytest

eqx = pytest.importorskip("equinox", reason="equinox is an optional dependency (the test extra installs it)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from flax_ln.convert import KeyMap, load_torch_state_dict, to_torch_state_dict  # noqa: E402
from flax_ln.parity import Equinox, compare_modules  # noqa: E402

E, H, F, T = 16, 4, 32, 6


class SelfAttention(eqx.Module):
    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    out_proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, key, heads=H):
        k = jax.random.split(key, 4)
        self.query_proj, self.key_proj, self.value_proj, self.out_proj = (eqx.nn.Linear(E, E, key=i) for i in k)
        self.heads = heads

    def __call__(self, x):  # x (T, E)
        split = lambda y: y.reshape(T, self.heads, E // self.heads).transpose(1, 0, 2)  # noqa: E731  (H, T, d)
        q, k, v = (split(jax.vmap(p)(x)) for p in (self.query_proj, self.key_proj, self.value_proj))
        w = jax.nn.softmax(q @ k.transpose(0, 2, 1) / jnp.sqrt(E // self.heads), axis=-1)  # (H, T, T)
        return jax.vmap(self.out_proj)((w @ v).transpose(1, 0, 2).reshape(T, E))  # (T, E)


class EncoderLayer(eqx.Module):
    attn: SelfAttention
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm

    def __init__(self, key, eps2=1e-5):
        k = jax.random.split(key, 3)
        self.attn = SelfAttention(k[0])
        self.linear1, self.linear2 = eqx.nn.Linear(E, F, key=k[1]), eqx.nn.Linear(F, E, key=k[2])
        self.norm1, self.norm2 = eqx.nn.LayerNorm(E, eps=1e-5), eqx.nn.LayerNorm(E, eps=eps2)

    def __call__(self, x):  # x (T, E), post-norm as torch's default
        x = jax.vmap(self.norm1)(x + self.attn(x))
        return jax.vmap(self.norm2)(x + jax.vmap(lambda t: self.linear2(jax.nn.relu(self.linear1(t))))(x))


KEY_MAP = KeyMap(
    [
        (
            r"self_attn\.in_proj_(weight|bias)",
            {"[0:16]": r"attn.query_proj.\1", "[16:32]": r"attn.key_proj.\1", "[32:48]": r"attn.value_proj.\1"},
            None,
        ),
        (r"self_attn\.out_proj\.(weight|bias)", r"attn.out_proj.\1", None),
        (r"(linear1|linear2|norm1|norm2)\.(weight|bias)", r"\1.\2", None),
    ]
)


def _torch_layer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, F, dropout=0.0)
    with torch.no_grad():
        for p in layer.parameters():
            if p.ndim == 1:  # biases and norms start at 0 and 1: a wrong slab of them would go unseen
                p.add_(0.3 * torch.randn_like(p))
    return layer


X = np.random.default_rng(0).normal(size=(T, E)).astype(np.float32)  # one sequence, unbatched on both sides


def test_key_map_loads_and_exports_an_equinox_module():
    layer = _torch_layer()
    port = load_torch_state_dict(EncoderLayer(jax.random.PRNGKey(0)), layer.state_dict(), weights=KEY_MAP)
    w = layer.self_attn.in_proj_weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(port.attn.value_proj.weight), w[32:48])
    back = to_torch_state_dict(port, weights=KEY_MAP, like=layer.state_dict())
    for key, value in layer.state_dict().items():
        np.testing.assert_array_equal(back[key], value.numpy(), err_msg=key)


def test_encoder_layer_passes_in_float32_and_float64_bare_and_wrapped():
    layer = _torch_layer()
    report = compare_modules(layer, EncoderLayer(jax.random.PRNGKey(0)), X, weights=KEY_MAP)
    assert report.passed, report
    assert report.float64_check is not None and report.float64_check.passed, report.float64_check
    assert "self_attn.in_proj_weight[32:48]" in {r.name for r in report.results}
    wrapped = compare_modules(layer, Equinox(EncoderLayer(jax.random.PRNGKey(1))), X, weights=KEY_MAP, mode="jvp")
    assert wrapped.passed, wrapped


def test_a_planted_eps_in_the_second_norm_is_named_on_both_sides():
    report = compare_modules(
        _torch_layer(), EncoderLayer(jax.random.PRNGKey(0), eps2=0.5), X, weights=KEY_MAP, dtype="float32"
    )
    assert not report.passed
    assert report.first_divergence is not None
    assert report.first_divergence.module == "norm2", report.first_divergence
    assert report.first_divergence.flax_module == "norm2"
    assert report.isolation is not None and "norm2" in report.isolation.culprits, report.isolation


class FrozenValue(EncoderLayer):
    """v's parameters get no gradient (the forward unchanged): a bug only v's gradients show."""

    def __call__(self, x):
        frozen = jax.tree.map(jax.lax.stop_gradient, self.attn.value_proj)
        attn = eqx.tree_at(lambda a: a.value_proj, self.attn, frozen)
        x = jax.vmap(self.norm1)(x + attn(x))
        return jax.vmap(self.norm2)(x + jax.vmap(lambda t: self.linear2(jax.nn.relu(self.linear1(t))))(x))


def test_a_wrong_v_is_reported_under_in_proj_weights_v_slab():
    report = compare_modules(_torch_layer(), FrozenValue(jax.random.PRNGKey(0)), X, weights=KEY_MAP)
    failed = {r.name for r in report.results if not r.passed}
    assert failed == {"self_attn.in_proj_weight[32:48]", "self_attn.in_proj_bias[32:48]"}, failed


def test_params_filter_keeps_a_table_out_of_the_parameters():
    wrapper = Equinox(EncoderLayer(jax.random.PRNGKey(0)), params=lambda leaf: eqx.is_inexact_array(leaf))
    names = wrapper.variable_tree().variables()
    assert names["attn.query_proj.weight"][2] and "attn.heads" not in names
