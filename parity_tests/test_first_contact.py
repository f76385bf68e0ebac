"""First contact with a published port: the default call returns a verdict whenever the port runs, parameters are
judged by their values, float32 constants are named (and rebuilt with ``flax_factory=``), sides are known before
any work, and one flax variable for two torch parameters fails.

Tolerances are the engine's policy (docs/tolerances.md); no test here sets its own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx

from flax_ln.parity import Function, KeyMap, Linen, compare_modules

WIDTH = 8


def _x(rows: int = 3) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((rows, WIDTH)).astype(np.float32)


class TorchScaledNorm(torch.nn.Module):
    """An RMSNorm (weight, eps 1e-6) then a Linear; the Linear's output is scaled by 1/sqrt(WIDTH)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(WIDTH))
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.proj(h) * WIDTH**-0.5


NORM_MAP = KeyMap(
    [(r"weight", "scale", None), (r"proj\.weight", "proj.kernel", "o i -> i o"), (r"proj\.bias", "proj.bias", None)]
)


class MetadataNorm(nnx.Module):
    """The port, its norm scale made as bonsai's T5LayerNorm makes it: ``nnx.Param(..., dtype=jnp.float32)``."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones(WIDTH), dtype=jnp.float32)
        self.proj = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]
        return self.proj(h) * WIDTH**-0.5


def test_a_param_made_with_dtype_metadata_passes_the_default_call():
    torch.manual_seed(0)
    report = compare_modules(TorchScaledNorm(), MetadataNorm(rngs=nnx.Rngs(0)), _x(), weights=NORM_MAP)
    assert report.passed and report.float64_check is not None and report.float64_check.passed, str(report)


class MixedDtypes(MetadataNorm):
    """A port holding one parameter in float64 beside float32 ones (built under x64)."""

    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        with jax.enable_x64(True):
            self.scale = nnx.Param(jnp.ones(WIDTH, jnp.float64))


def test_a_port_with_float32_and_float64_parameters_is_copied_whole_to_float64():
    torch.manual_seed(0)
    port = MixedDtypes(rngs=nnx.Rngs(0))
    report = compare_modules(TorchScaledNorm(), port, _x(), weights=NORM_MAP, dtype="float64")
    assert report.passed and report.dtype == "float64", str(report)
    assert port.proj.kernel[...].dtype == jnp.float32  # the caller's port keeps its dtypes


class NotX64Safe(MetadataNorm):
    """A port whose cache write mixes int32 and default-int indices: it runs in float32, and raises under x64."""

    def __call__(self, x):
        y = super().__call__(x)
        cache = jnp.zeros((x.shape[0] + 1, WIDTH), y.dtype)
        start = (jnp.array(1, jnp.int32), jnp.arange(2)[0])  # int32 beside int64 under x64: a TypeError
        return jax.lax.dynamic_update_slice(cache, y, start)[1:]


def test_a_port_that_raises_under_x64_keeps_its_float32_verdict():
    torch.manual_seed(0)
    report = compare_modules(TorchScaledNorm(), NotX64Safe(rngs=nnx.Rngs(0)), _x(), weights=NORM_MAP)
    assert report.results and all(r.passed for r in report.results), str(report)
    check = report.float64_check
    assert check is not None and not check.results and check.error is not None
    assert "TypeError" in check.error and "flax" in check.error
    assert not report.passed
    text = str(report)
    assert "float64 check could not run" in text and 'dtype="float32"' in text
    with pytest.raises(TypeError, match="float64"):  # an explicit float64 raises, saying where it came from
        compare_modules(TorchScaledNorm(), NotX64Safe(rngs=nnx.Rngs(0)), _x(), weights=NORM_MAP, dtype="float64")


# ---- float32 constants built before the comparison


def _function_port(params_dtype=jnp.float32):
    """A jax.numpy port closing over its scale as penzai does: ``jnp.array(WIDTH ** -0.5, jnp.float32)``."""
    scale = jnp.array(WIDTH**-0.5, jnp.float32)  # built now: already rounded to float32

    def apply(params, x):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * params["scale"]
        return (h @ params["proj"]["kernel"] + params["proj"]["bias"]) * scale

    params = {"scale": jnp.ones(WIDTH), "proj": {"kernel": jnp.zeros((WIDTH, WIDTH)), "bias": jnp.zeros(WIDTH)}}
    return Function(apply, params)


def test_a_float32_constant_a_function_closes_over_is_named_and_rebuilt_by_a_factory():
    torch.manual_seed(0)
    torch_model = TorchScaledNorm()
    report = compare_modules(torch_model, _function_port(), _x(), weights=NORM_MAP, dtype="float64")
    assert not report.passed, str(report)
    constants = [i for i in report.islands if i.side == "flax" and "float32 constant" in i.what]
    assert constants and not any(i.lifted for i in constants), report.islands
    assert "already rounded" in constants[0].what and "()" in constants[0].what  # its shape
    rebuilt = compare_modules(
        torch_model, _function_port(), _x(), weights=NORM_MAP, dtype="float64", flax_factory=_function_port
    )
    assert rebuilt.passed, str(rebuilt)
    assert not [i for i in rebuilt.islands if i.side == "flax" and not i.lifted], rebuilt.islands
    # the default call: the float32 verdict passes, the float64 check names the constant
    default = compare_modules(torch_model, _function_port(), _x(), weights=NORM_MAP)
    assert all(r.passed for r in default.results) and not default.float64_check.passed
    assert any("float32 constant" in i.what for i in default.float64_check.islands)


class DataConstant(nnx.Module):
    """An NNX port holding its output scale as ``nnx.data(jnp.array(..., jnp.float32))``."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones(WIDTH))
        self.proj = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.out_scale = nnx.data(jnp.array(WIDTH**-0.5, jnp.float32))

    def __call__(self, x):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]
        return self.proj(h) * self.out_scale


def test_an_nnx_data_float32_constant_is_listed_and_a_factory_rebuilds_it():
    torch.manual_seed(0)
    torch_model = TorchScaledNorm()
    report = compare_modules(torch_model, DataConstant(rngs=nnx.Rngs(0)), _x(), weights=NORM_MAP, dtype="float64")
    constants = [i for i in report.islands if i.side == "flax" and "float32 constant" in i.what]
    assert constants and not constants[0].lifted, report.islands
    assert constants[0].module == "(whole model)"  # where it is used: the port's own __call__
    rebuilt = compare_modules(
        torch_model,
        DataConstant(rngs=nnx.Rngs(0)),
        _x(),
        weights=NORM_MAP,
        dtype="float64",
        flax_factory=lambda: DataConstant(rngs=nnx.Rngs(0)),
    )
    assert rebuilt.passed, str(rebuilt)


class LinenNorm(linen.Module):
    @linen.compact
    def __call__(self, x):
        scale = self.param("scale", linen.initializers.ones, (WIDTH,))
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale
        return linen.Dense(WIDTH, name="proj")(h) * WIDTH**-0.5


def test_a_linen_island_list_holds_no_initialisation_shape_checks():
    torch.manual_seed(0)
    variables = LinenNorm().init(jax.random.key(0), jnp.zeros((1, WIDTH)))
    report = compare_modules(TorchScaledNorm(), Linen(LinenNorm(), variables), _x(), weights=NORM_MAP, dtype="float64")
    assert report.passed, str(report)
    flax_islands = [i for i in report.islands if i.side == "flax"]
    assert not [i for i in flax_islands if "zeros" in i.what or "ones" in i.what], flax_islands


# ---- the side is known before any work


class Recorded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.ran = False

    def forward(self, x):
        self.ran = True
        return self.lin(x)


class OtherModuleSystem:
    """An object of a module system the engine does not know, callable like a module."""

    def __call__(self, x):
        return x


def test_an_unknown_flax_side_is_refused_before_torch_runs():
    torch_model = Recorded()
    with pytest.raises(TypeError, match=r"OtherModuleSystem.*Function\(apply, params\)") as err:
        compare_modules(torch_model, OtherModuleSystem(), _x())
    assert "nnx.Module" in str(err.value) and "Linen" in str(err.value)
    assert not torch_model.ran


def test_python_numbers_in_function_params_are_hyper_parameters():
    torch.manual_seed(0)
    port = _function_port()

    def apply(params, x):
        return port.apply(params, x) * params["gain"]

    params = {**port.params, "gain": 1.0}
    report = compare_modules(TorchScaledNorm(), Function(apply, params), _x(), weights=NORM_MAP)
    assert all(r.passed for r in report.results), str(report)
    assert report.float64_check is not None and report.float64_check.error is None, str(report)


# ---- one flax variable for two torch parameters


class TorchTwoNorms(torch.nn.Module):
    """Two LayerNorms (equal at initialisation: every weight 1, every bias 0) around a Linear."""

    def __init__(self):
        super().__init__()
        self.norm_a = torch.nn.LayerNorm(WIDTH)
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.norm_b = torch.nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm_b(self.lin(self.norm_a(x)))


class OneNormTwice(nnx.Module):
    """The port that reuses one norm in both places."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs)
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.lin(self.norm(x)))


SHARED_NORM_MAP = KeyMap(
    [
        (r"norm_[ab]\.weight", "norm.scale", None),
        (r"norm_[ab]\.bias", "norm.bias", None),
        (r"lin\.weight", "lin.kernel", "o i -> i o"),
        (r"lin\.bias", "lin.bias", None),
    ]
)


@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_one_norm_used_twice_for_two_torch_norms_fails(mode):
    torch.manual_seed(0)
    report = compare_modules(
        TorchTwoNorms(), OneNormTwice(rngs=nnx.Rngs(0)), _x(), weights=SHARED_NORM_MAP, mode=mode, dtype="float32"
    )
    assert not report.passed, str(report)
    failing = report["norm_b.weight"]
    assert not failing.passed and "norm_a.weight" in failing.problem and "norm.scale" in failing.problem
    assert "one variable" in failing.problem
    assert report.shared["norm_a.weight"].torch_aliases == ("norm_a.weight", "norm_b.weight")


# ---- the report's words


def test_each_run_has_its_own_line_time_and_verdict():
    torch.manual_seed(0)
    report = compare_modules(TorchScaledNorm(), _function_port(), _x(), weights=NORM_MAP)
    assert report.float64_check.seconds > 0  # its own time, not "in 0.0s"
    lines = str(report).splitlines()
    summary = next(line for line in lines if line.startswith("summary:"))
    assert summary.endswith("-> PASS")  # the float32 run's own verdict: it passed
    assert lines[-1] == "verdict: FAIL (float32 PASS, float64 check FAIL)"


def test_a_key_map_error_names_the_sides_own_kind_of_variable():
    from flax_ln.convert import ConversionError

    port = _function_port()
    incomplete = KeyMap([(r"weight", "scale", None), (r"proj\..*", None, None)])
    with pytest.raises(ConversionError) as err:
        compare_modules(TorchScaledNorm(), port, _x(), weights=incomplete, dtype="float32")
    assert "floating leaf of the pytree" in str(err.value) and "nnx.Param" not in str(err.value)
