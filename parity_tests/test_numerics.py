"""Numerics of the norms and models: accuracy against float64 truth, every JAX transformation
through every module, inputs past the float32 range, and the norms' constructor checks.

Accuracy: per row, against float64 NumPy truth on the same (rounded) input,
``flax error <= max(torch error, floor)``, where torch's error is measured on that very
input. The floor is 2e-7 for float32 (a few float32 roundings, where either framework
may win by summation order) and the same number of roundings of the half type for
bf16/fp16 (2e-7 scaled by the ratio of machine epsilons).

Transformations: float64 (x64 scoped to each test), small configs. Forward-mode results
are checked against float64 central differences and against ``torch.func.jvp`` on the
torch twin loaded with the same weights through the converter.
"""

from __future__ import annotations

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
from flax_ln.models.layernorm import normalize
from flax_ln.parity import relative_error
from torch_ref import encoder_decoder as te
from torch_ref import gpt as tg

KINDS = {  # flax class, torch factory, ddof, eps, torch parameter names (scale, offset)
    "book": (flax_ln.LayerNorm, torch_ref.LayerNorm, 1, 1e-6, ("a_2", "b_2")),
    "torch": (flax_ln.TorchLayerNorm, torch.nn.LayerNorm, 0, 1e-5, ("weight", "bias")),
}
F32_FLOOR = 2e-7
WIDTHS = [2, 3, 5, 7, 31, 64, 100, 768, 1024, 1600, 8192]


def truth(x, scale, offset, eps, ddof):
    """The book's formula in float64 NumPy, on the input as given (already rounded to its dtype)."""
    x = np.asarray(x, np.float64)
    centered = x - x.mean(-1, keepdims=True)
    var = (centered * centered).sum(-1, keepdims=True) / (x.shape[-1] - ddof)
    return np.asarray(scale, np.float64) * centered / np.sqrt(var + eps) + np.asarray(offset, np.float64)


def row_errors(y, expected):
    """Relative Frobenius error per row, ``||y - t|| / ||t||`` (absolute where ``t`` is 0)."""
    diff = np.linalg.norm(np.asarray(y, np.float64) - expected, axis=-1)
    norm = np.linalg.norm(expected, axis=-1)
    return np.where(norm > 0, diff / np.where(norm > 0, norm, 1), diff)


def torch_norm(kind, features, scale, offset, dtype):
    _, factory, _, eps, names = KINDS[kind]
    module = factory(features, eps).to(dtype)
    with torch.no_grad():
        for name, value in zip(names, (scale, offset)):
            getattr(module, name).copy_(torch.tensor(value, dtype=torch.float32))
    return module


@jax.jit(static_argnames=("ddof", "eps"))
def flax_norm(x, scale, offset, *, ddof, eps):
    # What the modules run (their __call__ is normalize after the shape checks), jitted as in use.
    return normalize(x, scale, offset, eps=eps, ddof=ddof)


def hard_rows(data, features, rows=4, max_log10_offset=6.0):
    """Rows ``offset + spread * N(0, 1)``: offsets 0 or ±1e2..1e6, spreads 1e-3..1e3."""
    offset = data.draw(
        st.one_of(
            st.just(0.0),
            st.builds(lambda sign, e: sign * 10.0**e, st.sampled_from([-1.0, 1.0]), st.floats(2, max_log10_offset)),
        ),
        label="offset",
    )
    spread = 10.0 ** data.draw(st.floats(-3, 3), label="log10 spread")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    rng = np.random.default_rng(seed)
    # The affine step is one multiply-add, the same in both frameworks; a random scale keeps
    # it honest, a zero offset keeps the output from cancelling (which would amplify one
    # final rounding into a relative error that says nothing about the statistics).
    scale = rng.uniform(0.5, 2.0, features).astype(np.float32)
    offset_param = np.zeros(features, np.float32)
    return offset + spread * rng.normal(size=(rows, features)), scale, offset_param


@given(data=st.data(), kind=st.sampled_from(sorted(KINDS)), features=st.sampled_from(WIDTHS))
def test_float32_never_less_accurate_than_torch(data, kind, features):
    _, _, ddof, eps, _ = KINDS[kind]
    x, scale, offset = hard_rows(data, features)
    x = x.astype(np.float32)
    expected = truth(x, scale, offset, eps, ddof)
    with torch.no_grad():
        torch_err = row_errors(
            torch_norm(kind, features, scale, offset, torch.float32)(torch.tensor(x)).numpy(), expected
        )
    flax_err = row_errors(
        flax_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(offset), ddof=ddof, eps=eps), expected
    )
    bound = np.maximum(torch_err, F32_FLOOR)
    assert (flax_err <= bound).all(), (flax_err, torch_err)


@given(
    data=st.data(),
    kind=st.sampled_from(sorted(KINDS)),
    features=st.sampled_from(WIDTHS),
    half=st.sampled_from(["bfloat16", "float16"]),
)
def test_half_precision_never_less_accurate_than_torch(data, kind, features, half):
    """Half-precision input, parameters and output on both sides; the floor is that type's rounding."""
    _, _, ddof, eps, _ = KINDS[kind]
    # float16 tops out at 65504: offsets up to 10**4.5 (plus a spread up to 1e3) stay representable.
    x, scale, offset = hard_rows(data, features, max_log10_offset=6.0 if half == "bfloat16" else 4.5)
    jnp_half, torch_half = getattr(jnp, half), getattr(torch, half)
    x = np.asarray(jnp.asarray(x, jnp_half).astype(jnp.float32))  # the half input, exactly
    scale = np.asarray(jnp.asarray(scale, jnp_half).astype(jnp.float32))
    assert np.isfinite(x).all()
    expected = truth(x, scale, offset, eps, ddof)
    with torch.no_grad():
        y_torch = torch_norm(kind, features, scale, offset, torch_half)(torch.tensor(x).to(torch_half))
    torch_err = row_errors(y_torch.float().numpy(), expected)
    args = (jnp.asarray(x, jnp_half), jnp.asarray(scale, jnp_half), jnp.asarray(offset, jnp_half))
    y_flax = flax_norm(*args, ddof=ddof, eps=eps)
    assert y_flax.dtype == jnp_half
    flax_err = row_errors(y_flax.astype(jnp.float32), expected)
    floor = F32_FLOOR * float(jnp.finfo(jnp_half).eps / jnp.finfo(jnp.float32).eps)
    finite = np.isfinite(torch_err)  # torch's own statistics may overflow in half precision
    assert (flax_err[finite] <= np.maximum(torch_err[finite], floor)).all(), (flax_err, torch_err)
    assert np.isfinite(flax_err).all()


def unit_affine_errors(kind, x, error):
    """``(torch error, flax error)`` against float64 truth on float32 rows ``x``, scale 1, offset 0."""
    _, _, ddof, eps, _ = KINDS[kind]
    features = x.shape[-1]
    scale, zero = np.ones(features, np.float32), np.zeros(features, np.float32)
    expected = truth(x, scale, zero, eps, ddof)
    with torch.no_grad():
        y_torch = torch_norm(kind, features, scale, zero, torch.float32)(torch.tensor(x)).numpy()
    y_flax = flax_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(zero), ddof=ddof, eps=eps)
    return error(y_torch, expected), error(y_flax, expected)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("offset", [1e2, 1e4, 1e6])
def test_offset_rows_beat_torch(kind, offset):
    """Rows far from zero: width 1024, spread 1e-2 of the offset's ulp scale, flax well below torch.

    Spread 1e-2 at 1e2 and 1e4; at 1e6 float32 spaces numbers 0.0625 apart, so spread 1.
    """
    rng = np.random.default_rng(12)
    x = (offset + (1.0 if offset >= 1e6 else 1e-2) * rng.normal(size=(64, 1024))).astype(np.float32)
    torch_err, flax_err = unit_affine_errors(kind, x, relative_error)
    assert torch_err > 1e-4  # the rows really are ill-conditioned for torch's statistics
    assert flax_err <= 4 * F32_FLOOR  # a few float32 roundings, whatever the offset


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("lead_value, lead_count", [(30.0, 8), (1e4, 8), (1e4, 1), (1e5, 8)])
def test_rows_with_outlying_first_elements_stay_as_accurate_as_torch(kind, lead_value, lead_count):
    """Rows whose first elements sit far outside the rest (padding, a spike): no statistic may
    lean on them. A shift taken from the first eight elements made these rows 5-9x less
    accurate than torch (1.1e-6 against 1.3e-7 at 1e4); the row's own mean cannot sit outside it."""
    x = np.random.default_rng(14).normal(size=(64, 1024)).astype(np.float32)
    x[:, :lead_count] = lead_value
    torch_err, flax_err = unit_affine_errors(kind, x, row_errors)
    assert (flax_err <= np.maximum(torch_err, F32_FLOOR)).all(), (flax_err.max(), torch_err.max())


# ---- large inputs: float64 answers while squared deviations fit float32, the offset beyond -----


def huge_rows(magnitude, seed=13):
    rng = np.random.default_rng(seed)
    x = (magnitude * rng.uniform(0.5, 3.0, size=(4, 6)) * rng.choice([-1, 1], size=(4, 6))).astype(np.float32)
    return x, rng


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("magnitude", [1e15, 1e18])
def test_large_inputs_give_the_float64_answer(kind, magnitude):
    """Rows up to ~1e18, whose squared deviations still fit float32, are normalised to float64 truth."""
    flax_cls, _, ddof, eps, _ = KINDS[kind]
    x, rng = huge_rows(magnitude)
    module = flax_cls(6)
    y = module(jnp.asarray(x))
    expected = truth(x, 1.0, 0.0, eps, ddof)
    assert relative_error(y, expected) <= 1e-6  # float32 rounding of the shifted statistics: a few ulps
    # The gradient is the float64 one too: d sum(y * w) / dx, w fixed.
    w = rng.normal(size=(4, 6))
    g = jax.grad(lambda v: jnp.sum(module(v) * w.astype(np.float32)))(jnp.asarray(x))
    with jax.enable_x64(True):
        g64 = jax.grad(lambda v: jnp.sum(flax_cls(6, param_dtype=jnp.float64)(v) * w))(jnp.asarray(x, jnp.float64))
    assert np.abs(np.asarray(g64)).max() > 0
    assert relative_error(g, g64) <= 1e-5  # float32 gradient of tiny values (~1/magnitude), a few ulps


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_rows_whose_squares_overflow_give_the_offset(kind):
    """Documented limit: squared deviations beyond float32 make the variance infinite, and the
    row normalises to ``offset``, as the book's torch formula does (``nn.LayerNorm`` gives NaN)."""
    flax_cls, _, ddof, eps, _ = KINDS[kind]
    x, _ = huge_rows(1e30)
    offset = np.arange(6, dtype=np.float32)
    module = flax_cls(6)
    getattr(module, "a_2" if kind == "book" else "scale")[...] = jnp.full(6, 2.0)
    getattr(module, "b_2" if kind == "book" else "bias")[...] = jnp.asarray(offset)
    y = np.asarray(module(jnp.asarray(x)))
    np.testing.assert_array_equal(y, np.broadcast_to(offset, y.shape))
    if kind == "book":
        with torch.no_grad():
            y_book = torch_ref.LayerNorm(6, eps)
            y_book.a_2.fill_(2.0)
            y_book.b_2.copy_(torch.from_numpy(offset))
            np.testing.assert_array_equal(y_book(torch.tensor(x)).numpy(), y)


@pytest.mark.parametrize("cls", [flax_ln.LayerNorm, flax_ln.TorchLayerNorm])
def test_features_argument_is_checked(cls):
    for bad in (-1, 0):
        with pytest.raises(ValueError, match=r"features must be a positive int.*" + str(bad)):
            cls(bad)
    for bad in (2.5, "4", True, None):
        with pytest.raises(TypeError, match="features must be a positive int"):
            cls(bad)
    assert cls(np.int64(4)).features == 4 and type(cls(np.int64(4)).features) is int


# ---- every transformation through the norms (float64) ------------------------------------------


def central_difference(f, x, v, h=1e-6):
    """``(f(x + h v) - f(x - h v)) / 2h``: truncation O(h^2) ~ 1e-12, rounding O(eps / h) ~ 1e-10."""
    plus = f(jax.tree.map(lambda a, b: a + h * b, x, v))
    minus = f(jax.tree.map(lambda a, b: a - h * b, x, v))
    return jax.tree.map(lambda p, m: (p - m) / (2 * h), plus, minus)


CD_TOL = 1e-7  # float64 central differences, h = 1e-6: ~1e-10 relative on O(1) values, 1e-7 for headroom
EXACT_TOL = 1e-11  # float64, the same derivative by two routes: op-order rounding only


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_norm_forward_mode_and_hessians(x64, kind):
    flax_cls, factory, _, eps, _ = KINDS[kind]
    rng = np.random.default_rng(14)
    torch_mod = factory(6, eps).double()
    with torch.no_grad():
        for p in torch_mod.parameters():
            p.copy_(torch.randn_like(p))
    module = flax_cls(6, param_dtype=jnp.float64)
    flax_ln.load_torch_state_dict(module, torch_mod.state_dict())
    x = jnp.asarray(rng.normal(size=(3, 6)) * 2 + 5)
    v = jnp.asarray(rng.normal(size=(3, 6)))

    y, dy = jax.jvp(module, (x,), (v,))
    assert relative_error(dy, central_difference(module, x, v)) <= CD_TOL
    _, dy_torch = torch.func.jvp(torch_mod, (torch.tensor(np.asarray(x)),), (torch.tensor(np.asarray(v)),))
    assert relative_error(dy, dy_torch.detach().numpy()) <= EXACT_TOL
    assert relative_error(jax.linearize(module, x)[1](v), dy) <= EXACT_TOL
    assert relative_error(jax.jit(lambda x, v: jax.jvp(module, (x,), (v,))[1])(x, v), dy) <= EXACT_TOL
    per_row = jax.vmap(lambda r, t: jax.jvp(module, (r,), (t,))[1])(x, v)
    assert relative_error(per_row, dy) <= EXACT_TOL
    jac_fwd, jac_rev = jax.jacfwd(module)(x), jax.jacrev(module)(x)  # (3, 6, 3, 6)
    assert relative_error(jac_fwd, jac_rev) <= EXACT_TOL
    assert relative_error(jnp.einsum("abcd,cd->ab", jac_fwd, v), dy) <= EXACT_TOL

    # Hessian of a scalar over the (small) input, three ways, and against differences of the gradient.
    w = jnp.asarray(rng.normal(size=(3, 6)))

    def scalar(x):
        return jnp.sum(jnp.tanh(module(x)) * w)

    hessian = jax.hessian(scalar)(x)  # forward over reverse
    assert relative_error(jax.jacrev(jax.jacrev(scalar))(x), hessian) <= EXACT_TOL
    assert relative_error(jax.jacfwd(jax.jacfwd(scalar))(x), hessian) <= EXACT_TOL
    hv = jnp.einsum("abcd,cd->ab", hessian, v)
    assert relative_error(hv, central_difference(jax.grad(scalar), x, v)) <= CD_TOL

    # Hessian-vector product in the parameters: jvp of grad against differences of the gradient.
    graphdef, params = nnx.split(module, nnx.Param)

    def loss(params):
        return scalar_of(nnx.merge(graphdef, params))

    def scalar_of(m):
        return jnp.sum(jnp.tanh(m(x)) * w)

    direction = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), params)
    hvp = jax.jvp(jax.grad(loss), (params,), (direction,))[1]
    expected = central_difference(jax.grad(loss), params, direction)
    for a, b in zip(jax.tree.leaves(hvp), jax.tree.leaves(expected)):
        assert relative_error(a, b) <= CD_TOL

    # scan and checkpoint: the same derivatives, step by step and rematerialised.
    _, scanned = jax.lax.scan(lambda c, xv: (c, jax.jvp(module, (xv[0],), (xv[1],))[1]), None, (x, v))
    assert relative_error(scanned, dy) <= EXACT_TOL
    remat = jax.checkpoint(scalar)
    assert relative_error(jax.grad(remat)(x), jax.grad(scalar)(x)) <= EXACT_TOL
    assert relative_error(jax.hessian(remat)(x), hessian) <= EXACT_TOL


# ---- every transformation through the models (float64) ----------------------------------------

GPT_SMALL = flax_ln.GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8)


def torch_params(torch_model):
    return {k: p.detach() for k, p in torch_model.named_parameters()}


def flax_to_torch_tangents(graphdef, tangent_params, rest, names):
    """A flax parameter tangent as torch-named tensors (through the converter's own table)."""
    named = flax_ln.to_torch_state_dict(nnx.merge(graphdef, tangent_params, rest))
    return {k: torch.tensor(np.asarray(named[k])) for k in names}


def check_model_derivatives(torch_model, torch_call, flax_model, apply_flax, small_leaf: str, seed: int):
    """jvp / linearize / jacfwd / Hessian / HVP of ``apply_flax(model)`` in the parameters.

    ``torch_call(params)`` runs the torch twin on torch-named parameters (for
    ``torch.func.jvp``); ``small_leaf`` names (by a substring of its path) one small
    parameter for the Jacobian and the Hessian.
    """
    rng = np.random.default_rng(seed)
    graphdef, params, rest = nnx.split(flax_model, nnx.Param, ...)

    @jax.jit
    def f(params):
        return apply_flax(nnx.merge(graphdef, params, rest))

    direction = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.1), params)
    out, d_out = jax.jvp(f, (params,), (direction,))
    assert relative_error(d_out, central_difference(f, params, direction)) <= CD_TOL
    assert relative_error(jax.linearize(f, params)[1](direction), d_out) <= EXACT_TOL

    names = list(torch_params(torch_model))
    tangents = flax_to_torch_tangents(graphdef, direction, rest, names)
    t_out, t_d_out = torch.func.jvp(torch_call, (torch_params(torch_model),), (tangents,))
    assert relative_error(out, t_out.detach().numpy()) <= EXACT_TOL
    assert relative_error(d_out, t_d_out.detach().numpy()) <= 1e-10  # float64 through a few layers

    # jacfwd in one small parameter, against jacrev and central differences column by column.
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    (index,) = [i for i, (path, _) in enumerate(flat) if small_leaf in jax.tree_util.keystr(path)]
    leaves = [leaf for _, leaf in flat]

    def of_leaf(leaf):
        return f(jax.tree_util.tree_unflatten(treedef, leaves[:index] + [leaf] + leaves[index + 1 :]))

    leaf = leaves[index]
    jac = jax.jacfwd(of_leaf)(leaf)  # out.shape + leaf.shape
    assert relative_error(jac, jax.jacrev(of_leaf)(leaf)) <= EXACT_TOL
    e0 = jnp.zeros_like(leaf).at[(0,) * leaf.ndim].set(1.0)
    assert relative_error(jac[(...,) + (0,) * leaf.ndim], central_difference(of_leaf, leaf, e0)) <= CD_TOL

    # Hessian of a scalar over that small parameter; Hessian-vector product over all of them.
    w = jnp.asarray(rng.normal(size=out.shape))

    def scalar(leaf):
        return jnp.sum(jnp.tanh(of_leaf(leaf)) * w)

    hessian = jax.hessian(scalar)(leaf)
    assert relative_error(hessian, jax.jacrev(jax.jacrev(scalar))(leaf)) <= EXACT_TOL
    v = jnp.asarray(rng.normal(size=leaf.shape))
    hv = jnp.tensordot(hessian, v, axes=leaf.ndim)
    assert relative_error(hv, central_difference(jax.grad(scalar), leaf, v)) <= CD_TOL

    def loss(params):
        return jnp.sum(jnp.tanh(f(params)) * w)

    hvp = jax.jvp(jax.grad(loss), (params,), (direction,))[1]
    expected = central_difference(jax.grad(loss), params, direction)
    assert (
        relative_error(
            jnp.concatenate([a.ravel() for a in jax.tree.leaves(hvp)]),
            jnp.concatenate([b.ravel() for b in jax.tree.leaves(expected)]),
        )
        <= CD_TOL
    )


@pytest.mark.parametrize("scan_layers, remat", [(False, False), (True, False), (True, True)])
def test_gpt_every_transformation(x64, scan_layers, remat):
    torch.manual_seed(15)
    torch_model = tg.GPT(GPT_SMALL).double().eval()
    model = flax_ln.GPT(GPT_SMALL, scan_layers=scan_layers, remat=remat, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    flax_ln.load_torch_state_dict(model, torch_model.state_dict())
    model.eval()
    idx = np.random.default_rng(16).integers(0, GPT_SMALL.vocab_size, size=(2, 5))
    check_model_derivatives(
        torch_model,
        lambda p: torch.func.functional_call(torch_model, p, (torch.tensor(idx),))[0],
        model,
        lambda m: m(jnp.asarray(idx))[0],
        small_leaf="['ln_f']['scale']",
        seed=17,
    )
    # vmap over sequences and jit of the batched jvp agree with the batched call.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    one = lambda ids: nnx.merge(graphdef, params, rest)(ids[None])[0][0]  # noqa: E731
    assert relative_error(jax.jit(jax.vmap(one))(jnp.asarray(idx)), model(jnp.asarray(idx))[0]) <= EXACT_TOL


def test_gpt_loss_every_transformation(x64):
    """The loss's head + cross-entropy is one ``custom_jvp`` (``head_cross_entropy``): forward
    mode, Hessians and vmap through it, against torch and central differences, with
    ignored targets in the batch."""
    torch.manual_seed(19)
    torch_model = tg.GPT(GPT_SMALL).double().eval()
    model = flax_ln.GPT(GPT_SMALL, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    flax_ln.load_torch_state_dict(model, torch_model.state_dict())
    model.eval()
    rng = np.random.default_rng(20)
    idx, targets = (rng.integers(0, GPT_SMALL.vocab_size, size=(2, 5)) for _ in range(2))
    targets[0, :2] = GPT_SMALL.ignore_index
    check_model_derivatives(
        torch_model,
        lambda p: torch.func.functional_call(torch_model, p, (torch.tensor(idx), torch.tensor(targets)))[1],
        model,
        lambda m: m(jnp.asarray(idx), jnp.asarray(targets))[1],
        small_leaf="['lm_head']['kernel']",
        seed=21,
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_of_one(ids, tgt):
        return nnx.merge(graphdef, params, rest)(ids[None], tgt[None])[1]

    looped = [loss_of_one(jnp.asarray(i), jnp.asarray(t)) for i, t in zip(idx, targets)]
    assert (
        relative_error(jax.jit(jax.vmap(loss_of_one))(jnp.asarray(idx), jnp.asarray(targets)), jnp.stack(looped))
        <= EXACT_TOL
    )


def test_gpt_unrolled_remat_is_reverse_mode_only(x64):
    """Documented limit: the unrolled remat's cotangent-tied recomputation is a custom_vjp."""
    model = flax_ln.GPT(GPT_SMALL, remat=True, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    idx = jnp.asarray(np.random.default_rng(18).integers(0, GPT_SMALL.vocab_size, size=(2, 5)))

    def loss(params):
        return jnp.sum(jnp.tanh(nnx.merge(graphdef, params, rest)(idx)[0]))

    reference = flax_ln.GPT(GPT_SMALL, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    reference.eval()
    ref_graphdef, ref_params, ref_rest = nnx.split(reference, nnx.Param, ...)
    ref_grads = jax.grad(lambda p: jnp.sum(jnp.tanh(nnx.merge(ref_graphdef, p, ref_rest)(idx)[0])))(ref_params)
    for a, b in zip(jax.tree.leaves(jax.grad(loss)(params)), jax.tree.leaves(ref_grads)):
        assert relative_error(a, b) <= EXACT_TOL
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(loss, (params,), (params,))


def test_encoder_decoder_every_transformation(x64):
    torch.manual_seed(19)
    args = (7, 9, 2, 8, 16, 2, 0.1)
    torch_model = te.make_model(*args).double().eval()
    model = flax_ln.make_model(*args, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    flax_ln.load_torch_state_dict(model, torch_model.state_dict())
    model.eval()
    rng = np.random.default_rng(20)
    src, tgt = rng.integers(1, 7, size=(2, 5)), rng.integers(1, 9, size=(2, 4))
    src_mask = np.ones((2, 1, 5), bool)
    tgt_mask = np.tril(np.ones((1, 4, 4), bool))
    flax_args = [jnp.asarray(a) for a in (src, tgt, src_mask, tgt_mask)]
    torch_args = [torch.tensor(a) for a in (src, tgt, src_mask, tgt_mask)]

    check_model_derivatives(
        torch_model,
        lambda p: _generator_logits(torch_model, p, torch_args),
        model,
        lambda m: m.generator(m(*flax_args)),
        small_leaf="['decoder']['norm']['a_2']",
        seed=21,
    )


def _generator_logits(torch_model, params, args):
    """``generator(model(*args))`` of the torch encoder-decoder with ``params`` swapped in."""
    hidden = torch.func.functional_call(torch_model, params, tuple(args))
    generator_params = {k.removeprefix("generator."): v for k, v in params.items() if k.startswith("generator.")}
    return torch.func.functional_call(torch_model.generator, generator_params, (hidden,))


def test_gpt_scan_over_batches_and_checkpointed_loss(x64):
    """scan over several id batches and jax.checkpoint around the whole loss, forward and reverse."""
    model = flax_ln.GPT(GPT_SMALL, param_dtype=jnp.float64, rngs=nnx.Rngs(1))
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batches = jnp.asarray(np.random.default_rng(22).integers(0, GPT_SMALL.vocab_size, size=(3, 2, 5)))

    def loss(params):
        def step(total, ids):
            return total + nnx.merge(graphdef, params, rest)(ids, ids)[1], None

        return jax.lax.scan(step, jnp.zeros((), jnp.float64), batches)[0]

    direction = jax.tree.map(jnp.ones_like, params)
    d_loss = jax.jvp(loss, (params,), (direction,))[1]
    assert relative_error(d_loss, central_difference(loss, params, direction)) <= CD_TOL
    remat = jax.checkpoint(loss)
    assert relative_error(jax.jvp(remat, (params,), (direction,))[1], d_loss) <= EXACT_TOL
    grads, grads_remat = jax.grad(loss)(params), jax.grad(remat)(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_remat)):
        assert relative_error(b, a) <= EXACT_TOL
