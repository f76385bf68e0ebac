"""KeyMap syntax past the (regex, template, layout) triple: affine changes, regions of a variable along any axis,
flax-only constants and ``to_source()``. Each loads, exports and passes ``compare_modules`` (every gradient checked,
which proves gradients are routed through regions and scaled through affine changes), and every misuse is listed
in one error naming the rule or variable."""

import enum
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_ln import ConversionError, KeyMap, load_torch_state_dict, to_torch_state_dict
from flax_ln.parity import Function, compare_modules

D = 4  # width: q, k and v are D x D, the fused kernel D x 3D


# ---- torch side: separate q/k/v projections and an RMSNorm


class TorchAttn(torch.nn.Module):
    """RMSNorm (its weight as is), then separate q, k and v projections."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(D, D)
        self.k = torch.nn.Linear(D, D)
        self.v = torch.nn.Linear(D, D)
        self.norm_weight = torch.nn.Parameter(torch.randn(D))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn_like(p))

    def forward(self, x):
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        q, k, v = self.q(x), self.k(x), self.v(x)
        return torch.tanh(q) * k + v


class FusedPort(nnx.Module):
    """One (D, 3D) kernel and a (3, D) bias for q/k/v; the norm stored as ``stored = scale * w + offset``."""

    def __init__(self, scale=1.0, offset=0.0, dtype=jnp.float32):
        self.kernel = nnx.Param(jnp.zeros((D, 3 * D), dtype))  # (in, q|k|v out)
        self.bias = nnx.Param(jnp.zeros((3, D), dtype))  # (q|k|v, out)
        self.norm = nnx.Param(jnp.zeros((D,), dtype))
        self.scale, self.offset = scale, offset

    def __call__(self, x):
        w = (self.norm[...] - self.offset) / self.scale
        x = x * jnp.reciprocal(jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)) * w
        fused = x @ self.kernel[...]  # (..., 3D)
        q, k, v = (fused[..., i * D : (i + 1) * D] + self.bias[i] for i in range(3))
        return jnp.tanh(q) * k + v


def qkv_map(affine=None, **extra):
    """Three column blocks of the fused kernel, three rows of the bias, the norm through ``affine``."""
    return KeyMap(
        [
            (r"q\.weight", f"kernel[:, 0:{D}]", "o i -> i o"),
            (r"k\.weight", f"kernel[:, {D}:{2 * D}]", "o i -> i o"),
            (r"v\.weight", f"kernel[:, {2 * D}:{3 * D}]", "o i -> i o"),
            (r"q\.bias", "bias[0]", None),
            (r"k\.bias", "bias[1, :]", None),
            (r"v\.bias", "bias[2]", None),
            (r"norm_weight", "norm", None, affine),
        ],
        **extra,
    )


def state_of(model):
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def port_for(dtype, **options):
    return FusedPort(dtype=getattr(jnp, dtype), **options)


def test_fused_qkv_loads_exports_and_passes_compare_modules_in_both_dtypes(x64):
    """Three slice rules fill one (D, 3D) kernel: equal to the columns concatenated by hand, exported back equal
    (strict), and the comparison checks q/k/v weight and bias gradients, each its region of the fused gradient."""
    torch.manual_seed(0)
    model = TorchAttn()
    state = state_of(model)
    port = load_torch_state_dict(port_for("float32"), state, weights=qkv_map())
    expected = np.concatenate([state["q.weight"].T, state["k.weight"].T, state["v.weight"].T], axis=1)
    np.testing.assert_array_equal(np.asarray(port.kernel[...]), expected)
    np.testing.assert_array_equal(np.asarray(port.bias[...]), np.stack([state[f"{n}.bias"] for n in "qkv"]))
    back = to_torch_state_dict(port, weights=qkv_map(), like=state)
    assert back.keys() == state.keys()
    written = to_torch_state_dict(port, weights=qkv_map())  # no like=: each key written from its literal regex
    assert sorted(written) == sorted(state)
    for k in state:
        np.testing.assert_array_equal(back[k], state[k])
        np.testing.assert_array_equal(written[k], state[k])
    x = np.random.default_rng(0).normal(size=(2, 3, D))
    for dtype in ("float32", "float64"):
        report = compare_modules(
            model.to(getattr(torch, dtype)), port_for(dtype), (x.astype(dtype),), weights=qkv_map()
        )
        assert report.passed, str(report)
        checked = {r.name for r in report.results}
        assert {f"{n}.{w}" for n in "qkv" for w in ("weight", "bias")} <= checked, checked


def test_scanned_layers_on_axis_one_fill_by_group_reference():
    """``layers.kernel[:, \\1]``: layer i is index i of axis 1 (that axis dropped); export gives each layer back."""
    rng = np.random.default_rng(1)
    state = {f"h.{i}.weight": rng.normal(size=(3, 2)).astype(np.float32) for i in range(4)}  # (out, in)

    class Scanned(nnx.Module):
        def __init__(self):
            self.layers = nnx.Dict(kernel=nnx.Param(jnp.zeros((2, 4, 3))))  # (in, layer, out)

    key_map = KeyMap([(r"h\.(\d+)\.weight", r"layers.kernel[:, \1]", "o i -> i o")])
    port = load_torch_state_dict(Scanned(), state, weights=key_map)
    by_hand = np.stack([state[f"h.{i}.weight"].T for i in range(4)], axis=1)  # (in, layer, out)
    np.testing.assert_array_equal(np.asarray(port.layers["kernel"][...]), by_hand)
    back = to_torch_state_dict(port, weights=key_map)  # keys written from the regex and the axis's indices
    assert sorted(back) == sorted(state)
    for k in state:
        np.testing.assert_array_equal(back[k], state[k])


@pytest.mark.parametrize("affine, options", [({"offset": 1.0}, {"offset": 1.0}), ({"scale": 2.0}, {"scale": 2.0})])
def test_affine_norm_loads_exports_and_passes(x64, affine, options):
    """A port storing ``1 + w`` (offset) or ``2 * w`` (scale): loaded as such, exported back to ``w``, and compared
    with every gradient: with scale 2 the torch-named gradient of ``w`` is twice the stored variable's, so a plan
    that forgot the factor would fail the norm's gradient."""
    torch.manual_seed(1)
    model = TorchAttn()
    state = state_of(model)
    key_map = qkv_map(affine)
    port = load_torch_state_dict(port_for("float32", **options), state, weights=key_map)
    by_hand = state["norm_weight"].astype(np.float64) * affine.get("scale", 1.0) + affine.get("offset", 0.0)
    np.testing.assert_array_equal(np.asarray(port.norm[...]), by_hand.astype(np.float32))
    back = to_torch_state_dict(port, weights=key_map, like=state)
    # float32 rounding of the stored value: w -> 1 + w -> w is exact to half an ulp of 1 + w (|w| < 4)
    np.testing.assert_allclose(back["norm_weight"], state["norm_weight"], rtol=0, atol=5e-7)
    x = np.random.default_rng(2).normal(size=(2, 3, D))
    for dtype in ("float32", "float64"):
        report = compare_modules(
            model.to(getattr(torch, dtype)), port_for(dtype, **options), (x.astype(dtype),), weights=key_map
        )
        assert report.passed, str(report)
        assert "norm_weight" in {r.name for r in report.results}


class BiasedPort(FusedPort):
    """FusedPort with a key bias torch does not have: ``extra`` (zero in the checkpoint's model) added to k."""

    def __init__(self, dtype=jnp.float32, extra=0.0):
        super().__init__(dtype=dtype)
        self.extra = nnx.Param(jnp.full((D,), 7.0, dtype))  # overwritten by the constant when loaded
        self.expected_extra = extra

    def __call__(self, x):
        w = self.norm[...]
        x = x * jnp.reciprocal(jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)) * w
        fused = x @ self.kernel[...]  # (..., 3D)
        q, k, v = (fused[..., i * D : (i + 1) * D] + self.bias[i] for i in range(3))
        return jnp.tanh(q) * (k + self.extra[...]) + v


def test_a_constant_fills_a_variable_torch_lacks_and_is_reported(x64):
    """A zero key bias the torch model does not have: declared as a constant it loads as zero (not 7), the
    comparison passes (no gradient compared for it: torch has none) and lists it in report.constants and the text;
    undeclared, loading fails naming the variable."""
    torch.manual_seed(2)
    model = TorchAttn()
    state = state_of(model)
    key_map = qkv_map(constants={r"extra": 0.0})
    port = load_torch_state_dict(BiasedPort(), state, weights=key_map)
    np.testing.assert_array_equal(np.asarray(port.extra[...]), np.zeros(D, np.float32))
    assert to_torch_state_dict(port, weights=key_map, like=state).keys() == state.keys()  # no key for a constant
    x = np.random.default_rng(3).normal(size=(2, 3, D))
    for dtype in ("float32", "float64"):
        report = compare_modules(
            model.to(getattr(torch, dtype)), BiasedPort(getattr(jnp, dtype)), (x.astype(dtype),), weights=key_map
        )
        assert report.passed, str(report)
        assert report.constants == {"extra": "0.0"}
        assert "extra" not in {r.name for r in report.results}
        assert "flax-only constants" in str(report) and "extra = 0.0" in str(report)
        assert report.to_json()["constants"] == {"extra": "0.0"}
    with pytest.raises(ConversionError, match=r"'extra': no rule fills this variable"):
        load_torch_state_dict(BiasedPort(), state, weights=qkv_map())


def test_constant_errors_and_warnings():
    """An array constant of the wrong shape names both shapes; a rule filling a constant is an error; a constant
    regex matching no variable warns, as an unused rule does."""
    state = state_of(TorchAttn())
    with pytest.raises(
        ConversionError, match=r"'extra': constant 'extra': the constant has shape \(3,\), the variable \(4,\)"
    ):
        load_torch_state_dict(BiasedPort(), state, weights=qkv_map(constants={"extra": np.zeros(3)}))
    clash = KeyMap(
        [
            *((r.pattern, r.templates[0], r.layouts[0].pattern) for r in qkv_map().rules[:6]),
            (r"norm_weight", "extra", None),
        ],
        constants={"extra": 0.0},
    )
    with pytest.raises(ConversionError, match=r"'extra' is a constant of the key map"):
        load_torch_state_dict(BiasedPort(), state, weights=clash)
    with pytest.warns(UserWarning, match=r"constants matched no flax variable .*nothing"):
        load_torch_state_dict(FusedPort(), state, weights=qkv_map(constants={r"nothing\.here": 1.0}))


def test_rule_errors_name_the_rule():
    """Every bad affine and slice item is listed in one ValueError, each line naming its rule."""
    with pytest.raises(ValueError) as info:
        KeyMap(
            [
                ("a", "x", None, {"scale": 2.0, "shift": 1.0}),
                ("b", "y", None, {"scale": 0.0}),
                ("c", "z[:, 0:x]", None),
                ("d", "w[4:2]", None),
                ("e", "v", None, {"offset": float("nan")}),
                ("f", "u", "(a b) c -> c (b a); a=x"),
                ("g", "t", "(a b) c -> c (b a); a=2, z=3"),
            ]
        )
    text = str(info.value)
    assert "7 bad rule(s)" in text
    for index, says in [
        (0, "unknown key(s) ['shift']"),
        (1, "scale must be nonzero"),
        (2, "slice item '0:x'"),
        (3, "slice item '4:2'"),
        (4, "offset must be finite"),
        (5, "'a=x' is not an axis size such as 'd=64'"),
        (6, "gives sizes of axes it does not name: ['z']"),
    ]:
        line = next(line for line in text.splitlines() if line.strip().startswith(f"rule {index} "))
        assert says in line, line


def test_region_errors_name_the_variable_and_region():
    """Out of range, a gap and an overlap, all in one ConversionError naming the variable and the region; nothing
    is loaded."""
    state = state_of(TorchAttn())
    bad = KeyMap(
        [
            (r"q\.weight", f"kernel[:, 0:{D}]", "o i -> i o"),
            (r"k\.weight", f"kernel[:, 2:{D + 2}]", "o i -> i o"),  # overlaps q's columns 2:4
            (r"v\.weight", f"kernel[:, {2 * D + 2}:{3 * D + 2}]", "o i -> i o"),  # past the end
            (r"q\.bias", "bias[0]", None),
            (r"k\.bias", "bias[5]", None),  # no row 5
            (r"v\.bias", "bias[2]", None),  # row 1 is a gap
            (r"norm_weight", "norm", None),
        ]
    )
    port = FusedPort()
    with pytest.raises(ConversionError) as info:
        load_torch_state_dict(port, state, weights=bad)
    text = str(info.value)
    assert f"kernel[:, 2:{D + 2}] from 'k.weight'" in text and f"overlaps kernel[:, 0:{D}] from 'q.weight'" in text
    assert "'v.weight': rule 2" in text and "does not fit axis 1 (shape (4, 12))" in text
    assert "'k.bias': rule 4" in text and "slice '5' is not an index of axis 0" in text
    assert re.search(r"'bias': slices \[1\] of this stacked variable", text), text
    gap = KeyMap(
        [(r"q\.weight", f"kernel[:, 0:{D}]", "o i -> i o"), (r"v\.weight", f"kernel[:, {2 * D}:{3 * D}]", "o i -> i o")]
    )
    with pytest.raises(ConversionError, match=rf"'kernel': a gap: elements \[0:{D}, {D}:{2 * D}\]"):
        load_torch_state_dict(port, {k: state[k] for k in ("q.weight", "v.weight")}, weights=gap, strict=True)
    assert not np.any(np.asarray(port.kernel[...]))  # nothing loaded


class Everything(nnx.Module):
    """Every feature's variable: a fused kernel and bias (regions), an offset norm (affine), a tied pair (tuple
    template, a triple layout, a scaled copy) and two constants."""

    def __init__(self):
        self.kernel = nnx.Param(jnp.zeros((D, 3 * D)))  # (in, q|k|v out)
        self.bias = nnx.Param(jnp.zeros((3, D)))
        self.norm = nnx.Param(jnp.zeros((D,)))
        self.emb_a = nnx.Param(jnp.zeros((D, 2)))
        self.emb_b = nnx.Param(jnp.zeros((2, D)))
        self.extra = nnx.Param(jnp.zeros((D,)))
        self.zero = nnx.Param(jnp.ones((2, 2)))


class Transposed(enum.Enum):
    LINEAR = "o i -> i o"


def everything_map():
    return KeyMap(
        [
            (r"q\.weight", f"kernel[:, 0:{D}]", Transposed.LINEAR),
            (r"k\.weight", f"kernel[:, {D}:{2 * D}]", "o i -> i o"),
            (r"v\.weight", f"kernel[:, {2 * D}:{3 * D}]", "o i -> i o"),
            (r"(?P<row>\d)\.bias", r"bias[\g<row>]", None),
            (r'norm_weight(?#a "quoted" comment)', "norm", None, {"offset": 1.0}),
            (r"t\.weight", ("emb_a", "emb_b"), (((1, 0), None, False), None), (None, {"scale": -0.5})),
            (r"buf", None, None),
        ],
        constants={"extra": np.arange(D, dtype=np.float32) / 3, r"ze.o": 0.0},
    )


def test_to_source_round_trip_loads_the_same():
    """``to_source()`` of a map with every feature, evaluated with KeyMap and np in scope, loads exactly the same
    values (and exports the same state dict); the comments given are written above their rules."""
    rng = np.random.default_rng(4)
    state = {k: rng.normal(size=(D, D)).astype(np.float32) for k in ("q.weight", "k.weight", "v.weight")}
    state |= {f"{i}.bias": rng.normal(size=(D,)).astype(np.float32) for i in range(3)}
    state |= {"norm_weight": rng.normal(size=(D,)).astype(np.float32), "buf": np.arange(3.0, dtype=np.float32)}
    state["t.weight"] = rng.normal(size=(2, D)).astype(np.float32)
    original = everything_map()
    source = original.to_source(comments={5: "tie: emb_a and emb_b are one torch tensor", 6: "ignored: a buffer"})
    lines = source.splitlines()
    assert lines[lines.index("        # tie: emb_a and emb_b are one torch tensor") + 1].lstrip().startswith('(r"t')
    assert "# ignored: a buffer" in source
    rebuilt = eval(source, {"KeyMap": KeyMap, "np": np})  # noqa: S307 - the source under test
    assert len(rebuilt.rules) == len(original.rules) and rebuilt.discovery is None
    one = load_torch_state_dict(Everything(), state, weights=original)
    two = load_torch_state_dict(Everything(), state, weights=rebuilt)
    for name in ("kernel", "bias", "norm", "emb_a", "emb_b", "extra", "zero"):
        np.testing.assert_array_equal(np.asarray(getattr(one, name)[...]), np.asarray(getattr(two, name)[...]), name)
    # a few by hand, so the test fails if both maps load alike but wrongly
    np.testing.assert_array_equal(np.asarray(two.emb_a[...]), state["t.weight"].T)
    np.testing.assert_array_equal(np.asarray(two.emb_b[...]), -0.5 * state["t.weight"])
    np.testing.assert_array_equal(np.asarray(two.zero[...]), np.zeros((2, 2)))
    np.testing.assert_array_equal(np.asarray(two.extra[...]), np.arange(D, dtype=np.float32) / 3)
    np.testing.assert_array_equal(np.asarray(two.bias[1]), state["1.bias"])
    a, b = (to_torch_state_dict(m, weights=rebuilt, like=state) for m in (one, two))
    for k in state:
        np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_allclose(a["t.weight"], state["t.weight"], rtol=0, atol=1e-6)  # float32 round trip of -0.5x
    assert eval(rebuilt.to_source(), {"KeyMap": KeyMap, "np": np}).to_source() == rebuilt.to_source()  # noqa: S307


class TorchTied(torch.nn.Module):
    """One weight used twice: ``x @ w.T`` then ``(..) @ w``."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(D, 2))  # (out, in)

    def forward(self, x):
        return torch.tanh(x @ self.w.T) @ self.w


class TiedCopies(nnx.Module):
    """The tied weight kept as two copies, one transposed, one stored as ``-0.5 * w``."""

    def __init__(self, dtype=jnp.float32):
        self.a = nnx.Param(jnp.zeros((2, D), dtype))  # (in, out) = w.T
        self.b = nnx.Param(jnp.zeros((D, 2), dtype))  # -0.5 * w

    def __call__(self, x):
        return jnp.tanh(x @ self.a[...]) @ (self.b[...] / -0.5)


class Found:
    """What a measured map carries in ``discovery``: only its text matters to the report."""

    def __str__(self):
        return "2 rules measured from the port's loader\nties: w -> a, b"


def test_a_tie_through_affine_copies_sums_scaled_gradients_and_tangents(x64):
    """One torch key into two copies, one scaled by -0.5: the gradient under torch's name is the transposed copy's
    plus -0.5 times the scaled one's (dropping the factor, or the tie's sum, fails the comparison); forward-mode
    tangents go in scaled, with no offset. The map's discovery text is shown in the report."""
    torch.manual_seed(3)
    model = TorchTied().double()
    key_map = KeyMap([(r"w", ("a", "b"), ("o i -> i o", None), (None, {"scale": -0.5}))])
    key_map.discovery = Found()
    x = np.random.default_rng(5).normal(size=(3, 2))
    for mode in ("grad", "jvp"):
        report = compare_modules(model, TiedCopies(jnp.float64), (x,), weights=key_map, mode=mode)
        assert report.passed, str(report)
        assert report.discovery is key_map.discovery
        assert "ties: w -> a, b" in str(report)
        assert report.to_json()["discovery"] == str(Found())
    assert report.ties["w"].flax_paths == ("a", "b")
    assert (
        compare_modules(
            model,
            TiedCopies(jnp.float64),
            (x,),
            weights=KeyMap([(r"w", ("a", "b"), ("o i -> i o", None), (None, {"scale": -0.5}))]),
        ).discovery
        is None
    )


def test_a_plain_function_takes_regions_affine_and_a_constant_in_both_modes(x64):
    """The same map on a parameter pytree (Function): regions fill the fused kernel, the constant its leaf, and
    gradients (grad) and tangents (jvp: scaled, the constant's zero) pass for every torch parameter."""

    def apply(p, x):
        w = p["norm"] / 2.0
        x = x * jnp.reciprocal(jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)) * w
        fused = x @ p["kernel"]  # (..., 3D)
        q, k, v = (fused[..., i * D : (i + 1) * D] + p["bias"][i] for i in range(3))
        return jnp.tanh(q) * (k + p["extra"] - 0.25) + v  # the constant's value cancels; a tangent on it would not

    params = {n: jnp.zeros(s, jnp.float64) for n, s in [("kernel", (D, 3 * D)), ("bias", (3, D)), ("norm", (D,))]}
    params["extra"] = jnp.ones((D,), jnp.float64)
    torch.manual_seed(4)
    model = TorchAttn().double()
    x = np.random.default_rng(6).normal(size=(2, 3, D))
    key_map = qkv_map({"scale": 2.0}, constants={"extra": 0.25})  # nonzero: its tangent must still be zero
    for mode in ("grad", "jvp"):
        report = compare_modules(model, Function(apply, params), (x,), weights=key_map, mode=mode)
        assert report.passed, str(report)
        assert report.constants == {"extra": "0.25"}


def test_carry_between_shared_keys_maps_values_tangents_and_gradients_each_their_way():
    """Two torch keys fill one variable, ``x = 2 a`` and ``x = b + 1``: a value of a is carried to b as ``2 a - 1``,
    a tangent as ``2 t`` (no offset), a gradient as ``g / 2`` (d/da = 2 d/dx, d/db = d/dx)."""

    class One(nnx.Module):
        def __init__(self):
            self.x = nnx.Param(jnp.zeros((3,)))

    w = np.array([0.5, -1.0, 2.0], np.float32)
    key_map = KeyMap([("a", "x", None, {"scale": 2.0}), ("b", "x", None, {"offset": 1.0})])
    state = {"a": w, "b": 2 * w - 1}
    plan = key_map.resolve(One(), state)
    assert plan.shared()["a"].torch_aliases == ("a", "b")
    np.testing.assert_allclose(plan.carry("a", "b", w), 2 * w - 1)
    np.testing.assert_allclose(plan.carry("a", "b", w, "tangent"), 2 * w)
    np.testing.assert_allclose(plan.carry("a", "b", w, "gradient"), w / 2)
    # one entry for the shared variable, under the first key, in its layout (torch's side sums its two via carry)
    assert plan.torch_gradients({"x": w}).keys() == {"a"}
    np.testing.assert_allclose(plan.torch_gradients({"x": w})["a"], 2 * w)
    port = load_torch_state_dict(One(), state, weights=key_map)  # equal after their affine changes: loads
    np.testing.assert_array_equal(np.asarray(port.x[...]), 2 * w)
    with pytest.raises(ConversionError, match=r"'x': filled by 'a' .* differ in value"):
        load_torch_state_dict(One(), {"a": w, "b": 2 * w}, weights=key_map)
