"""The strict torch <-> flax converter: round trips, every error case, no partial updates,
the standard torch.nn layers and their flax.nnx twins, and user-registered rules and renames."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_ln
import torch_ref
from flax_ln import ConversionError, load_torch_state_dict, to_torch_state_dict
from flax_ln.convert import (
    RULES,
    DerivedBuffer,
    Leaf,
    MissingRuleError,
    Permute,
    register_rename,
    register_rule,
    torch_activation,
    torch_module_paths,
)
from flax_ln.parity import compare_modules


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
        self.stacked = stacked
        self.emb = nnx.Embed(11, 6, rngs=rngs)
        if stacked:  # three Linear layers with a leading layer axis, as scan_layers stores them
            self.layers = nnx.vmap(lambda r: nnx.Linear(6, 6, rngs=r))(rngs.split(3))
        else:
            self.layers = nnx.List([nnx.Linear(6, 6, rngs=rngs) for _ in range(3)])
        self.norm = flax_ln.LayerNorm(6)
        self.ln_f = flax_ln.TorchLayerNorm(6)
        self.head = nnx.Linear(6, 4, use_bias=False, rngs=rngs)


register_rule(FlaxToy, stacked=lambda toy: {"layers": 3} if toy.stacked else {})


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


def test_module_paths_leave_out_stacked_layers():
    paths = torch_module_paths(FlaxToy(stacked=True, rngs=nnx.Rngs(0)))
    assert paths == {"": "", "emb": "emb", "norm": "norm", "ln_f": "ln_f", "head": "head"}


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
    for fragment in [
        "layers.2.bias",
        "layers.3.weight",
        "expected shape (6,), got (7,)",
        "int64",
        "expected shape (4, 6), got (6, 4)",
        "nothing was loaded",
    ]:
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


@pytest.fixture
def rules():
    """The rule table, restored after the test (registrations are process-wide)."""
    saved = dict(RULES)
    yield RULES
    RULES.clear()
    RULES.update(saved)


def test_derived_buffers_are_exported_and_checked(rules):
    """A persistent torch buffer the flax module recomputes: written on export, verified on load."""

    class WithMask(nnx.Module):
        def __init__(self, n):
            self.n = n
            self.proj = nnx.Linear(n, n, rngs=nnx.Rngs(0))

    def causal(module):
        return np.tril(np.ones((module.n, module.n), np.float32))

    register_rule(WithMask, [DerivedBuffer("mask", causal)])
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
    for torch_mod, flax_mod in [
        (torch_ref.LayerNorm(5), flax_ln.LayerNorm(5)),
        (torch.nn.LayerNorm(5), flax_ln.TorchLayerNorm(5)),
    ]:
        with torch.no_grad():
            for p in torch_mod.parameters():
                p.copy_(torch.randn_like(p))
        back = to_torch_state_dict(load_torch_state_dict(flax_mod, torch_mod.state_dict()))
        torch_mod.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)
        for k, v in torch_mod.state_dict().items():
            np.testing.assert_array_equal(back[k], v.numpy())


@pytest.mark.slow
def test_import_does_not_pull_in_torch():
    import subprocess
    import sys

    code = "import sys, flax_ln, flax_ln.convert, flax_ln.linen, flax_ln.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------------------------------
# Standard torch.nn layers and their flax.nnx twins, converted by the table alone.
# Each layer: (torch factory, flax factory(param_dtype), input shape in torch layout,
# whether flax takes that input channels-last). Kernels are non-square and widths all
# differ, so a swapped axis fails on shape or on value.


def _batchnorm(num_features, param_dtype, **kwargs):
    """nnx.BatchNorm with its running statistics in ``param_dtype``: flax creates them float32
    whatever ``param_dtype`` says, so a float64 comparison must widen them (load casts to them)."""
    bn = nnx.BatchNorm(num_features, param_dtype=param_dtype, rngs=nnx.Rngs(0), **kwargs)
    for stat in (bn.mean, bn.var):
        stat.set_value(stat[...].astype(param_dtype))
    return bn


def _conv_padding(p):  # torch's symmetric padding per spatial axis -> flax's (low, high) pairs
    return tuple((k, k) for k in p)


STANDARD_LAYERS = {
    "linear": (
        lambda: torch.nn.Linear(5, 7),
        lambda d: nnx.Linear(5, 7, param_dtype=d, rngs=nnx.Rngs(0)),
        (3, 5),
        False,
    ),
    "linear_no_bias": (
        lambda: torch.nn.Linear(5, 7, bias=False),
        lambda d: nnx.Linear(5, 7, use_bias=False, param_dtype=d, rngs=nnx.Rngs(0)),
        (3, 5),
        False,
    ),
    "layernorm": (
        lambda: torch.nn.LayerNorm(6),
        lambda d: nnx.LayerNorm(6, epsilon=1e-5, param_dtype=d, rngs=nnx.Rngs(0)),
        (3, 4, 6),
        False,
    ),
    "layernorm_no_affine": (
        lambda: torch.nn.LayerNorm(6, elementwise_affine=False),
        lambda d: nnx.LayerNorm(6, epsilon=1e-5, use_scale=False, use_bias=False, param_dtype=d, rngs=nnx.Rngs(0)),
        (3, 4, 6),
        False,
    ),
    "layernorm_no_bias": (
        lambda: torch.nn.LayerNorm(6, bias=False),
        lambda d: nnx.LayerNorm(6, epsilon=1e-5, use_bias=False, param_dtype=d, rngs=nnx.Rngs(0)),
        (3, 4, 6),
        False,
    ),
    "rmsnorm": (
        lambda: torch.nn.RMSNorm(6, eps=1e-6),
        lambda d: nnx.RMSNorm(6, epsilon=1e-6, param_dtype=d, rngs=nnx.Rngs(0)),
        (3, 4, 6),
        False,
    ),
    "rmsnorm_no_affine": (
        lambda: torch.nn.RMSNorm(6, eps=1e-6, elementwise_affine=False),
        lambda d: nnx.RMSNorm(6, epsilon=1e-6, use_scale=False, param_dtype=d, rngs=nnx.Rngs(0)),
        (3, 4, 6),
        False,
    ),
    "conv1d": (
        lambda: torch.nn.Conv1d(4, 6, 3, padding=1),
        lambda d: nnx.Conv(4, 6, (3,), padding=_conv_padding((1,)), param_dtype=d, rngs=nnx.Rngs(0)),
        (2, 4, 9),
        True,
    ),
    "conv1d_groups_strided_no_bias": (
        lambda: torch.nn.Conv1d(4, 6, 3, stride=2, padding=2, groups=2, bias=False),
        lambda d: nnx.Conv(
            4,
            6,
            (3,),
            strides=2,
            padding=_conv_padding((2,)),
            feature_group_count=2,
            use_bias=False,
            param_dtype=d,
            rngs=nnx.Rngs(0),
        ),
        (2, 4, 9),
        True,
    ),
    "conv2d": (
        lambda: torch.nn.Conv2d(4, 6, (3, 2), padding=(1, 0)),
        lambda d: nnx.Conv(4, 6, (3, 2), padding=_conv_padding((1, 0)), param_dtype=d, rngs=nnx.Rngs(0)),
        (2, 4, 7, 5),
        True,
    ),
    "conv2d_depthwise_dilated_no_bias": (
        lambda: torch.nn.Conv2d(4, 8, (3, 2), padding=2, dilation=2, groups=4, bias=False),
        lambda d: nnx.Conv(
            4,
            8,
            (3, 2),
            padding=_conv_padding((2, 2)),
            kernel_dilation=2,
            feature_group_count=4,
            use_bias=False,
            param_dtype=d,
            rngs=nnx.Rngs(0),
        ),
        (2, 4, 7, 5),
        True,
    ),
    # eval mode: normalised by the converted running statistics
    "batchnorm1d_features": (
        lambda: torch.nn.BatchNorm1d(6).eval(),
        lambda d: _batchnorm(6, d, use_running_average=True),
        (5, 6),
        False,
    ),
    "batchnorm1d_sequence": (
        lambda: torch.nn.BatchNorm1d(6).eval(),
        lambda d: _batchnorm(6, d, use_running_average=True),
        (3, 6, 4),
        True,
    ),
    "batchnorm2d": (
        lambda: torch.nn.BatchNorm2d(6).eval(),
        lambda d: _batchnorm(6, d, use_running_average=True),
        (3, 6, 4, 5),
        True,
    ),
    "batchnorm2d_no_affine": (
        lambda: torch.nn.BatchNorm2d(6, affine=False).eval(),
        lambda d: _batchnorm(6, d, use_running_average=True, use_scale=False, use_bias=False),
        (3, 6, 4, 5),
        True,
    ),
    # train mode: normalised by the batch statistics (biased variance in both frameworks)
    "batchnorm2d_train": (
        lambda: torch.nn.BatchNorm2d(6).train(),
        lambda d: _batchnorm(6, d, use_running_average=False, momentum=0.9),
        (3, 6, 4, 5),
        True,
    ),
}

# float64: both frameworks compute the same math, so anything above ~1e-12 is a bug (the policy, docs/tolerances.md).
# float32: the policy's output bound; reductions and conv sums run in different orders.
TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}
JAX_DTYPE = {torch.float64: jnp.float64, torch.float32: jnp.float32}


def randomized(layer, seed=0):
    """``layer`` with every parameter and running statistic random (variances positive), 7 batches tracked."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in layer.state_dict().items():
            if name.endswith("num_batches_tracked"):
                t.fill_(7)
            elif name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=gen, dtype=t.dtype) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
    return layer


def channels_last(x: np.ndarray) -> np.ndarray:
    return np.moveaxis(x, 1, -1)  # (N, C, *spatial) -> (N, *spatial, C)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(STANDARD_LAYERS))
def test_standard_layer_converts_and_matches_torch(name, dtype, request):
    if dtype == torch.float64:
        request.getfixturevalue("x64")
    make_torch, make_flax, shape, is_channels_last = STANDARD_LAYERS[name]
    torch_layer = randomized(make_torch().to(dtype))
    flax_layer = load_torch_state_dict(make_flax(JAX_DTYPE[dtype]), torch_layer.state_dict())

    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    expected = torch_layer(x).detach().numpy()
    x_flax = channels_last(x.numpy()) if is_channels_last else x.numpy()
    out = np.asarray(flax_layer(jnp.asarray(x_flax)))
    if is_channels_last:
        out = np.moveaxis(out, -1, 1)  # (N, *spatial, C) -> (N, C, *spatial)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    np.testing.assert_allclose(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("name", list(STANDARD_LAYERS))
def test_standard_layer_round_trip_loads_strict_into_torch(name):
    make_torch, make_flax, _, _ = STANDARD_LAYERS[name]
    torch_layer = randomized(make_torch())
    sd = torch_layer.state_dict()
    back = to_torch_state_dict(load_torch_state_dict(make_flax(jnp.float32), sd))
    assert back.keys() == sd.keys()
    for key, value in sd.items():
        if key == "num_batches_tracked":  # flax keeps no count: exported as 0, an integer scalar
            assert back[key].dtype == np.int64 and back[key].shape == () and back[key] == 0
        else:
            assert back[key].dtype == np.float32, key
            np.testing.assert_array_equal(back[key], value.numpy(), err_msg=key)
    make_torch().load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)


def test_embedding_converts_and_matches_torch():
    torch_emb = randomized(torch.nn.Embedding(11, 6))
    flax_emb = load_torch_state_dict(nnx.Embed(11, 6, rngs=nnx.Rngs(0)), torch_emb.state_dict())
    ids = torch.tensor([[0, 3, 10], [7, 7, 1]])
    np.testing.assert_array_equal(flax_emb(jnp.asarray(ids.numpy())), torch_emb(ids).detach().numpy())


def test_conv_kernel_layout_is_declared_per_axis():
    """torch (out, in/groups, kh, kw) against flax (kh, kw, in/groups, out), checked element by element."""
    torch_conv = randomized(torch.nn.Conv2d(4, 6, (3, 2), groups=2))
    flax_conv = load_torch_state_dict(
        nnx.Conv(4, 6, (3, 2), feature_group_count=2, rngs=nnx.Rngs(0)), torch_conv.state_dict()
    )
    w = torch_conv.weight.detach().numpy()
    assert flax_conv.kernel.shape == (3, 2, 2, 6)
    for o, i, h, v in [(0, 0, 0, 0), (5, 1, 2, 1), (3, 0, 1, 1)]:
        assert flax_conv.kernel[...][h, v, i, o] == w[o, i, h, v]


def test_batchnorm_running_statistics_and_count():
    torch_bn = randomized(torch.nn.BatchNorm1d(6))
    flax_bn = load_torch_state_dict(nnx.BatchNorm(6, rngs=nnx.Rngs(0)), torch_bn.state_dict())
    assert isinstance(flax_bn.mean, nnx.BatchStat) and isinstance(flax_bn.var, nnx.BatchStat)
    np.testing.assert_array_equal(flax_bn.mean[...], torch_bn.running_mean.numpy())
    np.testing.assert_array_equal(flax_bn.var[...], torch_bn.running_var.numpy())
    sd = dict(torch_bn.state_dict())
    sd["num_batches_tracked"] = torch.tensor(3, dtype=torch.int32)  # any integer count is accepted
    load_torch_state_dict(flax_bn, sd)
    sd["num_batches_tracked"] = torch.tensor(3.0)
    with pytest.raises(ConversionError, match="'num_batches_tracked': dtype float32 is not an integer dtype"):
        load_torch_state_dict(flax_bn, sd)


@pytest.mark.parametrize("bad", [torch.int64, torch.bool])
def test_integer_or_bool_values_for_float_parameters_are_refused(bad):
    sd = dict(randomized(torch.nn.Conv1d(4, 6, 3)).state_dict())
    sd["weight"] = sd["weight"].to(bad)
    conv = nnx.Conv(4, 6, (3,), rngs=nnx.Rngs(0))
    before = np.array(conv.bias[...])
    with pytest.raises(ConversionError, match=rf"'weight': dtype {str(bad).removeprefix('torch.')} is not floating"):
        load_torch_state_dict(conv, sd)
    np.testing.assert_array_equal(conv.bias[...], before)  # nothing was loaded


def test_torch_activation_declares_channel_layouts():
    rng = np.random.default_rng(0)
    y = rng.standard_normal((2, 7, 5, 6)).astype(np.float32)  # flax (N, H, W, C)
    conv = nnx.Conv(4, 6, (3, 3), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(torch_activation(conv, y), np.moveaxis(y, -1, 1))
    np.testing.assert_array_equal(torch_activation(conv, jnp.asarray(y[:, :, 0])), np.moveaxis(y[:, :, 0], -1, 1))
    bn = nnx.BatchNorm(6, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(torch_activation(bn, y), np.moveaxis(y, -1, 1))
    np.testing.assert_array_equal(torch_activation(bn, y[:, 0, 0]), y[:, 0, 0])  # (N, C) agrees
    channels_first_bn = nnx.BatchNorm(7, axis=1, rngs=nnx.Rngs(0))  # already torch's layout
    assert torch_activation(channels_first_bn, y) is y
    for same in [nnx.Linear(6, 6, rngs=nnx.Rngs(0)), nnx.LayerNorm(6, rngs=nnx.Rngs(0)), flax_ln.TorchLayerNorm(6)]:
        assert torch_activation(same, y) is y


# ---------------------------------------------------------------------------------------
# User extensions: a rule for a module type of one's own, and renames.


class TorchGate(torch.nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in))
        self.gain = torch.nn.Parameter(torch.randn(n_out))

    def forward(self, x):
        return torch.sigmoid(x @ self.weight.T) * self.gain


class FlaxGate(nnx.Module):
    def __init__(self, n_in, n_out):
        self.w = nnx.Param(jnp.zeros((n_in, n_out)))  # (in, out)
        self.g = nnx.Param(jnp.zeros((n_out,)))

    def __call__(self, x):
        return jax.nn.sigmoid(x @ self.w[...]) * self.g[...]


GATE_LEAVES = [Leaf("w", "weight", Permute("out in", "in out")), Leaf("g", "gain")]


def test_unregistered_module_type_is_an_error_naming_it():
    model = nnx.Dict(enc=nnx.Dict(gate=FlaxGate(3, 5)), head=nnx.Linear(5, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(MissingRuleError) as info:
        to_torch_state_dict(model)
    message = str(info.value)
    for fragment in ["'enc.gate'", "FlaxGate", "g, w", "register_rule(", "Leaf('w', <torch name>)"]:
        assert fragment in message
    assert "head" not in message


def test_registered_rule_converts_a_custom_module(rules):
    register_rule(FlaxGate, GATE_LEAVES)
    torch_gate = TorchGate(3, 5)
    flax_gate = load_torch_state_dict(FlaxGate(3, 5), torch_gate.state_dict())
    x = torch.randn(4, 3)
    np.testing.assert_allclose(flax_gate(jnp.asarray(x.numpy())), torch_gate(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    back = to_torch_state_dict(flax_gate)
    TorchGate(3, 5).load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)
    np.testing.assert_array_equal(back["weight"], torch_gate.weight.detach().numpy())


def test_registered_activation_layout_is_applied(rules):
    register_rule(FlaxGate, GATE_LEAVES, activation_layout=Permute("n c t", "n t c"))
    y = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(torch_activation(FlaxGate(3, 4), y), y.transpose(0, 2, 1))


def test_register_rule_rejects_what_is_not_a_rule(rules):
    with pytest.raises(TypeError, match="nnx.Module subclass"):
        register_rule(torch.nn.Linear, GATE_LEAVES)
    with pytest.raises(TypeError, match="Leaf or DerivedBuffer"):
        register_rule(FlaxGate, [("w", "weight")])
    with pytest.raises(ValueError, match="same distinct axis names"):
        Permute("out in", "in kernel")
    register_rule(FlaxGate, GATE_LEAVES, stacked=lambda gate: {"blocks": 2})  # no such child
    with pytest.raises(ValueError, match="declares stacked layers at 'blocks', which module '<root>' does not hold"):
        to_torch_state_dict(FlaxGate(3, 5))
    register_rule(FlaxGate, [Leaf("weight", "weight")])  # a typo'd flax attribute
    with pytest.raises(AttributeError, match="names attribute 'weight', which module '<root>' lacks"):
        to_torch_state_dict(FlaxGate(3, 5))


class TorchStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.linear = torch.nn.Linear(4, 3)


class FlaxStack(nnx.Module):
    def __init__(self):
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(2)])
        self.proj = nnx.Linear(4, 3, rngs=nnx.Rngs(2))


class ProjectedLinear(nnx.Linear):
    """A subclass with a renamed child keeps nnx.Linear's leaves."""


def test_registered_rename_maps_attribute_names(rules):
    torch_model = randomized(TorchStack())
    register_rename(FlaxStack, {"blocks": "layers", "proj": "linear"})
    flax_model = load_torch_state_dict(FlaxStack(), torch_model.state_dict())
    np.testing.assert_array_equal(flax_model.proj.kernel[...], torch_model.linear.weight.detach().numpy().T)
    back = to_torch_state_dict(flax_model)
    assert back.keys() == torch_model.state_dict().keys()
    TorchStack().load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)
    assert torch_module_paths(flax_model) == {
        "": "",
        "blocks": "layers",
        "blocks.0": "layers.0",
        "blocks.1": "layers.1",
        "proj": "linear",
    }

    register_rename(ProjectedLinear, {"unused": "x"})
    assert RULES[ProjectedLinear].leaves == RULES[nnx.Linear].leaves


class Counter(nnx.Module):
    """An integer buffer of the user's own (torch: a long tensor registered with register_buffer)."""

    def __init__(self):
        self.count = nnx.BatchStat(jnp.zeros((2,), jnp.int32))


def test_integer_buffers_stay_integer(rules):
    register_rule(Counter, [Leaf("count", "count")])
    model = load_torch_state_dict(Counter(), {"count": torch.tensor([3, 2**20])})
    assert jnp.issubdtype(model.count.dtype, jnp.integer)
    np.testing.assert_array_equal(model.count[...], [3, 2**20])
    assert np.issubdtype(to_torch_state_dict(model)["count"].dtype, np.integer)
    with pytest.raises(ConversionError, match="'count': dtype float32 is not an integer dtype"):
        load_torch_state_dict(model, {"count": torch.tensor([3.0, 1.0])})


class TorchChain(TorchStack):
    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.linear(x)


class FlaxChain(FlaxStack):
    def __call__(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return self.proj(x)


def test_engine_pairs_renamed_submodules_by_their_torch_path(rules):
    """A mistake inside a renamed module is named by its torch path, not lost for want of a pair."""
    from flax_ln.parity import compare_modules

    register_rename(FlaxChain, {"blocks": "layers", "proj": "linear"})
    torch_model = randomized(TorchChain())
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    assert compare_modules(torch_model, FlaxChain(), x).passed

    class BiaslessLinear(nnx.Linear):  # holds a bias (so it converts) but forgets to add it
        def __call__(self, x):
            return x @ self.kernel[...]

    planted = FlaxChain()
    planted.blocks[1] = BiaslessLinear(4, 4, rngs=nnx.Rngs(0))
    report = compare_modules(torch_model, planted, x)
    assert not report.passed
    assert report.first_divergence is not None and report.first_divergence.module == "layers.1"
    assert report.first_divergence.flax_module == "blocks.1"  # the renamed path, dotted
    assert report.first_divergence.describe().startswith("first divergence: layers.1  (")  # no key map: one path


class TorchTiedLM(torch.nn.Module):
    """A head that IS the embedding (one Parameter, two keys)."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(7, 4)
        self.lm_head = torch.nn.Linear(4, 7, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.wte(idx))


class FlaxTiedLM(nnx.Module):
    """Its twin: one embedding variable, the head through ``attend``."""

    def __init__(self):
        self.wte = nnx.Embed(7, 4, rngs=nnx.Rngs(0))

    def __call__(self, idx):
        return self.wte.attend(self.wte(idx))


class TorchSharedLinear(torch.nn.Module):
    """One Linear under two names."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = self.a

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class FlaxSharedLinear(nnx.Module):
    def __init__(self):
        self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.b = self.a

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


@pytest.mark.parametrize(
    ("make_torch", "make_flax", "inputs", "ties"),
    [
        (
            TorchTiedLM,
            FlaxTiedLM,
            lambda: (np.array([[0, 3, 6]]),),
            {"wte.weight": (("wte.weight", "lm_head.weight"), ("wte.embedding",))},
        ),
        (
            TorchSharedLinear,
            FlaxSharedLinear,
            lambda: (np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32),),
            {"a.weight": (("a.weight", "b.weight"), ("a.kernel",)), "a.bias": (("a.bias", "b.bias"), ("a.bias",))},
        ),
    ],
    ids=["a head that reuses the embedding", "a module shared under two names"],
)
def test_ties_and_shared_modules_of_mirrored_twins_go_through_the_rule_table(make_torch, make_flax, inputs, ties):
    """A tie kept as one variable on both sides loads through the rules (the alias's key fills the variable its
    tie's key fills) and is compared, report.ties filled as a key map's plan fills it."""
    torch.manual_seed(0)
    torch_model, flax_model = make_torch(), make_flax()
    state_dict = torch_model.state_dict()
    load_torch_state_dict(flax_model, state_dict)
    for key, value in to_torch_state_dict(flax_model).items():
        np.testing.assert_array_equal(value, state_dict[key].numpy(), err_msg=key)
    report = compare_modules(torch_model, make_flax(), inputs())
    assert report.passed, report
    assert {name: (tie.torch_aliases, tie.flax_paths) for name, tie in report.ties.items()} == ties
    # an alias of another shape than its tie's key is refused, naming both
    alias = next(iter(ties.values()))[0][1]
    bad = {k: v.clone() for k, v in state_dict.items()}
    bad[alias] = state_dict[alias][:1]  # a view: still the same memory, a tie of another shape is none
    with pytest.raises(ConversionError, match=f"unexpected key '{alias}'"):
        load_torch_state_dict(make_flax(), bad)
