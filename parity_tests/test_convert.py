"""The strict torch <-> flax converter: round trips, every error case, no partial updates."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_ln
import torch_ref
from flax_ln import ConversionError, load_torch_state_dict, to_torch_state_dict
from flax_ln.convert import RULES, DerivedBuffer


class TorchToy(torch.nn.Module):
    """A torch model touching every rule kind: Linear (with and without bias), Embedding, both norms, a ModuleList."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(3)])
        self.norm = torch_ref.LayerNorm(6)
        self.ln_f = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 4, bias=False)


class FlaxToy(nnx.Module):
    def __init__(self, *, stacked=False, rngs):
        self.emb = nnx.Embed(11, 6, rngs=rngs)
        if stacked:  # three Linear layers with a leading layer axis, as scan_layers stores them
            self.layers = nnx.vmap(lambda r: nnx.Linear(6, 6, rngs=r))(rngs.split(3))
            self.layers.num_stacked_layers = 3
        else:
            self.layers = nnx.List([nnx.Linear(6, 6, rngs=rngs) for _ in range(3)])
        self.norm = flax_ln.LayerNorm(6)
        self.ln_f = flax_ln.TorchLayerNorm(6)
        self.head = nnx.Linear(6, 4, use_bias=False, rngs=rngs)


def random_torch_toy(seed=0):
    torch.manual_seed(seed)
    model = TorchToy()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def flat_params(model):
    return {path: np.array(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("stacked", [False, True])
def test_round_trip_is_bit_exact(stacked):
    torch_model = random_torch_toy()
    sd = torch_model.state_dict()
    flax_model = load_torch_state_dict(FlaxToy(stacked=stacked, rngs=nnx.Rngs(0)), sd)
    back = to_torch_state_dict(flax_model)
    assert back.keys() == sd.keys()
    for key, value in sd.items():
        assert back[key].dtype == np.float32 and back[key].shape == tuple(value.shape), key
        np.testing.assert_array_equal(back[key], value.numpy(), err_msg=key)
    fresh = TorchToy()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)


def test_linear_is_transposed_and_embedding_is_not():
    torch_model = random_torch_toy()
    flax_model = load_torch_state_dict(FlaxToy(rngs=nnx.Rngs(0)), torch_model.state_dict())
    np.testing.assert_array_equal(flax_model.layers[1].kernel[...], torch_model.layers[1].weight.detach().numpy().T)
    np.testing.assert_array_equal(flax_model.emb.embedding[...], torch_model.emb.weight.detach().numpy())
    np.testing.assert_array_equal(flax_model.ln_f.scale[...], torch_model.ln_f.weight.detach().numpy())
    x = torch.randn(2, 6)
    np.testing.assert_allclose(
        flax_model.layers[1](jnp.asarray(x.numpy())), torch_model.layers[1](x).detach().numpy(), rtol=1e-5, atol=1e-6
    )


def test_stacked_and_unstacked_layouts_hold_the_same_weights():
    sd = random_torch_toy().state_dict()
    plain = load_torch_state_dict(FlaxToy(rngs=nnx.Rngs(0)), sd)
    stacked = load_torch_state_dict(FlaxToy(stacked=True, rngs=nnx.Rngs(1)), sd)
    assert stacked.layers.kernel.shape == (3, 6, 6)  # (n_layer, in, out)
    for i in range(3):
        np.testing.assert_array_equal(stacked.layers.kernel[...][i], plain.layers[i].kernel[...])


def test_every_problem_is_listed_in_one_error_and_nothing_changes():
    sd = dict(random_torch_toy().state_dict())
    del sd["layers.2.bias"]  # missing
    sd["layers.3.weight"] = torch.zeros(6, 6)  # unexpected (an extra layer)
    sd["norm.a_2"] = torch.ones(7)  # wrong shape
    sd["ln_f.weight"] = torch.ones(6, dtype=torch.int64)  # incompatible dtype
    sd["head.weight"] = torch.zeros(6, 4)  # transposed by mistake
    model = FlaxToy(rngs=nnx.Rngs(0))
    before = flat_params(model)
    with pytest.raises(ConversionError) as info:
        load_torch_state_dict(model, sd)
    err = info.value
    assert err.missing == ["layers.2.bias"]
    assert err.unexpected == ["layers.3.weight"]
    assert [k for k, _ in err.mismatched] == ["head.weight", "ln_f.weight", "norm.a_2"]
    message = str(err)
    for fragment in ["layers.2.bias", "layers.3.weight", "expected shape (6,), got (7,)", "int64",
                     "expected shape (4, 6), got (6, 4)", "nothing was loaded"]:
        assert fragment in message
    assert isinstance(err, ValueError)
    after = flat_params(model)
    assert before.keys() == after.keys()
    for path in before:
        np.testing.assert_array_equal(after[path], before[path], err_msg=str(path))


def test_loaded_weights_do_not_alias_torch_memory():
    torch_model = random_torch_toy()
    flax_model = load_torch_state_dict(FlaxToy(rngs=nnx.Rngs(0)), torch_model.state_dict())
    before = np.array(flax_model.norm.a_2[...])
    with torch.no_grad():
        torch_model.norm.a_2.add_(1.0)  # an in-place update, as torch optimizers do
    np.testing.assert_array_equal(flax_model.norm.a_2[...], before)


def test_non_strict_ignores_missing_and_unexpected_but_not_shapes():
    sd = dict(random_torch_toy().state_dict())
    del sd["emb.weight"]
    sd["extra"] = torch.zeros(1)
    model = FlaxToy(rngs=nnx.Rngs(0))
    emb_before = np.array(model.emb.embedding[...])
    load_torch_state_dict(model, sd, strict=False)
    np.testing.assert_array_equal(model.emb.embedding[...], emb_before)
    np.testing.assert_array_equal(model.norm.a_2[...], sd["norm.a_2"].numpy())
    sd["norm.b_2"] = torch.zeros(3)
    with pytest.raises(ConversionError, match="norm.b_2"):
        load_torch_state_dict(model, sd, strict=False)


def test_values_are_cast_to_parameter_dtype_and_numpy_is_accepted():
    sd = {k: v.to(torch.float64) for k, v in random_torch_toy().state_dict().items()}
    sd["norm.a_2"] = sd["norm.a_2"].to(torch.bfloat16)
    sd["emb.weight"] = sd["emb.weight"].numpy()
    model = load_torch_state_dict(FlaxToy(rngs=nnx.Rngs(0)), sd)
    assert model.layers[0].kernel.dtype == jnp.float32
    np.testing.assert_array_equal(model.emb.embedding[...], sd["emb.weight"].astype(np.float32))
    np.testing.assert_array_equal(model.norm.a_2[...], sd["norm.a_2"].float().numpy())


def test_derived_buffers_are_exported_and_checked(monkeypatch):
    """A persistent torch buffer the flax module recomputes: written on export, verified on load."""

    class WithMask(nnx.Module):
        def __init__(self, n):
            self.n = n
            self.proj = nnx.Linear(n, n, rngs=nnx.Rngs(0))

    def causal(module):
        return np.tril(np.ones((module.n, module.n), np.float32))

    monkeypatch.setitem(RULES, WithMask, (DerivedBuffer("mask", causal),))
    model = WithMask(3)
    sd = to_torch_state_dict(model)
    assert set(sd) == {"mask", "proj.weight", "proj.bias"}
    np.testing.assert_array_equal(sd["mask"], causal(model))
    load_torch_state_dict(model, sd)
    sd["mask"] = np.ones((3, 3), np.float32)
    with pytest.raises(ConversionError, match="'mask': buffer differs"):
        load_torch_state_dict(model, sd)


def test_module_without_a_rule_is_refused():
    class Unknown(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(3))

    with pytest.raises(NotImplementedError, match="w"):
        to_torch_state_dict(Unknown())


def test_layernorm_modules_round_trip_with_torch_twins():
    for torch_mod, flax_mod in [(torch_ref.LayerNorm(5), flax_ln.LayerNorm(5)),
                                (torch.nn.LayerNorm(5), flax_ln.TorchLayerNorm(5))]:
        with torch.no_grad():
            for p in torch_mod.parameters():
                p.copy_(torch.randn_like(p))
        back = to_torch_state_dict(load_torch_state_dict(flax_mod, torch_mod.state_dict()))
        torch_mod.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)
        for k, v in torch_mod.state_dict().items():
            np.testing.assert_array_equal(back[k], v.numpy())


def test_import_does_not_pull_in_torch():
    import subprocess
    import sys

    code = "import sys, flax_ln, flax_ln.convert, flax_ln.linen, flax_ln.parity.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
