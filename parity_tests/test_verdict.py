"""What a verdict means: a gradient passes as zero only on float64's word, and the default call sees a changed
function that float32's tolerance cannot.

Tolerances are the engine's policy (docs/tolerances.md); no test here sets its own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_ln.book import reference_schema
from flax_ln.book.reference import FORMAT, VERSION
from flax_ln.convert import Leaf, register_rule
from flax_ln.parity import compare_modules, zero_gradient_names

WIDTH = 16


class TorchLayerScale(torch.nn.Module):
    """A ConvNeXt-style block: x + gamma * fc2(gelu(fc1(norm(x)))), gamma at its usual init, 1e-6."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.gamma = torch.nn.Parameter(torch.full((WIDTH,), 1e-6))

    def forward(self, x):
        return x + self.gamma * self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class FlaxLayerScale(nnx.Module):
    """Its port, with ``fc1``'s kernel cut off from the gradient when ``cut`` (a planted mistake)."""

    def __init__(self, *, cut: bool, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, param_dtype=param_dtype, rngs=rngs)
        self.fc1 = nnx.Linear(WIDTH, 2 * WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.fc2 = nnx.Linear(2 * WIDTH, WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.gamma = nnx.Param(jnp.full((WIDTH,), 1e-6, param_dtype))
        self.cut = cut

    def __call__(self, x):
        h = self.norm(x)
        kernel = jax.lax.stop_gradient(self.fc1.kernel[...]) if self.cut else self.fc1.kernel[...]
        h = h @ kernel + self.fc1.bias[...]
        return x + self.gamma[...] * self.fc2(jax.nn.gelu(h, approximate=False))


register_rule(FlaxLayerScale, [Leaf("gamma", "gamma")])  # its own parameter, under torch's name


class TorchAttention(torch.nn.Module):
    """Single-head attention: the key bias's exact gradient is zero (a shift of a whole row of scores)."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, WIDTH)
        self.k = torch.nn.Linear(WIDTH, WIDTH)
        self.v = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / WIDTH**0.5
        return torch.softmax(scores, -1) @ self.v(x)


class FlaxAttention(nnx.Module):
    def __init__(self, *, cut_query_bias: bool = False, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.q = nnx.Linear(WIDTH, WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.k = nnx.Linear(WIDTH, WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.v = nnx.Linear(WIDTH, WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.cut_query_bias = cut_query_bias

    def __call__(self, x):
        bias = self.q.bias[...]
        q = x @ self.q.kernel[...] + (jax.lax.stop_gradient(bias) if self.cut_query_bias else bias)
        scores = q @ jnp.swapaxes(self.k(x), -1, -2) / WIDTH**0.5
        return jax.nn.softmax(scores, -1) @ self.v(x)


def _inputs(dtype="float32"):
    return np.random.default_rng(0).standard_normal((2, 5, WIDTH)).astype(dtype)


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_small_wrong_gradient_is_not_passed_as_zero(dtype):
    # gamma = 1e-6 makes fc1's gradient about 1e-6 of the whole: under the old rule (below gtol of the
    # whole gradient's norm) its relative error of 1 passed as "zero grad" and the report passed
    torch.manual_seed(0)
    report = compare_modules(TorchLayerScale(), FlaxLayerScale(cut=True, rngs=nnx.Rngs(0)), _inputs(), dtype=dtype)
    assert not report.passed, str(report)
    assert not report["fc1.weight"].passed and report["fc1.weight"].relative_error == pytest.approx(1.0)
    assert report["fc1.weight"].passed_by is None
    # the same port without the cut passes, every gradient on its own relative error
    torch.manual_seed(0)
    report = compare_modules(TorchLayerScale(), FlaxLayerScale(cut=False, rngs=nnx.Rngs(0)), _inputs(), dtype=dtype)
    assert report.passed, str(report)
    assert all(r.passed_by in ("rtol", "atol") for r in report.results), str(report)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_gradient_zero_in_the_mathematics_passes_labelled_and_a_cut_bias_fails(dtype):
    torch.manual_seed(0)
    report = compare_modules(TorchAttention(), FlaxAttention(rngs=nnx.Rngs(0)), _inputs(), dtype=dtype)
    assert report.passed, str(report)
    assert report["k.bias"].passed_by == "zero"  # float64 says its gradient is zero: rounding noise only
    assert {r.name for r in report.results if r.passed_by == "zero"} == {"k.bias"}
    assert "zero in float64" in str(report)
    torch.manual_seed(0)
    report = compare_modules(
        TorchAttention(), FlaxAttention(cut_query_bias=True, rngs=nnx.Rngs(0)), _inputs(), dtype=dtype
    )
    assert not report.passed and not report["q.bias"].passed, str(report)
    assert report["q.bias"].relative_error == pytest.approx(1.0) and report["k.bias"].passed_by == "zero"


def test_zero_gradient_names_takes_float64_word_only():
    big, tiny = np.ones(100), np.full(3, 1e-14)
    assert zero_gradient_names({"a": big, "b": tiny}) == {"b"}
    assert zero_gradient_names({"a": big, "b": tiny}, {"a": big, "b": np.full(3, 1e-3)}) == set()  # both must say so
    with pytest.raises(ValueError, match=r"needs float64 gradients.*'b'.*float32"):
        zero_gradient_names({"a": big, "b": tiny.astype(np.float32)})


class TorchMLP(torch.nn.Module):
    """An MLP with erf GELU at transformers' default initialisation (normal, std 0.02)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = torch.nn.Linear(4 * WIDTH, WIDTH)
        for layer in (self.fc1, self.fc2):
            torch.nn.init.normal_(layer.weight, std=0.02)
            torch.nn.init.zeros_(layer.bias)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class FlaxMLP(nnx.Module):
    def __init__(self, *, approximate: bool, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.fc2 = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)
        self.approximate = approximate

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=self.approximate))


def test_the_default_call_sees_tanh_for_erf_that_float32_cannot():
    torch.manual_seed(0)
    torch_model = TorchMLP()
    tanh = FlaxMLP(approximate=True, rngs=nnx.Rngs(0))
    explicit = compare_modules(torch_model, tanh, _inputs(), dtype="float32")
    assert explicit.passed and explicit.float64_check is None, str(explicit)  # below float32's tolerance
    default = compare_modules(torch_model, tanh, _inputs())
    assert default.dtype == "float32" and all(r.passed for r in default.results)  # the torch parameters' dtype
    assert default.float64_check is not None and default.float64_check.dtype == "float64"
    assert not default.float64_check.passed and not default.passed, str(default)
    assert "float64 check (islands lifted):" in str(default)
    # the faithful port passes both, and the caller's modules stay float32
    erf = FlaxMLP(approximate=False, rngs=nnx.Rngs(0))
    default = compare_modules(torch_model, erf, _inputs())
    assert default.passed and default.float64_check.passed, str(default)
    assert next(torch_model.parameters()).dtype == torch.float32 and erf.fc1.kernel[...].dtype == jnp.float32


def test_a_reference_file_of_the_previous_version_is_refused_with_the_fix():
    with pytest.raises(reference_schema.SchemaError, match=r"version 1, expected 2.*write the file again"):
        reference_schema.validate(
            {"format": FORMAT, "version": VERSION - 1}, {}, forwards={}, build=None, file_format=FORMAT, version=VERSION
        )


class TorchScaledByTable(torch.nn.Module):
    """A Linear whose output is scaled by a table built at construction (a non-persistent buffer, as rotary
    tables are): built in float32, a .double() copy keeps its float32-rounded values."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("table", 1.0 / (1.0 + torch.arange(WIDTH, dtype=torch.float32) / 3), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.table


class FlaxScaledByTable(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.table = nnx.Variable(1.0 / (1.0 + jnp.arange(WIDTH, dtype=jnp.float32) / 3))  # float32, as built

    def __call__(self, x):
        return self.lin(x) * self.table[...]


def test_tables_built_in_float32_are_listed_on_both_sides_and_a_factory_rebuilds_torch_s():
    torch.manual_seed(0)
    torch_model, flax_model = TorchScaledByTable(), FlaxScaledByTable(rngs=nnx.Rngs(0))
    report = compare_modules(torch_model, flax_model, _inputs(), dtype="float64")
    built_in = {(i.side, i.module, i.lifted) for i in report.islands if "float32-rounded" in i.what}
    assert built_in == {("torch", "(whole model)", False), ("flax", "(whole model)", False)}, report.islands
    assert any("torch_factory=" in i.what for i in report.islands if i.side == "torch"), report.islands
    # with a factory, torch's table is rebuilt in float64 (and listed as lifted); the flax side still holds its
    # float32-rounded table, so the float64 comparison now sees the difference
    torch.manual_seed(0)
    rebuilt = compare_modules(torch_model, flax_model, _inputs(), dtype="float64", torch_factory=TorchScaledByTable)
    assert ("torch", "(whole model)", "buffer table rebuilt in float64", True) in {
        (i.side, i.module, i.what, i.lifted) for i in rebuilt.islands
    }, rebuilt.islands
    assert not rebuilt.passed and 1e-12 < rebuilt["output"].relative_error < 1e-6, str(rebuilt)
