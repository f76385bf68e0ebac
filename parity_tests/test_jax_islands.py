"""Float32 islands on the JAX side: ``lift_float32`` runs them in float64 while tracing, and lists them.

Each construct below asks for float32 the way real ports do (a transformers-style RMSNorm, a scale
``x.astype(float32) * 48 ** -0.5``, ``nnx.Embed``'s default compute dtype, the float32 softmax of
``nnx.dot_product_attention``, RoPE tables from ``arange(..., dtype=float32)`` and an ``einsum`` with
``preferred_element_type=float32``). Each takes the float32 dtype it asks for as an argument: with
``jnp.float64`` it is its own cast-free float64 twin, the reference for derivatives.
"""

import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen, nnx
from jax.experimental import pallas as pl

from flax_ln.parity.islands.island import Island
from flax_ln.parity.islands.jax import lift_float32, unlifted_float32

pytestmark = pytest.mark.lower_bounds  # every test here runs in the lower-bounds CI step (pyproject.toml, markers)

F32 = jnp.float32
LIFTED = 4e-15  # float64 agreement (a few ulps, relative to the largest value)
ROUNDED = (1e-10, 1e-5)  # float32 agreement: what the construct gives without lifting
IDS = np.array([1, 4, 7])
SHAPE = (3, 8)  # (positions, features); attention reads it as 2 heads of 4


def _x(seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=SHAPE))


def _table() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(10, 8))


def rms_norm(x, dt):
    h = x.astype(dt)
    var = jnp.mean(h * h, axis=-1, keepdims=True)
    h = h * jax.lax.rsqrt(var + 1e-6)
    return jnp.linspace(0.5, 1.5, 8) * h.astype(x.dtype)


def rms_norm_np(x):
    return np.linspace(0.5, 1.5, 8) * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)


def scale(x, dt):
    return (x.astype(dt) * 48**-0.5).astype(x.dtype)


def scale_np(x):
    return x * 48**-0.5


def embed(x, dt):
    if dt == jnp.float64:
        return jnp.asarray(_table())[IDS] * x
    module = nnx.Embed(10, 8, rngs=nnx.Rngs(0))  # built in float32: its compute dtype stays float32
    module.embedding.set_value(jnp.asarray(_table()))  # float64 parameters, as a float64 comparison has
    return module(jnp.asarray(IDS)) * x


def embed_np(x):
    return _table()[IDS] * x


def attention(x, dt):
    q = x.reshape(1, 3, 2, 4)  # (batch, positions, heads, head features)
    if dt == jnp.float64:
        logits = jnp.einsum("btnh,bsnh->bnts", q, q) / 2.0
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), q).reshape(SHAPE)
    return nnx.dot_product_attention(q, q, q).reshape(SHAPE)  # its softmax runs in float32


def attention_np(x):
    q = x.reshape(1, 3, 2, 4)
    logits = np.einsum("btnh,bsnh->bnts", q, q) / 2.0
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), q).reshape(SHAPE)


def rope(x, dt):
    inv_freq = 1.0 / 10000 ** (jnp.arange(0, 8, 2, dtype=dt) / 8)
    positions = jnp.arange(3).astype(dt)
    freqs = jnp.einsum("i,j->ij", positions, inv_freq, preferred_element_type=dt)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    rotated = jnp.concatenate([-x[:, 4:], x[:, :4]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


def rope_np(x):
    freqs = np.outer(np.arange(3.0), 1.0 / 10000 ** (np.arange(0, 8, 2) / 8))
    angles = np.concatenate([freqs, freqs], -1)
    return x * np.cos(angles) + np.concatenate([-x[:, 4:], x[:, :4]], -1) * np.sin(angles)


CONSTRUCTS = {
    "rms_norm": (rms_norm, rms_norm_np),
    "scale": (scale, scale_np),
    "embed": (embed, embed_np),
    "attention": (attention, attention_np),
    "rope": (rope, rope_np),
}


def in_custom_vjp(f):
    @jax.custom_vjp
    def g(x):
        return f(x)

    g.defvjp(lambda x: (f(x), x), lambda x, ct: jax.vjp(f, x)[1](ct))
    return g


def in_custom_jvp(f):
    @jax.custom_jvp
    def g(x):
        return f(x)

    g.defjvp(lambda primals, tangents: jax.jvp(f, primals, tangents))
    return g


WRAPPERS = {
    "eager": lambda f: f,
    "jit": jax.jit,
    "scan": lambda f: lambda x: jax.lax.scan(lambda c, xi: (c, f(xi)), None, x[None])[1][0],
    "while": lambda f: lambda x: jax.lax.fori_loop(0, 1, lambda i, y: f(y), x),
    "cond": lambda f: lambda x: jax.lax.cond(jnp.sum(x) > -1e9, f, lambda y: y, x),
    "checkpoint": jax.checkpoint,
    "custom_jvp": in_custom_jvp,
    "custom_vjp": in_custom_vjp,
}


def _relative(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


# every construct inside jit, scan, checkpoint and a custom_vjp function; each other way in with one
EVERY_WAY_IN = [(c, w) for c in CONSTRUCTS for w in ("jit", "scan", "checkpoint", "custom_vjp")] + [
    ("rms_norm", "eager"),
    ("rope", "while"),
    ("attention", "cond"),
    ("embed", "custom_jvp"),
]


@pytest.mark.parametrize(("construct", "wrapper"), EVERY_WAY_IN)
def test_lifted_in_float64_inside_every_transformation(x64, construct, wrapper):
    f, reference = CONSTRUCTS[construct]
    fn = WRAPPERS[wrapper](lambda x: f(x, F32))
    fn = fn if wrapper == "eager" else jax.jit(fn)  # one compile (the inner tracing caches are still hit)
    x = _x()
    want = reference(np.asarray(x))
    before = fn(x)  # traced (and cached) before the context: the context must trace again
    with lift_float32() as lifting:
        lifted = fn(x)
    after = fn(x)  # and nothing traced inside leaks out
    assert lifted.dtype == jnp.float64
    assert _relative(lifted, want) < LIFTED
    assert ROUNDED[0] < _relative(before, want) < ROUNDED[1]
    assert ROUNDED[0] < _relative(after, want) < ROUNDED[1]
    assert lifting.islands and all(i.side == "flax" and i.lifted for i in lifting.islands)


@pytest.mark.parametrize("construct", CONSTRUCTS)
def test_the_float64_twins_match_numpy_and_finite_differences(x64, construct):
    f, reference = CONSTRUCTS[construct]
    x, cot = np.asarray(_x()), np.asarray(_x(1))
    assert _relative(f(jnp.asarray(x), jnp.float64), reference(x)) < LIFTED
    grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x, jnp.float64) * cot)))(jnp.asarray(x))
    h, fd = 1e-6, np.zeros_like(x)
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[i] = h
        fd[i] = np.sum((reference(x + step) - reference(x - step)) * cot) / (2 * h)
    assert _relative(grad, fd) < 1e-7


# every construct's gradient through a custom_vjp rule; scan and checkpoint (a recomputed forward) with one
GRAD_WAYS_IN = [(c, "custom_vjp") for c in CONSTRUCTS] + [("rms_norm", "scan"), ("rope", "checkpoint")]


@pytest.mark.parametrize(("construct", "wrapper"), GRAD_WAYS_IN)
def test_grad_under_the_context_is_the_float64_gradient(x64, construct, wrapper):
    f, _ = CONSTRUCTS[construct]
    x, cot = _x(), _x(1)
    fn = WRAPPERS[wrapper](lambda x: f(x, F32))
    want = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(f(x, jnp.float64) * cot)))(x))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(fn(x) * cot)))
    plain = grad(x)
    with lift_float32():
        lifted = grad(x)
    assert lifted.dtype == jnp.float64
    assert _relative(lifted, want) < LIFTED
    assert ROUNDED[0] < _relative(plain, want) < ROUNDED[1]


@pytest.mark.parametrize(("construct", "wrapper"), [(c, "custom_jvp") for c in CONSTRUCTS] + [("scale", "cond")])
def test_jvp_under_the_context_is_the_float64_derivative(x64, construct, wrapper):
    f, _ = CONSTRUCTS[construct]
    x, tangent = _x(), _x(1)
    fn = WRAPPERS[wrapper](lambda x: f(x, F32))
    want = np.asarray(jax.jit(lambda x, t: jax.jvp(lambda x: f(x, jnp.float64), (x,), (t,))[1])(x, tangent))
    jvp = jax.jit(lambda x, t: jax.jvp(fn, (x,), (t,))[1])
    plain = jvp(x, tangent)
    with lift_float32():
        lifted = jvp(x, tangent)
    assert lifted.dtype == jnp.float64
    assert _relative(lifted, want) < LIFTED
    assert ROUNDED[0] < _relative(plain, want) < ROUNDED[1]


def test_custom_derivative_rules_are_lifted(x64):
    # the rules' own casts, not the primal's: traced when jax.grad / jax.jvp run under the context
    @jax.custom_vjp
    def vjp_halve(x):
        return x / 2

    vjp_halve.defvjp(lambda x: (x / 2, None), lambda _, g: ((g.astype(F32) * 3**-0.5).astype(g.dtype),))

    @jax.custom_jvp
    def jvp_halve(x):
        return x / 2

    jvp_halve.defjvp(lambda p, t: (p[0] / 2, (t[0].astype(F32) * 3**-0.5).astype(t[0].dtype)))

    x = jnp.ones(3, jnp.float64)
    for derivative in (
        lambda: jax.grad(lambda x: jnp.sum(vjp_halve(x)))(x),
        lambda: jax.jvp(jvp_halve, (x,), (x,))[1],
        lambda: jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(vjp_halve)(x))))(x),
    ):
        assert ROUNDED[0] < _relative(derivative(), np.full(3, 3**-0.5)) < ROUNDED[1]
        with lift_float32() as lifting:
            assert _relative(derivative(), np.full(3, 3**-0.5)) < LIFTED
        assert [i.what for i in lifting.islands] == ["astype to float32"]


def test_a_bfloat16_cast_is_kept(x64):
    x = _x()
    with lift_float32() as lifting:
        y = jax.jit(lambda x: x.astype(jnp.bfloat16).astype(F32) * 3**-0.5)(x)
    bf16 = np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert y.dtype == jnp.float64
    assert _relative(y, bf16 * 3**-0.5) < LIFTED  # the bfloat16 rounding, then float64
    assert _relative(y, np.asarray(x) * 3**-0.5) > 1e-4  # and it shows
    assert [i.what for i in lifting.islands] == ["astype to float32"]


def test_constructors_with_dtype_float32_are_float64(x64):
    def build():
        return (
            jnp.zeros(2, F32) + 0.1,
            jnp.full(2, 0.1, F32),
            jnp.array([0.1, 0.2], dtype=F32),
            jnp.float32(0.1) + jnp.zeros(2),
            jnp.arange(2, dtype=F32) / 10,
            jax.lax.convert_element_type(jnp.full(2, 0.1), F32),
        )

    with lift_float32() as lifting:
        built = jax.jit(build)()
    for value in built:
        assert value.dtype == jnp.float64 and float(value[-1]) in (0.1, 0.2)
    whats = {i.what for i in lifting.islands}
    assert {"zeros with dtype float32", "full with dtype float32", "arange with dtype float32"} <= whats
    assert "convert_element_type to float32" in whats


def test_bit_views_and_random_draws_are_kept(x64):
    with lift_float32() as lifting:
        view = jnp.ones(2, jnp.uint32).view(F32)
        bits = jax.lax.bitcast_convert_type(jnp.uint32(1), F32)
        draw = jax.random.uniform(jax.random.key(0), (2,), F32)
    assert view.dtype == bits.dtype == draw.dtype == F32
    assert lifting.islands == []


class Block(nnx.Module):
    """Two float32-computing children, one called twice, and a cast of the block's own."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(10, 4, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(4, 4, dtype=F32, param_dtype=jnp.float64, rngs=rngs) for _ in range(2)])

    def __call__(self, ids):
        h = self.embed(ids).astype(F32) * 3**-0.5
        for layer in [*self.layers, self.layers[0]]:
            h = layer(h)
        return h


def test_islands_are_listed_once_per_module_and_kind(x64):
    block = Block(nnx.Rngs(0))
    block.embed.embedding.set_value(block.embed.embedding[...].astype(jnp.float64))
    ids = jnp.asarray(IDS)
    for call in (block, nnx.jit(lambda m, i: m(i))):
        with lift_float32() as lifting:
            out = call(ids) if call is block else call(block, ids)
            out = call(ids) if call is block else call(block, ids)  # a second call adds nothing
        assert out.dtype == jnp.float64
        assert lifting.islands == [
            Island("flax", "embed", "asarray with dtype float32", True),
            Island("flax", "(whole model)", "astype to float32", True),
            Island("flax", "layers.0", "asarray with dtype float32", True),
            Island("flax", "layers.1", "asarray with dtype float32", True),
        ]


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, dtype=F32, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return self.fc(x).astype(F32) * 3**-0.5


class Stack(nnx.Module):
    """Three layers stacked on a leading axis and run by ``nnx.scan``: its body gets a copy of one layer."""

    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(4, dtype=F32, param_dtype=jnp.float64, rngs=rngs)
        self.layers = nnx.split_rngs(splits=3)(nnx.vmap(Layer, in_axes=0, out_axes=0))(rngs)

    def __call__(self, x):
        scan = nnx.scan(lambda h, layer: layer(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        return scan(self.norm(x), self.layers)


def test_a_layer_that_nnx_scan_hands_in_as_a_copy_is_placed_by_its_type(x64):
    with lift_float32() as lifting:
        assert Stack(nnx.Rngs(0))(jnp.ones((1, 4))).dtype == jnp.float64
    assert lifting.islands == [
        Island("flax", "norm", "asarray with dtype float32", True),
        Island("flax", "layers.fc", "asarray with dtype float32", True),
        Island("flax", "layers", "astype to float32", True),
    ]


def test_linen_module_paths(x64):
    class Inner(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(2, dtype=F32, param_dtype=jnp.float64, name="fc")(x)

    class Outer(linen.Module):
        @linen.compact
        def __call__(self, x):
            return Inner(name="inner")(x)

    x = jnp.ones((1, 3))
    params = Outer().init(jax.random.key(0), x)
    with lift_float32() as lifting:
        assert Outer().apply(params, x).dtype == jnp.float64
    assert lifting.islands == [Island("flax", "inner.fc", "asarray with dtype float32", True)]


def test_unlifted_float32_lists_a_float32_literal(x64):
    def f(x):
        return x.astype(F32) * 48**-0.5

    x = _x()
    jaxpr = jax.make_jaxpr(jax.jit(lambda x: jax.lax.scan(lambda c, xi: (c, f(xi)), None, x)[1]))(x)
    whats = [i.what for i in unlifted_float32(jaxpr)]
    assert any(w.startswith("float32 literal 0.14433756470680237 in mul at test_jax_islands.py") for w in whats)
    assert all(not i.lifted and i.module is None for i in unlifted_float32(jaxpr))
    with lift_float32():
        assert unlifted_float32(jax.make_jaxpr(f)(x)) == []


def test_what_could_not_be_lifted_is_listed(x64):
    table = jnp.asarray(np.arange(4, dtype=np.float32) / 3)  # a float32 array built before the context

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def f(x):
        y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
        z = jax.ffi.ffi_call("some_target", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        rounded = jax.lax.mul(x.astype(F32), np.float32(48**-0.5))  # rounded before JAX sees it
        carried = jax.lax.fori_loop(0, 2, lambda i, c: c + x.astype(F32), table)  # a float32 carry
        return y + z + rounded + carried + jnp.sin(table * 2)

    x = jnp.ones(4)
    with lift_float32() as lifting:
        jaxpr = jax.make_jaxpr(jax.jit(f))(x)
    assert jaxpr.out_avals[0].dtype == jnp.float64
    whats = [i.what for i in unlifted_float32(jaxpr)]
    assert any(w.startswith("pallas_call (opaque to lifting)") for w in whats)
    assert any(w.startswith("ffi_call (opaque to lifting)") for w in whats)
    assert "float32 constant float32[4] (a closed-over array, built before lifting)" in whats
    assert any(w.startswith("float32 literal 2.0 in mul") for w in whats)
    assert any(w.startswith("sin in float32") for w in whats)
    promoted = [i.what for i in lifting.islands if not i.lifted]
    assert promoted == [
        "float32 operand of mul, promoted to float64 (its value stays float32)",
        "float32 loop carry, promoted to float64 (its value stays float32)",
        # the table, captured by jnp.sin(table * 2) as a constant (its use as the carry is the promotion above)
        "a float32 constant (4,) built before the comparison: its value is already rounded (build the port under "
        "lifting: flax_factory=)",
    ]


def enter_lifting(x):
    with lift_float32():
        return x


def test_needs_x64_no_trace_around_it_and_leaves_other_threads_alone(x64):
    with jax.enable_x64(False), pytest.raises(ValueError, match="enable_x64"):
        enter_lifting(1.0)
    for transform in (jax.jit, jax.grad):
        with pytest.raises(RuntimeError, match="outside any jit"):
            transform(enter_lifting)(1.0)
    seen = []
    with lift_float32() as lifting:
        thread = threading.Thread(target=lambda: seen.append(jnp.zeros(2, F32).dtype))
        thread.start()
        thread.join()
        assert jnp.zeros(2, F32).dtype == jnp.float64
    assert seen == [F32]
    assert [i.what for i in lifting.islands] == ["zeros with dtype float32"]
