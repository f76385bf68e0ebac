"""The parity engine's foundation: records that in-place ops cannot corrupt, per-side forwards, outputs named the
same way on both sides, and what never passes (nothing compared, frozen parameters, the blame of a mismatch)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_ln.parity import Case, ParityReport, Tolerance, check_case, compare_modules, compare_tensors

WIDTH = 6


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


def test_an_in_place_residual_after_a_norm_does_not_move_the_blame():
    torch.manual_seed(0)
    torch_model = TorchInPlaceStack()
    x = np.random.default_rng(0).standard_normal((2, 4, WIDTH)).astype(np.float32)
    assert compare_modules(torch_model, FlaxStack(1e-5, rngs=nnx.Rngs(0)), x).passed  # the faithful twin
    report = compare_modules(torch_model, FlaxStack(0.5, rngs=nnx.Rngs(0)), x)  # eps planted in blocks.1.norm
    assert not report.passed
    assert report.first_divergence is not None and report.first_divergence.module == "blocks.1.norm", str(report)
    assert report.isolation.culprits == ["blocks.1.norm"], str(report)
    assert report.first_divergence.flax_module == "blocks.1.norm"  # mirrored trees: the same path
    assert report.isolation.flax_culprits == ["blocks.1.norm"]
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
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.lin(x), cache=DynamicCache())


class FlaxWithLin(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)


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


def test_isolated_mode_does_not_blame_modules_whose_own_error_is_within_tolerance_on_a_nan_input():
    torch.manual_seed(0)
    x = np.random.default_rng(5).standard_normal((2, 4, WIDTH)).astype(np.float32)
    x[0, 1, 2] = np.nan
    report = compare_modules(TorchInPlaceStack(), FlaxStack(1e-5, rngs=nnx.Rngs(0)), x)
    assert not report.passed and report["output"].nonfinite  # the verdict stays NONFINITE
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
    report = compare_modules(TorchArgmax(), FlaxArgmin(rngs=nnx.Rngs(0)), x)
    assert not report.passed and not report["output[1]"].passed and report["output[0]"].passed
    text = str(report)
    assert "backward" not in text, text
    assert "output[1]" in text.splitlines()[-2] + text.splitlines()[-1], text
