"""The parity engine's foundation: records that in-place ops cannot corrupt, per-side forwards, outputs named the
same way on both sides, and what never passes (nothing compared, frozen parameters, the blame of a mismatch)."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx

from flax_ln.parity import (
    TOLERANCES,
    Case,
    Function,
    KeyMap,
    Linen,
    ParityReport,
    Tolerance,
    check_case,
    compare_modules,
    compare_tensors,
)

WIDTH = 6
KINDS = ["nnx", "linen", "function"]  # the three kinds of flax side; engine tests run on each


# ---- records are copies ------------------------------------------------------------------------


class TorchInPlaceBlock(torch.nn.Module):
    """Linear -> LayerNorm, then the shortcut added in place to the norm's output (as transformers' ResNet does)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x):
        h = self.norm(self.lin(x))
        h += x  # in place, after the norm has returned: its recorded output must not change
        return h


class TorchInPlaceStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([TorchInPlaceBlock(), TorchInPlaceBlock()])
        self.head = torch.nn.Linear(WIDTH, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FlaxBlock(nnx.Module):
    def __init__(self, eps, *, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, epsilon=eps, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.lin(x)) + x


class FlaxStack(nnx.Module):
    def __init__(self, eps_of_block_1, *, rngs):
        self.blocks = nnx.List([FlaxBlock(1e-5, rngs=rngs), FlaxBlock(eps_of_block_1, rngs=rngs)])
        self.head = nnx.Linear(WIDTH, 3, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LinenBlock(linen.Module):
    eps: float
    dtype: jnp.dtype | None = None

    @linen.compact
    def __call__(self, x):
        h = linen.Dense(WIDTH, dtype=self.dtype, name="lin")(x)
        return linen.LayerNorm(self.eps, dtype=self.dtype, use_fast_variance=False, name="norm")(h) + x


class LinenStack(linen.Module):
    """FlaxStack in Linen: its blocks are ``blocks_0`` and ``blocks_1`` (a list in ``setup``)."""

    eps_of_block_1: float
    dtype: jnp.dtype | None = None

    def setup(self):
        self.blocks = [LinenBlock(1e-5, self.dtype), LinenBlock(self.eps_of_block_1, self.dtype)]
        self.head = linen.Dense(3, dtype=self.dtype)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def function_stack(params, x, *, eps_of_block_1=1e-5, dtype=None):
    """FlaxStack as a function over ``{"blocks": [{"w", "b", "g", "beta"}, ...], "head": {"w", "b"}}``."""
    cast = (lambda a: a) if dtype is None else (lambda a: jnp.asarray(a, dtype))
    x = cast(x)
    for block, eps in zip(params["blocks"], (1e-5, eps_of_block_1)):
        h = x @ cast(block["w"]) + cast(block["b"])
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        x = (h - mean) * jax.lax.rsqrt(var + eps) * cast(block["g"]) + cast(block["beta"]) + x
    return x @ cast(params["head"]["w"]) + cast(params["head"]["b"])


LINEN_STACK_MAP = KeyMap(
    [
        (r"blocks\.(\d+)\.lin\.weight", r"blocks_\1.lin.kernel", "o i -> i o"),
        (r"blocks\.(\d+)\.(lin|norm)\.bias", r"blocks_\1.\2.bias", None),
        (r"blocks\.(\d+)\.norm\.weight", r"blocks_\1.norm.scale", None),
        (r"head\.weight", "head.kernel", "o i -> i o"),
        (r"head\.bias", "head.bias", None),
    ]
)
FUNCTION_STACK_MAP = KeyMap(
    [
        (r"blocks\.(\d+)\.lin\.weight", r"blocks.\1.w", "o i -> i o"),
        (r"blocks\.(\d+)\.lin\.bias", r"blocks.\1.b", None),
        (r"blocks\.(\d+)\.norm\.weight", r"blocks.\1.g", None),
        (r"blocks\.(\d+)\.norm\.bias", r"blocks.\1.beta", None),
        (r"head\.weight", "head.w", "o i -> i o"),
        (r"head\.bias", "head.b", None),
    ]
)


def stack_params(dtype=np.float32):
    """A Function's params for the stack, of the right shapes (zeros: the comparison fills them)."""
    block = {"w": np.zeros((WIDTH, WIDTH), dtype), "b": np.zeros(WIDTH, dtype)}
    block |= {"g": np.zeros(WIDTH, dtype), "beta": np.zeros(WIDTH, dtype)}
    return {"blocks": [dict(block), dict(block)], "head": {"w": np.zeros((WIDTH, 3), dtype), "b": np.zeros(3, dtype)}}


def stack(kind, eps_of_block_1=1e-5, dtype=None, param_dtype=jnp.float32):
    """The stack's flax side of ``kind`` and the options it is compared with (``weights=`` for Linen/Function)."""
    if kind == "nnx":
        model = FlaxStack(eps_of_block_1, rngs=nnx.Rngs(0))
        if dtype is not None:
            for _, module in nnx.iter_modules(model):
                if hasattr(module, "dtype"):
                    module.dtype = dtype
        return model, {}
    if kind == "linen":
        module = LinenStack(eps_of_block_1, dtype)
        variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, WIDTH), param_dtype))
        variables = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, param_dtype), variables)
        return Linen(module, variables), {"weights": LINEN_STACK_MAP}
    apply = lambda p, x: function_stack(p, x, eps_of_block_1=eps_of_block_1, dtype=dtype)  # noqa: E731
    return Function(apply, stack_params(param_dtype)), {"weights": FUNCTION_STACK_MAP}


# where the planted eps of the stack's blocks.1.norm is named on the flax side
FLAX_NORM_1 = {"nnx": "blocks.1.norm", "linen": "blocks_1.norm"}


@pytest.mark.parametrize("kind", KINDS)
def test_an_in_place_residual_after_a_norm_does_not_move_the_blame(kind):
    torch.manual_seed(0)
    torch_model = TorchInPlaceStack()
    x = np.random.default_rng(0).standard_normal((2, 4, WIDTH)).astype(np.float32)
    flax, options = stack(kind)
    assert compare_modules(torch_model, flax, x, **options).passed  # the faithful twin
    flax, options = stack(kind, 0.5)
    report = compare_modules(torch_model, flax, x, **options)  # eps planted in blocks.1.norm
    assert not report.passed
    if kind == "function":  # no modules: the report says so, and every output and gradient is still compared
        assert report.first_divergence is None and report.isolation is None
        assert "localisation needs modules" in str(report) and report.to_json()["localization_note"]
        assert not report["blocks.1.norm.weight"].passed and report["head.bias"].passed  # d/d bias: the cotangent
        return
    assert report.first_divergence is not None and report.first_divergence.module == "blocks.1.norm", str(report)
    assert report.isolation.culprits == ["blocks.1.norm"], str(report)
    assert report.first_divergence.flax_module == FLAX_NORM_1[kind]  # mirrored NNX trees: the same path
    assert report.isolation.flax_culprits == [FLAX_NORM_1[kind]]
    assert report.ties == {} and report.to_json()["ties"] == {}
    # every module before the planted mistake agrees, blocks.0.norm (whose output torch changes in place) included
    errors = {r.name: r for r in report.module_errors}
    assert errors["blocks.0.norm"].passed and errors["blocks.0"].passed


# ---- per-side forwards ---------------------------------------------------------------------------


class TorchScaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, scale):
        return self.lin(x) * scale


class FlaxScaled(nnx.Module):
    """The port takes an argument of its own (as a port takes a cache or RNGs): ``deterministic`` must be given."""

    def __init__(self, *, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x, scale, *, deterministic):
        assert deterministic is True
        return self.lin(x) * scale


def flax_deterministic(module, *inputs, **kwargs):
    return module(*inputs, deterministic=True, **kwargs)


def test_a_forward_per_side_with_common_kwargs():
    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((2, WIDTH)).astype(np.float32)
    kwargs = {"scale": np.float32(2.0)}
    report = compare_modules(
        TorchScaled(), FlaxScaled(rngs=nnx.Rngs(0)), x, kwargs=kwargs, forward=(None, flax_deterministic)
    )
    assert report.passed, str(report)
    assert [r.name for r in report.results if r.kind == "output"] == ["output"]
    with pytest.raises(TypeError, match="deterministic"):  # the torch side's plain call does not fit the port
        compare_modules(TorchScaled(), FlaxScaled(rngs=nnx.Rngs(0)), x, kwargs=kwargs)


def test_one_forward_for_both_sides_and_the_same_parameter_on_a_case():
    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((2, WIDTH)).astype(np.float32)

    def doubled(module, *inputs, **kwargs):
        return {"twice": 2 * module(*inputs, **kwargs)}

    torch_model, flax_model = torch.nn.Linear(WIDTH, WIDTH), nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
    report = compare_modules(torch_model, flax_model, x, forward=doubled)
    assert report.passed and [r.name for r in report.results if r.kind == "output"] == ["twice"], str(report)
    case = Case("scaled", TorchScaled(), FlaxScaled(rngs=nnx.Rngs(0)), [x], ["x"], kwargs={"scale": np.float32(3.0)})
    case.forward = (None, flax_deterministic)
    assert check_case(case).passed
    with pytest.raises(ValueError, match="forward"):
        compare_modules(torch_model, flax_model, x, forward=(None, None, None))


# ---- outputs, named the same way on both sides ---------------------------------------------------


class TorchWithCache(torch.nn.Module):
    """Returns a transformers ModelOutput holding a cache object, as a Hugging Face model does."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        from transformers import DynamicCache

        return _output_with_cache()(last_hidden_state=self.lin(x), cache=DynamicCache())


@functools.cache
def _output_with_cache():
    """A ModelOutput with a ``cache`` field, as transformers 5's ``BaseModelOutputWithPast`` (4.x and early 5.x name
    it ``past_key_values``): defined here, so the test reads the same on every transformers."""
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class OutputWithCache(ModelOutput):
        last_hidden_state: torch.Tensor | None = None
        cache: object = None

    return OutputWithCache


class FlaxWithLin(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)


@pytest.mark.lower_bounds  # the lower-bounds CI step runs it (pyproject.toml, markers)
def test_a_model_output_with_a_cache_object_is_compared_by_field_name_and_the_cache_dropped():
    torch.manual_seed(0)
    x = np.random.default_rng(2).standard_normal((2, 3, WIDTH)).astype(np.float32)
    flax_model = FlaxWithLin(rngs=nnx.Rngs(0))
    report = compare_modules(
        TorchWithCache(), flax_model, x, forward=(None, lambda m, x: {"last_hidden_state": m.lin(x)})
    )
    assert report.passed, str(report)
    assert [r.name for r in report.results if r.kind == "output"] == ["last_hidden_state"]
    assert report.dropped_outputs == {"cache": "torch DynamicCache"}
    assert report.to_json()["dropped_outputs"] == {"cache": "torch DynamicCache"}
    assert "cache (torch DynamicCache)" in str(report)


@dataclasses.dataclass
class FlaxOut:
    y: object
    n: object
    tag: object
    none: object


def test_numbers_are_compared_and_strings_and_none_dropped_from_dicts_and_dataclasses():
    torch.manual_seed(0)
    x = np.random.default_rng(3).standard_normal((2, WIDTH)).astype(np.float32)
    torch_model, flax_model = torch.nn.Linear(WIDTH, WIDTH), nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))

    def torch_forward(module, x):
        return {"y": module(x), "n": 3, "tag": "abc", "none": None}

    def flax_forward(module, x):
        return FlaxOut(y=module(x), n=3, tag="abc", none=None)  # a dataclass: its field names

    report = compare_modules(torch_model, flax_model, x, forward=(torch_forward, flax_forward))
    assert report.passed, str(report)
    assert [r.name for r in report.results if r.kind == "output"] == ["y", "n"]
    assert report["n"].shape == () and report["n"].relative_error == 0.0
    assert report.dropped_outputs == {"tag": "torch str, flax str", "none": "torch None, flax None"}
    # a number that differs fails
    wrong = compare_modules(
        torch_model, flax_model, x, forward=(torch_forward, lambda m, x: FlaxOut(m(x), 4, "abc", None))
    )
    assert not wrong.passed and not wrong["n"].passed


def linear_pair():
    torch.manual_seed(0)
    x = np.random.default_rng(4).standard_normal((2, WIDTH)).astype(np.float32)
    return torch.nn.Linear(WIDTH, WIDTH), nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0)), x


@pytest.mark.parametrize(
    "flax_forward, torch_says, flax_says",
    [
        (lambda m, x: (m(x), m(x).sum()), "output (2, 6)", "output[0] (2, 6), output[1] ()"),  # one extra output
        (lambda m, x: {"other": m(x)}, "output (2, 6)", "other (2, 6)"),  # a different name
        (lambda m, x: m(x)[:, :4], "output (2, 6)", "output (2, 4)"),  # a different shape
        (lambda m, x: "not an array", "output (2, 6)", "(no array outputs)"),  # nothing comparable
    ],
    ids=["extra", "names", "shape", "nothing"],
)
def test_outputs_that_differ_in_name_or_shape_are_a_clear_error_before_any_gradient(
    flax_forward, torch_says, flax_says
):
    torch_model, flax_model, x = linear_pair()
    with pytest.raises(ValueError) as err:
        compare_modules(torch_model, flax_model, x, forward=(None, flax_forward))
    message = str(err.value)
    assert f"torch: {torch_says}" in message and f"flax: {flax_says}" in message, message
    assert "forward=" in message  # how to select outputs
    assert all(p.grad is None for p in torch_model.parameters())  # the caller's module is as it was


def test_a_torch_side_with_an_extra_output_is_an_error_too():
    torch_model, flax_model, x = linear_pair()
    with pytest.raises(ValueError, match="output names or shapes differ"):
        compare_modules(torch_model, flax_model, x, forward=(lambda m, x: (m(x), m(x)), None))


# ---- nothing compared is not a pass --------------------------------------------------------------


def test_an_empty_batch_is_an_error_and_an_empty_tensor_or_report_never_passes():
    torch.manual_seed(0)
    torch_model = torch.nn.LayerNorm(8)
    flax_model = nnx.LayerNorm(8, epsilon=0.1, rngs=nnx.Rngs(0))  # a wrong twin
    empty = np.zeros((0, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"inputs\[0\] has shape \(0, 3, 8\)"):
        compare_modules(torch_model, flax_model, empty)
    with pytest.raises(ValueError, match="empty"):
        compare_modules(torch.nn.Embedding(5, 8), nnx.Embed(5, 8, rngs=nnx.Rngs(0)), np.zeros((2, 0), np.int64))
    result = compare_tensors("t", "output", np.zeros((0, 3)), np.zeros((0, 3)), Tolerance(1e-5))
    assert not result.passed and "no elements" in result.problem
    assert not ParityReport("nothing", "float32", []).passed


# ---- frozen parameters ---------------------------------------------------------------------------


class TorchPartlyFrozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, WIDTH)
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, ids):
        return self.lin(self.embed(ids))


class FlaxPartlyFrozen(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(5, WIDTH, rngs=rngs)
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, ids):
        return self.lin(self.embed(ids))


def test_frozen_parameters_are_listed_not_compared_as_gradients_and_their_values_still_loaded():
    torch.manual_seed(0)
    ids = np.array([[0, 1, 4], [2, 3, 3]])
    torch_model = TorchPartlyFrozen()
    torch_model.embed.weight.requires_grad_(False)
    report = compare_modules(torch_model, FlaxPartlyFrozen(rngs=nnx.Rngs(0)), ids)
    assert report.passed, str(report)
    assert report.frozen == ["embed.weight"] and report.to_json()["frozen"] == ["embed.weight"]
    assert [r.name for r in report.results if r.kind == "param grad"] == ["lin.weight", "lin.bias"]
    assert torch_model.embed.weight.requires_grad is False  # the caller's flags are as they were
    # the frozen values are loaded: a different embedding shows in the outputs
    with torch.no_grad():
        torch_model.embed.weight.mul_(2)
    flax_model = FlaxPartlyFrozen(rngs=nnx.Rngs(0))
    assert compare_modules(torch_model, flax_model, ids).passed
    assert np.allclose(np.asarray(flax_model.embed.embedding), torch_model.embed.weight.numpy())
    # forward mode: no tangent through a frozen parameter on either side
    assert compare_modules(torch_model, FlaxPartlyFrozen(rngs=nnx.Rngs(0)), ids, mode="jvp").passed


def test_every_parameter_frozen_with_integer_inputs_compares_the_outputs_and_says_there_are_no_gradients():
    torch.manual_seed(0)
    ids = np.array([[0, 1, 4], [2, 3, 3]])
    torch_model = TorchPartlyFrozen().requires_grad_(False)
    report = compare_modules(torch_model, FlaxPartlyFrozen(rngs=nnx.Rngs(0)), ids)
    assert report.passed, str(report)
    assert [r.kind for r in report.results] == ["output"]
    assert report.frozen == ["embed.weight", "lin.weight", "lin.bias"]
    assert "no gradients" in str(report)
    wrong = compare_modules(torch_model, FlaxOffByOnePercent(rngs=nnx.Rngs(0)), ids)  # the outputs still decide
    assert not wrong.passed and not wrong["output"].passed


class FlaxOffByOnePercent(FlaxPartlyFrozen):
    def __call__(self, ids):
        return 1.01 * super().__call__(ids)


# ---- what isolated mode and the verdict blame ----------------------------------------------------


@pytest.mark.parametrize("kind", ["nnx", "linen"])  # isolated mode needs modules
def test_isolated_mode_does_not_blame_modules_whose_own_error_is_within_tolerance_on_a_nan_input(kind):
    torch.manual_seed(0)
    x = np.random.default_rng(5).standard_normal((2, 4, WIDTH)).astype(np.float32)
    x[0, 1, 2] = np.nan
    flax, options = stack(kind)
    report = compare_modules(TorchInPlaceStack(), flax, x, **options)
    assert not report.passed and report["output"].nonfinite  # the verdict stays NONFINITE
    assert report.isolation.results, str(report)  # modules were run alone
    tolerance = report.isolation.results[0].tolerance
    for r in report.isolation.results:
        if r.name in report.isolation.culprits:
            assert r.relative_error > tolerance.rtol, str(report)
    assert report.isolation.culprits == [], str(report)


class TorchArgmax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        logits = self.lin(x)
        return logits, logits.argmax(-1)


class FlaxArgmin(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        logits = self.lin(x)
        return logits, jnp.argmin(logits, -1)  # the planted mistake: argmin for argmax


def test_an_integer_output_that_differs_is_not_blamed_on_the_backward_pass():
    torch.manual_seed(0)
    x = np.random.default_rng(6).standard_normal((3, WIDTH)).astype(np.float32)
    report = compare_modules(TorchArgmax(), FlaxArgmin(rngs=nnx.Rngs(0)), x, dtype="float32")  # the float32 run alone
    assert not report.passed and not report["output[1]"].passed and report["output[0]"].passed
    text = str(report)
    assert "backward" not in text, text
    assert "output[1]" in text.splitlines()[-2] + text.splitlines()[-1], text


# ---- the three kinds of flax side: every option of the engine works for each -----------------------


def stack_input(seed=7):
    return np.random.default_rng(seed).standard_normal((2, 4, WIDTH)).astype(np.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_mode_attribution_and_lm_metrics_for_every_kind(kind):
    """float32 policy: the same math on both sides, XLA's and torch's reduction orders apart (~1e-7)."""
    torch.manual_seed(0)
    flax, options = stack(kind)
    report = compare_modules(TorchInPlaceStack(), flax, stack_input(), mode="jvp", **options)
    assert report.passed, str(report)
    assert {r.kind for r in report.results} == {"output", "tangent"}
    flax, options = stack(kind)
    report = compare_modules(TorchInPlaceStack(), flax, stack_input(), attribute=True, lm_logits="output", **options)
    assert report.passed, str(report)
    # both sides against torch's float64 run: float32 rounding only; flax's float64 twin: float64 rounding only
    assert report["output"].flax_vs_float64 < 1e-5 and report["output"].torch_vs_float64 < 1e-5
    assert report.attribution["flax_float64_rel"] < 1e-12
    assert report.lm_metrics["top1_agreement"] == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_compute_with_float32_parameters_for_every_kind(kind):
    """The engine's bfloat16 policy (outputs 2e-2, gradients 4e-2, all gradients as one vector 3e-2), against the
    float32 torch module: every parameter gradient comes back float32, under torch's names."""
    torch.manual_seed(0)
    flax, options = stack(kind, dtype=jnp.bfloat16)
    report = compare_modules(TorchInPlaceStack(), flax, stack_input(), dtype="bfloat16", **options)
    assert report.passed, str(report)
    assert report["output"].relative_error > 1e-5  # it did compute in bfloat16
    grads = [r for r in report.results if r.kind == "param grad"]
    assert len(grads) == 10 and "all parameter gradients" in [r.name for r in report.results]


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_a_mesh_for_the_module_kinds(kind):
    from flax_ln.sharding import make_mesh

    torch.manual_seed(0)
    flax, options = stack(kind)
    report = compare_modules(TorchInPlaceStack(), flax, stack_input(), mesh=make_mesh(1, jax.devices()[:1]), **options)
    assert report.passed, str(report)
    assert {"blocks.0.lin.kernel", "blocks_0.lin.kernel"} & set(report.sharding["params"]), report.sharding


def test_what_linen_and_function_sides_need_is_a_clear_error():
    torch.manual_seed(0)
    for kind in ("linen", "function"):
        flax, _ = stack(kind)
        with pytest.raises(TypeError, match=r"weights=KeyMap"):
            compare_modules(TorchInPlaceStack(), flax, stack_input())
    flax, options = stack("function")
    from flax_ln.sharding import make_mesh

    with pytest.raises(ValueError, match="mesh= is not supported for a flax_ln.parity.Function"):
        compare_modules(TorchInPlaceStack(), flax, stack_input(), mesh=make_mesh(1, jax.devices()[:1]), **options)
    with pytest.raises(TypeError, match=r"Linen\(module, variables"):
        compare_modules(TorchInPlaceStack(), LinenStack(1e-5), stack_input(), weights=LINEN_STACK_MAP)


@pytest.mark.parametrize("kind", ["linen", "function"])
def test_the_callers_variables_are_not_modified(kind):
    torch.manual_seed(0)
    if kind == "linen":
        variables = LinenStack(1e-5).init(jax.random.key(0), jnp.zeros((1, WIDTH)))
        flax, weights = Linen(LinenStack(1e-5), variables), LINEN_STACK_MAP
        tree = variables
    else:
        tree = stack_params()
        flax, weights = Function(lambda p, x: function_stack(p, x), tree), FUNCTION_STACK_MAP
    before = [np.array(leaf, copy=True) for leaf in jax.tree.leaves(tree)]
    structure = jax.tree.structure(tree)
    assert compare_modules(TorchInPlaceStack(), flax, stack_input(), weights=weights).passed
    assert jax.tree.structure(tree) == structure
    assert all(np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(tree)))
    assert not np.array_equal(before[0], torch.nn.Linear(WIDTH, WIDTH).weight.detach().numpy())  # not torch's


NNX_STACK_MAP = KeyMap(  # FlaxStack through a key map instead of the converter's rules
    [
        (r"blocks\.(\d+)\.lin\.weight", r"blocks.\1.lin.kernel", "o i -> i o"),
        (r"blocks\.(\d+)\.(lin|norm)\.bias", r"blocks.\1.\2.bias", None),
        (r"blocks\.(\d+)\.norm\.weight", r"blocks.\1.norm.scale", None),
        (r"head\.weight", "head.kernel", "o i -> i o"),
        (r"head\.bias", "head.bias", None),
    ]
)


@pytest.mark.parametrize("mode", ["grad", "jvp"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_comparison_through_a_key_map_plans_once(kind, mode, monkeypatch):
    """The plan that fills the weights is the plan that names the gradients, takes the tangents, pairs the modules
    and runs the float64 twin: one build per comparison, in either mode."""
    from flax_ln.convert import keymap, keymap_transfer

    builds = []
    match_targets = keymap.match_targets  # where every plan is built; two modules call it by that name
    counted = lambda *args, **kwargs: builds.append(args[0]) or match_targets(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(keymap, "match_targets", counted)
    monkeypatch.setattr(keymap_transfer, "match_targets", counted)
    torch.manual_seed(0)
    flax, options = stack(kind)
    options = {"weights": NNX_STACK_MAP} if kind == "nnx" else options
    report = compare_modules(
        TorchInPlaceStack(), flax, stack_input(), mode=mode, attribute=True, capture_modules=True, **options
    )
    assert report.passed, str(report)
    assert len(builds) == 1, builds


class LinenScaled(linen.Module):
    @linen.compact
    def __call__(self, x, scale, *, deterministic):
        assert deterministic is True
        return linen.Dense(WIDTH, name="lin")(x) * scale


@pytest.mark.parametrize("kind", KINDS)
def test_eval_flags_and_common_kwargs_go_through_the_flax_forward_for_every_kind(kind):
    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((2, WIDTH)).astype(np.float32)
    kwargs = {"scale": np.float32(2.0)}
    lin_map = {"linen": ("lin.kernel", "lin.bias"), "function": ("w", "b")}
    if kind == "nnx":
        flax, options = FlaxScaled(rngs=nnx.Rngs(0)), {}
    elif kind == "linen":
        flax = Linen(LinenScaled(), LinenScaled().init(jax.random.key(0), x, 1.0, deterministic=True))
    else:

        def scaled(params, x, scale, *, deterministic):
            assert deterministic is True
            return (x @ params["w"] + params["b"]) * scale

        flax = Function(scaled, {"w": np.zeros((WIDTH, WIDTH), np.float32), "b": np.zeros(WIDTH, np.float32)})
    if kind != "nnx":
        kernel, bias = lin_map[kind]
        options = {"weights": KeyMap([(r"lin\.weight", kernel, "o i -> i o"), (r"lin\.bias", bias, None)])}
    report = compare_modules(TorchScaled(), flax, x, kwargs=kwargs, forward=(None, flax_deterministic), **options)
    assert report.passed, str(report)
    assert [r.name for r in report.results] == ["output", "grad input 0", "lin.weight", "lin.bias"]


class TorchNormed(torch.nn.Module):
    """Linear -> BatchNorm1d (eval: its running statistics) -> Linear."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.bn = torch.nn.BatchNorm1d(WIDTH)
        self.head = torch.nn.Linear(WIDTH, 3)
        with torch.no_grad():
            self.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, WIDTH))
            self.bn.running_var.copy_(torch.linspace(0.5, 2.0, WIDTH))
            self.bn.weight.copy_(torch.linspace(0.8, 1.2, WIDTH))

    def forward(self, x):
        return self.head(self.bn(self.lin(x)))


class LinenNormed(linen.Module):
    eps: float = 1e-5

    @linen.compact
    def __call__(self, x):
        h = linen.BatchNorm(use_running_average=True, epsilon=self.eps, name="bn")(linen.Dense(WIDTH, name="lin")(x))
        return linen.Dense(3, name="head")(h)


NORMED_MAP = KeyMap(
    [
        (r"(lin|head)\.weight", r"\1.kernel", "o i -> i o"),
        (r"(lin|head|bn)\.bias", r"\1.bias", None),
        (r"bn\.weight", "bn.scale", None),
        (r"bn\.running_mean", "batch_stats.bn.mean", None),
        (r"bn\.running_var", "batch_stats.bn.var", None),
        (r"bn\.num_batches_tracked", None, None),
    ]
)


def test_linen_batch_stats_are_filled_from_torch_buffers_and_not_differentiated():
    """float32 policy. The running statistics move the output (a planted eps shows), have no gradient, and
    the planted eps is named on both sides."""
    torch.manual_seed(0)
    x = np.random.default_rng(2).standard_normal((5, WIDTH)).astype(np.float32)
    variables = LinenNormed().init(jax.random.key(0), x)
    assert set(variables) == {"params", "batch_stats"}
    report = compare_modules(TorchNormed(), Linen(LinenNormed(), variables), x, weights=NORMED_MAP)
    assert report.passed, str(report)
    grads = {r.name for r in report.results if r.kind == "param grad"}
    assert grads == {"lin.weight", "lin.bias", "bn.weight", "bn.bias", "head.weight", "head.bias"}
    report = compare_modules(TorchNormed(), Linen(LinenNormed(0.3), variables), x, weights=NORMED_MAP)
    assert (report.first_divergence.module, report.first_divergence.flax_module) == ("bn", "bn"), str(report)
    assert (report.isolation.culprits, report.isolation.flax_culprits) == (["bn"], ["bn"])


class TorchTied(torch.nn.Module):
    """Embedding and output projection that are one Parameter (two state-dict keys)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.embed(ids))))


class LinenTied(linen.Module):
    """Ties inside ``__call__``: one variable serves as the embedding and the head (``embed.attend``)."""

    @linen.compact
    def __call__(self, ids):
        embed = linen.Embed(11, WIDTH, name="embed")
        return embed.attend(jnp.tanh(linen.Dense(WIDTH, name="mix")(embed(ids))))


def test_a_linen_port_that_ties_in_its_call_counts_the_tie_once():
    """Both torch aliases fill the one Linen variable; its gradient holds both uses and is compared once, under the
    canonical name. float32 policy."""
    torch.manual_seed(0)
    ids = np.random.default_rng(0).integers(0, 11, (2, 5))
    key_map = KeyMap(
        [
            (r"(embed|out)\.weight", "embed.embedding", None),
            (r"mix\.weight", "mix.kernel", "o i -> i o"),
            (r"mix\.bias", "mix.bias", None),
        ]
    )
    variables = LinenTied().init(jax.random.key(0), ids)
    report = compare_modules(TorchTied(), Linen(LinenTied(), variables), ids, weights=key_map)
    assert report.passed, str(report)
    assert {r.name for r in report.results if r.kind == "param grad"} == {"embed.weight", "mix.weight", "mix.bias"}
    assert report.ties["embed.weight"].torch_aliases == ("embed.weight", "out.weight")
    assert report.ties["embed.weight"].flax_paths == ("embed.embedding",)


class TorchTwoEqual(torch.nn.Module):
    """Two Linears whose weights are set equal (two Parameters, not one): the port holds one variable for both."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(WIDTH, WIDTH)
        self.second = torch.nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.second.weight.copy_(self.first.weight)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


class FlaxOneWeight(nnx.Module):
    """:class:`TorchTwoEqual` with one kernel used twice."""

    def __init__(self):
        self.kernel = nnx.Param(jnp.zeros((WIDTH, WIDTH)))
        self.first_bias = nnx.Param(jnp.zeros(WIDTH))
        self.second_bias = nnx.Param(jnp.zeros(WIDTH))

    def __call__(self, x):
        return jnp.tanh(x @ self.kernel + self.first_bias) @ self.kernel + self.second_bias


TWO_EQUAL_MAP = KeyMap(
    [
        (r"(first|second)\.weight", "kernel", "o i -> i o"),
        (r"first\.bias", "first_bias", None),
        (r"second\.bias", "second_bias", None),
    ]
)


@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_distinct_equal_torch_tensors_filling_one_variable_fail(mode):
    """Two torch Parameters of equal value fill one flax variable: the port computes another model once training
    moves them apart, so the comparison fails under the second key, naming both keys and the variable; the rest is
    compared as before (in jvp both take one tangent, in grad the variable's gradient against the sum of theirs,
    under the first key), the group in ``report.shared``. float32 and its float64 check."""
    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((3, WIDTH)).astype(np.float32)
    report = compare_modules(TorchTwoEqual(), FlaxOneWeight(), x, weights=TWO_EQUAL_MAP, mode=mode, attribute=True)
    assert not report.passed, str(report)
    assert report.shared["first.weight"].torch_aliases == ("first.weight", "second.weight")
    assert report.shared["first.weight"].flax_paths == ("kernel",)
    failing = [r for r in report.results if not r.passed]
    assert [r.name for r in failing] == ["second.weight"], str(report)
    assert "first.weight" in failing[0].problem and "kernel" in failing[0].problem
    names = {r.name for r in report.results}
    if mode == "grad":
        assert {"first.weight", "first.bias", "second.bias"} <= names
    else:
        assert "tangent output" in names
    compared = [r for r in report.results if r.problem is None and (r.kind != "output" or mode == "grad")]
    assert all(r.passed and r.flax_vs_float64 is not None for r in compared)


# ---- what a comparison must never pass silently -------------------------------------------------


class TorchLin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.lin(x)


class FlaxLinearCut(nnx.Module):
    """A wrong port: the kernel's gradient is cut, its outputs are right."""

    def __init__(self, *, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x @ jax.lax.stop_gradient(self.lin.kernel[...]) + self.lin.bias[...]


def _no_grad(module, x):
    with torch.no_grad():
        return module(x)


def _inference_mode(module, x):
    with torch.inference_mode():
        return module(x)


@pytest.mark.parametrize("torch_forward", [_no_grad, _inference_mode, lambda m, x: m(x).detach()])
def test_a_torch_forward_without_an_autograd_graph_is_an_error_naming_it_not_a_pass(torch_forward):
    torch.manual_seed(0)
    x = np.random.default_rng(5).standard_normal((2, WIDTH)).astype(np.float32)
    with pytest.raises(ValueError, match=r"forward= \(.*\) returned outputs with no autograd graph") as err:
        compare_modules(TorchLin(), FlaxLinearCut(rngs=nnx.Rngs(0)), x, forward=(torch_forward, None))
    assert "torch.no_grad()" in str(err.value) and "weight" in str(err.value)


def test_complex_outputs_compare_both_parts_without_a_complex_warning():
    torch_model, flax_model, x = linear_pair()

    def torch_forward(m, x):
        y = m(x)
        return {"z": torch.complex(y, y), "y": y}

    def flax_forward(sign):
        return lambda m, x: {"z": jax.lax.complex(m(x), sign * m(x)), "y": m(x)}

    with warnings.catch_warnings():
        warnings.simplefilter("error", np.exceptions.ComplexWarning)
        right = compare_modules(torch_model, flax_model, x, forward=(torch_forward, flax_forward(1.0)))
        wrong = compare_modules(torch_model, flax_model, x, forward=(torch_forward, flax_forward(-1.0)))
    assert right.passed and right["z"].relative_error < 1e-6, str(right)
    assert (
        not wrong.passed and not wrong["z"].passed and wrong["z"].relative_error == pytest.approx(np.sqrt(2))
    )  # |2iy| / |y + iy|
    assert right["z"].tolerance == TOLERANCES["float32"]["output"]  # complex64: float32's bound


def test_python_numbers_compare_in_the_comparisons_dtype_with_x64_off():
    torch_model, flax_model, x = linear_pair()
    assert not jax.config.jax_enable_x64
    report = compare_modules(torch_model, flax_model, x, forward=lambda m, x: {"y": m(x), "scale": 0.5})
    assert report.passed, str(report)
    assert report["scale"].relative_error == 0.0 and report.float64_check.passed


def test_a_bfloat16_input_is_cast_to_the_comparisons_dtype_like_any_floating_input():
    """NumPy does not rank ml_dtypes' bfloat16 as floating; the engine does: the input is widened exactly (and
    differentiated), and the report says so."""
    torch_model, flax_model, x = linear_pair()
    x = np.asarray(x).astype(jnp.bfloat16)
    report = compare_modules(torch_model, flax_model, x, dtype="float32")
    assert report.passed, str(report)
    assert report.input_casts == {"input 0": "bfloat16 -> float32"}
    assert "grad input 0" in [r.name for r in report.results]


def test_dict_outputs_are_matched_by_key_and_missing_keys_are_named():
    torch_model, flax_model, x = linear_pair()
    torch_forward = lambda m, x: {"a": m(x), "b": 2 * m(x)}  # noqa: E731
    report = compare_modules(
        torch_model, flax_model, x, forward=(torch_forward, lambda m, x: {"b": 2 * m(x), "a": m(x)})
    )
    assert report.passed and [r.name for r in report.results if r.kind == "output"] == ["a", "b"], str(report)
    with pytest.raises(ValueError) as err:
        compare_modules(torch_model, flax_model, x, forward=(torch_forward, lambda m, x: {"b": 2 * m(x), "c": m(x)}))
    assert "missing on the flax side: a" in str(err.value) and "only on the flax side: c" in str(err.value)


def test_a_partial_tolerances_dict_is_filled_from_the_policy_and_an_unknown_key_named():
    torch_model, flax_model, x = linear_pair()
    loose = Tolerance(1e-3)
    report = compare_modules(torch_model, flax_model, x, dtype="float32", tolerances={"output": loose})
    assert report.passed and report["output"].tolerance == loose, str(report)
    assert report["weight"].tolerance == TOLERANCES["float32"]["grad"]
    with pytest.raises(ValueError, match=r"unknown keys \['outputs'\].*'output', 'grad', 'grads'"):
        compare_modules(torch_model, flax_model, x, tolerances={"outputs": loose})


class FlaxWithIntegerParam(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.count = nnx.Param(jnp.array([1, 2]))  # an integer declared as a parameter

    def __call__(self, x):
        return self.lin(x)


def test_a_parameter_that_cannot_be_differentiated_is_named_before_any_compute():
    x = np.random.default_rng(6).standard_normal((2, WIDTH)).astype(np.float32)
    with pytest.raises(TypeError, match=r"nnx.Param 'count' holds an array of int32.*nnx.Variable"):
        compare_modules(TorchLin(), FlaxWithIntegerParam(rngs=nnx.Rngs(0)), x)
    weights = KeyMap([(r"lin\.weight", "w", "o i -> i o"), (r"lin\.bias", "b", None)])
    params = {"w": np.zeros((WIDTH, WIDTH), np.float32), "b": np.zeros(WIDTH, np.float32), "act": "tanh"}
    with pytest.raises(TypeError, match=r"params leaf 'act' holds str 'tanh'.*functools.partial"):
        compare_modules(TorchLin(), Function(lambda p, x: jnp.tanh(x @ p["w"] + p["b"]), params), x, weights=weights)
    module = linen.Dense(WIDTH, name="lin")
    variables = {"params": {"kernel": np.zeros((WIDTH, WIDTH), np.float32), "bias": np.zeros(WIDTH, np.float32)}}
    variables["params"]["count"] = np.array([1, 2])
    with pytest.raises(TypeError, match=r"variable 'params.count' holds an array of int64.*'params' collection"):
        compare_modules(TorchLin(), Linen(module, variables), x, weights=weights)


def test_a_torch_path_in_modules_that_names_no_submodule_is_an_error_listing_the_nearest():
    torch_model, x = TorchInPlaceStack(), stack_input()
    flax_model, options = stack("linen")
    with pytest.raises(ValueError, match=r"no submodule 'blocks.0.linn'.*\['blocks.0.lin'"):
        compare_modules(torch_model, flax_model, x, modules={"blocks.0.linn": None}, **options)
