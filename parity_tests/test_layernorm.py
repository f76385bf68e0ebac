"""Parity of flax_ln's norms with torch_ref.LayerNorm, torch.nn.LayerNorm and a float64 NumPy formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import flax_ln
import torch_ref
from flax_ln.parity import Tolerance, assert_parity, relative_error

# (flax class, torch factory, numpy ddof, flax param names -> torch param names)
NORMS = {
    "book": (flax_ln.LayerNorm, lambda n, eps: torch_ref.LayerNorm(n, eps), 1, {"a_2": "a_2", "b_2": "b_2"}),
    "torch": (
        flax_ln.TorchLayerNorm,
        lambda n, eps: torch.nn.LayerNorm(n, eps),
        0,
        {"scale": "weight", "bias": "bias"},
    ),
}
DEFAULT_EPS = {"book": 1e-6, "torch": 1e-5}


def numpy_norm(x, scale, offset, eps, ddof):
    """Float64 ground truth, written independently of both frameworks."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).sum(-1, keepdims=True) / (x.shape[-1] - ddof)
    return np.asarray(scale, np.float64) * (x - mean) / np.sqrt(var + eps) + np.asarray(offset, np.float64)


def affine(flax_mod, kind):
    """(scale, offset) of a flax norm as NumPy arrays."""
    return [np.asarray(getattr(flax_mod, name)[...]) for name in NORMS[kind][3]]


def make_pair(kind, features, dtype, seed=0, eps=None):
    """A torch norm with random affine parameters and its flax twin loaded through the converter."""
    flax_cls, torch_factory, _, _ = NORMS[kind]
    eps = DEFAULT_EPS[kind] if eps is None else eps
    torch.manual_seed(seed)
    torch_mod = torch_factory(features, eps).to(getattr(torch, dtype))
    with torch.no_grad():
        for p in torch_mod.parameters():
            p.copy_(torch.randn_like(p))
    flax_mod = flax_cls(features, eps, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0))
    flax_ln.load_torch_state_dict(flax_mod, torch_mod.state_dict())
    return torch_mod, flax_mod


# One norm has no depth to amplify rounding, so these tests keep bounds tighter than the
# engine's policy (float64 1e-12 / 1e-10, float32 1e-5 / 1e-4), with no zero-gradient rule:
# float64: both frameworks evaluate the same formula; only op-order rounding (~1e-16) remains.
# float32: both sides round each op to 24 bits but reduce in different orders (XLA tree
#   reductions vs torch's vectorised ones); over <=1024 terms that is a few float32 ulps,
#   ~1e-7 relative, so 1e-6 leaves one order of headroom.
TIGHT = {
    "float64": {"output": Tolerance(1e-12), "grad": Tolerance(1e-11)},
    "float32": {"output": Tolerance(1e-6), "grad": Tolerance(1e-6)},
}


def assert_norm_parity(torch_mod, flax_mod, x, dtype):
    """Output and gradients (input and every parameter, by torch name) within the tight bounds above."""
    report = assert_parity(torch_mod, flax_mod, x, tolerances=TIGHT[dtype], dtype=dtype)
    names = {name for name, _ in torch_mod.named_parameters()}
    assert {r.name for r in report.results} == {"output", "grad input 0", *names}
    assert report["output"].shape == x.shape
    return report


@pytest.mark.parametrize("kind", ["book", "torch"])
@pytest.mark.parametrize("shape", [(7, 16), (2, 3, 5, 64), (1600,)])
def test_float64_exact(x64, kind, shape):
    torch_mod, flax_mod = make_pair(kind, shape[-1], "float64")
    rng = np.random.default_rng(1)
    x = rng.normal(size=shape) * 3 + 0.5
    assert_norm_parity(torch_mod, flax_mod, x, "float64")
    y_flax = flax_mod(jnp.asarray(x))
    y_torch = torch_mod(torch.tensor(x)).detach().numpy()
    assert y_flax.dtype == jnp.float64 and y_flax.shape == shape
    y_np = numpy_norm(x, *affine(flax_mod, kind), DEFAULT_EPS[kind], NORMS[kind][2])
    # float64 ground truth: each framework on its own is exact to rounding
    assert relative_error(y_flax, y_np) <= 1e-12
    assert relative_error(y_torch, y_np) <= 1e-12


@pytest.mark.parametrize("kind", ["book", "torch"])
@pytest.mark.parametrize("shape", [(8, 32), (4, 1024)])
def test_float32_close(kind, shape):
    torch_mod, flax_mod = make_pair(kind, shape[-1], "float32")
    rng = np.random.default_rng(2)
    x = (rng.normal(size=shape) * 2 + 1).astype(np.float32)
    assert_norm_parity(torch_mod, flax_mod, x, "float32")  # dtypes too: float32 everywhere
    y_flax = jax.jit(flax_mod.__call__)(jnp.asarray(x))
    assert y_flax.dtype == jnp.float32 and y_flax.shape == shape


@pytest.mark.parametrize("kind", ["book", "torch"])
@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_half_precision_inputs_use_float32_statistics(kind, half):
    _, flax_mod = make_pair(kind, 256, "float32")
    rng = np.random.default_rng(3)
    x_half = jnp.asarray(rng.normal(size=(16, 256)) * 4 + 100, dtype=getattr(jnp, half))
    reference = flax_mod(x_half.astype(jnp.float32))  # float32 result on the same rounded input

    # flax convention: dtype=None takes the result type of input and parameters -> float32.
    y = flax_mod(x_half)
    assert y.dtype == jnp.float32 and y.shape == x_half.shape
    # Statistics in float32 make this the float32 computation itself; half-precision
    # accumulation of a mean near 100 would be off by ~1e-1 relative.
    assert relative_error(y, reference) <= 1e-6

    # Asking for half-precision output only rounds the float32 result at the end.
    flax_mod.dtype = getattr(jnp, half)
    y_half = flax_mod(x_half)
    assert y_half.dtype == getattr(jnp, half)
    unit_roundoff = float(jnp.finfo(getattr(jnp, half)).eps)  # 2^-7 (bf16), 2^-10 (fp16)
    assert relative_error(y_half, reference) <= unit_roundoff


def test_torch_default_eps_and_keys():
    assert flax_ln.LayerNorm(4).eps == 1e-6 == torch_ref.LayerNorm(4).eps
    assert flax_ln.TorchLayerNorm(4).eps == 1e-5 == torch.nn.LayerNorm(4).eps
    assert list(torch_ref.LayerNorm(4).state_dict()) == ["a_2", "b_2"]
    assert set(flax_ln.to_torch_state_dict(flax_ln.LayerNorm(4))) == {"a_2", "b_2"}


def test_differs_from_look_alikes():
    """The book's norm is neither torch's nn.LayerNorm nor the Annotated Transformer's (std + eps)."""
    x = np.random.default_rng(4).normal(size=(3, 6))
    book = np.asarray(flax_ln.LayerNorm(6)(jnp.asarray(x, jnp.float32)))
    biased = numpy_norm(x, 1.0, 0.0, 1e-6, ddof=0)
    annotated = (x - x.mean(-1, keepdims=True)) / (x.std(-1, ddof=1, keepdims=True) + 1e-6)
    assert relative_error(book, numpy_norm(x, 1.0, 0.0, 1e-6, ddof=1)) < 1e-6
    assert relative_error(book, biased) > 1e-2  # sqrt(6/5) apart
    assert relative_error(book, annotated) < 1e-5  # close but not the same formula at eps=1e-6 ...
    x_small = x * 1e-3  # ... and far apart when std ~ sqrt(eps)
    annotated_small = (x_small - x_small.mean(-1, keepdims=True)) / (x_small.std(-1, ddof=1, keepdims=True) + 1e-6)
    book_small = np.asarray(flax_ln.LayerNorm(6)(jnp.asarray(x_small, jnp.float32)))
    assert relative_error(book_small, annotated_small) > 1e-4


@pytest.mark.parametrize("kind", ["book", "torch"])
def test_feature_size_one_is_nan_like_torch(kind):
    torch_mod, flax_mod = make_pair(kind, 1, "float32")
    x = np.array([[2.0], [-1.0]], np.float32)
    y_torch = torch_mod(torch.tensor(x)).detach().numpy()
    y_flax = np.asarray(flax_mod(jnp.asarray(x)))
    np.testing.assert_array_equal(np.isnan(y_flax), np.isnan(y_torch))
    if kind == "book":  # unbiased std of one element is 0/0 in torch
        assert np.isnan(y_flax).all()
    else:  # biased variance of one element is 0: the output is the bias
        np.testing.assert_allclose(y_flax, y_torch, rtol=1e-6)


@pytest.mark.parametrize("kind", ["book", "torch"])
def test_constant_rows_give_the_bias(kind):
    torch_mod, flax_mod = make_pair(kind, 8, "float32")
    x = np.full((3, 8), 2.5, np.float32)  # exactly representable: x - mean == 0
    y_flax = np.asarray(flax_mod(jnp.asarray(x)))
    bias = np.asarray(getattr(flax_mod, "b_2" if kind == "book" else "bias")[...])
    np.testing.assert_array_equal(y_flax, np.broadcast_to(bias, x.shape))
    np.testing.assert_array_equal(y_flax, torch_mod(torch.tensor(x)).detach().numpy())


@pytest.mark.parametrize("kind", ["book", "torch"])
def test_non_finite_inputs_propagate(kind):
    torch_mod, flax_mod = make_pair(kind, 4, "float32")
    x = np.array([[1, 2, 3, 4], [1, np.inf, 3, 4], [np.nan, 0, 0, 1], [-np.inf, np.inf, 0, 0]], np.float32)
    y_flax = np.asarray(jax.jit(flax_mod.__call__)(jnp.asarray(x)))
    y_torch = torch_mod(torch.tensor(x)).detach().numpy()
    np.testing.assert_array_equal(np.isnan(y_flax), np.isnan(y_torch))
    assert np.isfinite(y_flax[0]).all() and np.isnan(y_flax[1:]).all()


@pytest.mark.parametrize("kind", ["book", "torch"])
def test_default_is_accurate_at_large_offset(kind):
    """Mean 1e4, spread 1e-2, float32: the default statistics stay accurate where torch's lose digits."""
    torch_mod, flax_mod = make_pair(kind, 1024, "float32")
    rng = np.random.default_rng(5)
    x = (1e4 + 1e-2 * rng.normal(size=(64, 1024))).astype(np.float32)
    truth = numpy_norm(x, *affine(flax_mod, kind), flax_mod.eps, NORMS[kind][2])
    default_err = relative_error(flax_mod(jnp.asarray(x)), truth)
    torch_err = relative_error(torch_mod(torch.tensor(x)).detach().numpy(), truth)
    assert default_err <= 1e-4
    assert torch_err > 1e-2  # the input really is hard for a plain two-pass


def test_gradients_of_offset_rows(x64):
    torch_mod, flax_mod = make_pair("book", 32, "float64")
    rng = np.random.default_rng(6)
    x = rng.normal(size=(5, 32)) + 3.0
    assert_norm_parity(torch_mod, flax_mod, x, "float64")


def test_transforms_jit_vmap_grad():
    mod = flax_ln.LayerNorm(8)
    x = jnp.asarray(np.random.default_rng(7).normal(size=(3, 4, 8)), jnp.float32)
    eager = mod(x)
    np.testing.assert_allclose(jax.jit(mod.__call__)(x), eager, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.vmap(mod.__call__)(x), eager, rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda v: jnp.sum(mod(v) ** 3))(x)
    assert g.shape == x.shape and np.isfinite(np.asarray(g)).all()
    # d/dx sum(y) is zero: y sums to sum(b_2) = 0 whatever x is.
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(mod(v)))(x), 0.0, atol=1e-5)


@pytest.mark.parametrize("kind", ["book", "torch"])
def test_bad_input_raises_clear_error(kind):
    mod = NORMS[kind][0](8)
    with pytest.raises(ValueError, match=r"last axis of size 8.*\(3, 5\)"):
        mod(jnp.ones((3, 5)))
    with pytest.raises(ValueError, match="floating-point"):
        mod(jnp.ones((3, 8), jnp.int32))
    with pytest.raises(ValueError, match="last axis"):
        jax.jit(mod.__call__)(jnp.ones((2, 9)))


# ---- property tests: flax (float64) against the NumPy formula and torch ----------------------

shapes = st.tuples(
    st.lists(st.integers(1, 4), min_size=0, max_size=2),
    st.sampled_from([1, 2, 3, 7, 64, 1600]),
)


@given(
    shape=shapes,
    scale=st.floats(1e-3, 1e3),
    offset=st.floats(-1e3, 1e3),
    eps=st.sampled_from([0.0, 1e-12, 1e-6, 1e-5, 1e-2]),
    kind=st.sampled_from(["book", "torch"]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_numpy_and_torch(shape, scale, offset, eps, kind, seed):
    lead, features = shape
    shape = (*lead, features)
    with jax.enable_x64(True):
        torch_mod, flax_mod = make_pair(kind, features, "float64", seed=seed % 100, eps=eps)
        x = np.random.default_rng(seed).normal(size=shape) * scale + offset
        y_flax = np.asarray(flax_mod(jnp.asarray(x)))
    y_torch = torch_mod(torch.tensor(x)).detach().numpy()
    y_np = numpy_norm(x, *affine(flax_mod, kind), eps, NORMS[kind][2])
    assert y_flax.shape == shape
    np.testing.assert_array_equal(np.isnan(y_flax), np.isnan(y_np))
    np.testing.assert_array_equal(np.isnan(y_flax), np.isnan(y_torch))
    # Rows whose spread is small against their offset lose digits to cancellation in
    # every implementation alike (condition number ~ |offset| / scale); bound by that.
    cond = 1.0 + abs(offset) / scale
    ok = ~np.isnan(y_np)
    if ok.any():
        assert relative_error(y_flax[ok], y_np[ok]) <= 1e-12 * cond
        assert relative_error(y_flax[ok], y_torch[ok]) <= 1e-12 * cond


# ---- the hand-written JVP under second order, vmap and remat (float64) -------------------------


@pytest.mark.parametrize("kind", ["book", "torch"])
def test_second_order_matches_torch(x64, kind):
    """Reverse over reverse through the custom JVP (a Hessian-vector product) agrees with torch's double backward."""
    torch_mod, flax_mod = make_pair(kind, 24, "float64")
    rng = np.random.default_rng(8)
    x, cot, v = (rng.normal(size=(5, 24)) * 2 + 0.3 for _ in range(3))

    x_t = torch.tensor(x, requires_grad=True)
    (gx_t,) = torch.autograd.grad((torch_mod(x_t) * torch.tensor(cot)).sum(), x_t, create_graph=True)
    names = list(NORMS[kind][3].values())
    params_t = [dict(torch_mod.named_parameters())[k] for k in names]
    second_t = torch.autograd.grad((gx_t * torch.tensor(v)).sum(), [x_t, *params_t], allow_unused=True)

    graphdef, params = nnx.split(flax_mod, nnx.Param)

    def input_grad(params, x):
        return jax.grad(lambda x: jnp.sum(nnx.merge(graphdef, params)(x) * cot))(x)

    hvp_params, hvp_x = jax.grad(lambda p, x: jnp.sum(input_grad(p, x) * v), argnums=(0, 1))(params, jnp.asarray(x))
    second_params = flax_ln.to_torch_state_dict(nnx.merge(graphdef, hvp_params))  # keyed by torch name
    assert list(second_params) == names
    second_flax = [hvp_x, *second_params.values()]
    # float64: two derivatives composed still round only at ~1e-16, so the first-order gradient bound holds
    for name, a, b in zip(["input", *names], second_flax, second_t):
        if b is None:  # the bias does not reach d(loss)/dx: torch reports it unused, JAX gives zeros
            np.testing.assert_array_equal(np.asarray(a), 0.0)
        else:
            assert relative_error(a, b.numpy()) <= 1e-11, name


def test_gradients_under_vmap_and_remat(x64):
    mod = flax_ln.LayerNorm(16)
    mod.a_2[...] = jnp.linspace(0.5, 2.0, 16, dtype=mod.a_2.dtype)
    x = jnp.asarray(np.random.default_rng(9).normal(size=(6, 16)) + 1.0)

    def loss(v):
        return jnp.sum(jnp.tanh(mod(v)))

    expected = jax.grad(loss)(x)
    per_row = jax.vmap(jax.grad(loss))(x)  # each row on its own is the same problem
    remat = jax.grad(jax.checkpoint(loss))(x)
    assert relative_error(per_row, expected) <= 1e-12
    assert relative_error(remat, expected) <= 1e-12
