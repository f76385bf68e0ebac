"""Float32 lifting degrades instead of breaking: on a JAX whose internals lifting needs are missing or changed
(forced here by taking one away and importing flax_ln.parity.islands.jax_internals again), ``islands="lift"`` runs the
flax side as written, lists each float32 request it met as ``lifted=False`` with the reason, and the report
says so once. With lifting available nothing changes (the first test, and every test of test_jax_islands)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax._src import dtypes as jax_dtypes
from jax._src.lax.control_flow import loops as jax_loops

import flax_ln.parity.islands.jax_internals as internals
from flax_ln.parity import compare_modules
from flax_ln.parity.islands.jax import lift_float32

pytestmark = pytest.mark.lower_bounds  # every test here runs in the lower-bounds CI step (pyproject.toml, markers)

WIDTH = 6
REASON = f"jax {'.'.join(jax.__version__.split('.')[:2])}: lifting not supported"


class TorchScaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.lin(x) * 0.1


class FlaxScaled(nnx.Module):
    """The same, with the scale computed in float32 as real ports do (``x.astype(float32) * c``)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return (self.lin(x).astype(jnp.float32) * 0.1).astype(x.dtype)


def _compare():
    torch.manual_seed(0)
    inputs = (np.random.default_rng(0).normal(size=(3, WIDTH)).astype(np.float32),)
    return compare_modules(
        TorchScaled(), FlaxScaled(rngs=nnx.Rngs(0)), inputs, dtype="float64", localize_failures=False
    )


@pytest.fixture
def without(monkeypatch):
    """``without(module, name, replacement=None)``: that JAX internal taken away (or replaced by one of another
    signature) and the internals
    looked up again; JAX's own are restored and looked up again after the test."""

    def take(module, name, replacement=None):
        if replacement is None:
            monkeypatch.delattr(module, name)
        else:
            monkeypatch.setattr(module, name, replacement)
        importlib.reload(internals)

    yield take
    monkeypatch.undo()
    importlib.reload(internals)
    assert internals.unsupported() is None, internals.why_unsupported()


def test_with_lifting_available_the_request_is_lifted(x64):
    assert internals.unsupported() is None and internals.MISSING == []
    report = _compare()
    flax_islands = [i for i in report.islands if i.side == "flax"]
    assert report.passed and flax_islands and all(i.lifted for i in flax_islands), str(report)
    assert "lifting not supported" not in str(report)


def test_a_changed_internal_runs_the_flax_side_as_written_and_lists_each_request_not_lifted(x64, without):
    original = jax_loops._promote_weak_typed_input
    without(jax_loops, "_promote_weak_typed_input", lambda *args: original(*args))  # JAX's own calls still work
    assert internals.unsupported() == REASON
    assert "_promote_weak_typed_input (signature ('args',)" in internals.why_unsupported()
    report = _compare()  # never raises
    flax_islands = [i for i in report.islands if i.side == "flax"]
    assert flax_islands[0].what.startswith(f"{REASON}: the flax side runs as written"), flax_islands
    assert "_promote_weak_typed_input" in flax_islands[0].what
    requests = [i for i in flax_islands[1:] if "astype to float32" in i.what]
    assert requests and requests[0].module == "(whole model)" and REASON in requests[0].what, flax_islands
    assert not any(i.lifted for i in flax_islands), flax_islands
    # run as written: the float32 scale's rounding is what the float64 comparison sees
    assert not report.passed and 1e-12 < report["output"].relative_error < 1e-6, str(report)
    assert str(report).count("the flax side runs as written") == 1, str(report)
    with lift_float32() as lifting:  # the context itself: nothing lifted, whatever it traces
        assert jax.make_jaxpr(lambda x: x.astype(jnp.float32))(np.ones(2)).out_avals[0].dtype == jnp.float32
    assert lifting.unsupported == REASON and not any(i.lifted for i in lifting.islands)


def test_a_missing_internal_where_nothing_can_be_listed_gives_one_island_that_says_so(x64, without):
    without(jax, "make_user_context")  # no cache token: a listing could miss what a cache already holds
    assert internals.unsupported() == REASON and internals.why_unsupported() == "missing jax.make_user_context"
    assert not internals.can_list()
    with lift_float32() as lifting:
        out = jax.make_jaxpr(lambda x: x.astype(np.float32) * 0.1)(np.ones(2))
    assert out.out_avals[0].dtype == jnp.float32  # as written
    assert len(lifting.islands) == 1 and not lifting.islands[0].lifted, lifting.islands
    assert lifting.islands[0].what.startswith(f"{REASON}: the flax side runs as written"), lifting.islands


def test_a_new_parameter_with_a_default_is_forwarded_and_lifting_stays_on(x64, without):
    # as jax 0.12 gave the canonicaliser a keyword-only allow_non_jax_dtypes: a wrapper that checked only the leading
    # names accepted it and then failed at the first call that passed it
    original = jax_dtypes.check_and_canonicalize_user_dtype
    seen = []

    def canonicalize(dtype, fun_name=None, *, new_flag=False, **rest):
        seen.append(new_flag)
        return original(dtype, fun_name, **rest)

    without(jax_dtypes, "check_and_canonicalize_user_dtype", canonicalize)
    assert internals.unsupported() is None, internals.why_unsupported()
    assert internals.FORWARDED == ["jax._src.dtypes.check_and_canonicalize_user_dtype: new_flag"]
    with lift_float32() as lifting:
        lifted = jax_dtypes.check_and_canonicalize_user_dtype(np.float32, "astype", new_flag=True)
        traced = jax.make_jaxpr(lambda x: x.astype(jnp.float32) * 0.1)(np.ones(2))
    assert lifted == np.float64 and True in seen  # lifted, and the keyword reached JAX's own function
    assert traced.out_avals[0].dtype == jnp.float64 and any(i.lifted for i in lifting.islands), lifting.islands
    assert _compare().passed


def test_a_new_parameter_without_a_default_falls_back_and_names_it(x64, without):
    original = jax_dtypes.check_and_canonicalize_user_dtype
    without(jax_dtypes, "check_and_canonicalize_user_dtype", lambda dtype, fun_name=None, *, mode: original(dtype))
    assert internals.unsupported() == REASON
    assert "a new parameter without a default: mode (keyword-only)" in internals.why_unsupported()
    assert internals.signature_problem(original, ("dtype", "fun_name"), ("allow_non_jax_dtypes",)) == (None, [])
    assert internals.signature_problem(lambda dtype: dtype, ("dtype", "fun_name"))[0] == (
        "signature ('dtype',), expected ('dtype', 'fun_name')"
    )


class FlaxScaledByShape(FlaxScaled):
    """The same port, asking JAX for a result's shape on a ``ShapeDtypeStruct`` inside its call (as ports that size a
    cache or an FFI output do): jax 0.12 canonicalises that dtype with a keyword the canonicaliser did not have."""

    def __call__(self, x):
        shape = jax.eval_shape(lambda t: t * 2, jax.ShapeDtypeStruct(x.shape, jnp.float32)).shape
        return super().__call__(x).reshape(shape)  # (B, WIDTH), as it was


def test_a_port_asking_for_a_shape_inside_its_call_gets_a_float64_verdict(x64):
    torch.manual_seed(0)
    inputs = (np.random.default_rng(0).normal(size=(3, WIDTH)).astype(np.float32),)
    report = compare_modules(
        TorchScaled(), FlaxScaledByShape(rngs=nnx.Rngs(0)), inputs, dtype="float64", localize_failures=False
    )
    assert report.passed, str(report)
    assert "could not run" not in str(report) and "lifting not supported" not in str(report)
