"""Float32 islands on the torch side: lifted at run time (``lift_float32``), rebuilt at construction
(``build_lifted``, ``default_factory``) or listed (``rounded_buffers``).

Tiny modules written the way transformers writes its float32 islands, checked against NumPy in
float64: with lifting they agree to float64 rounding, without it they are about 1e-8 off.
"""

import ast
import inspect
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flax_ln.parity.islands import island as islands_module
from flax_ln.parity.islands import torch as torch_islands
from flax_ln.parity.islands.island import Island
from flax_ln.parity.islands.torch import build_lifted, default_factory, lift_float32, rounded_buffers
from flax_ln.parity.records.capture import WHOLE_MODEL

pytestmark = pytest.mark.lower_bounds  # every test here runs in the lower-bounds CI step (pyproject.toml, markers)

D = 8  # feature width of the toy modules
POSITIONS = torch.tensor([0, 3, 17, 29, 41, 63])  # large enough for float32 rotary tables to be ~1e-7 off


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalises in float32 whatever the input dtype (``casts=False``: in the input's)."""

    def __init__(self, d: int, casts: bool = True):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.arange(d, dtype=torch.float64))
        self.casts = casts

    def forward(self, hidden):
        dtype = hidden.dtype
        if self.casts:
            hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + 1e-6)
        return self.weight * hidden.to(dtype)


class Rotary(nn.Module):
    """transformers' rotary table, computed at run time: ``.float()`` operands under a disabled autocast."""

    def __init__(self, d: int, casts: bool = True):
        super().__init__()
        self.d = d
        self.casts = casts

    def forward(self, positions):
        exponents = torch.arange(0, self.d, 2, dtype=torch.int64)
        exponents = exponents.float() if self.casts else exponents.double()
        inv_freq = 1.0 / (10000.0 ** (exponents / self.d))
        with torch.autocast(device_type="cpu", enabled=False):
            if self.casts:
                freqs = inv_freq[:, None].float() @ positions[None, :].float()  # (d/2, T)
            else:
                freqs = inv_freq[:, None] @ positions[None, :].double()  # (d/2, T)
        return torch.cat([freqs.T.cos(), freqs.T.sin()], dim=-1)  # (T, d)


class Block(nn.Module):
    """RMSNorm, a rotary scaling and a float32 softmax, on ``(T, D)`` inputs."""

    def __init__(self, casts: bool = True):
        super().__init__()
        self.norm = RMSNorm(D, casts)
        self.rotary = Rotary(D, casts)
        self.casts = casts

    def forward(self, x, positions):
        hidden = self.norm(x) * self.rotary(positions).to(x.dtype)
        scores = hidden @ hidden.T / math.sqrt(D)
        probs = torch.softmax(scores, -1, dtype=torch.float32 if self.casts else None).to(x.dtype)
        return probs @ hidden


def numpy_block(x: np.ndarray, weight: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """:class:`Block` in NumPy float64."""
    hidden = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * weight
    freqs = positions[:, None] * (1.0 / 10000.0 ** (np.arange(0, D, 2) / D))[None, :]  # (T, D/2)
    hidden = hidden * np.concatenate([np.cos(freqs), np.sin(freqs)], -1)
    scores = hidden @ hidden.T / math.sqrt(D)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True) @ hidden


def relative(a, b) -> float:
    """Max-abs error of ``a`` against ``b``, relative to ``b``'s largest magnitude."""
    a, b = np.asarray(a.detach() if hasattr(a, "detach") else a), np.asarray(b.detach() if hasattr(b, "detach") else b)
    return float(np.abs(a - b).max() / np.abs(b).max())


class FloatingOutputs(TorchDispatchMode):
    """The dtype of every floating tensor every aten op returns (entered before ``lift_float32``: after lifting)."""

    def __init__(self):
        super().__init__()
        self.dtypes: dict[torch.dtype, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.dtypes.setdefault(t.dtype, set()).add(str(func))
        return out


def inputs(seed: int = 0) -> torch.Tensor:
    return torch.randn(len(POSITIONS), D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_lifted_forward_is_float64_exact_and_names_each_island():
    block = Block()
    x = inputs()
    expected = numpy_block(x.numpy(), block.norm.weight.detach().numpy(), POSITIONS.numpy().astype(np.float64))
    as_written = block(x, POSITIONS)
    with lift_float32(block) as lifting:
        lifted = block(x, POSITIONS)
    assert lifted.dtype == torch.float64
    assert relative(lifted, expected) < 1e-14
    assert relative(as_written, expected) > 1e-9  # float32 islands: about 1e-8 off
    assert lifting.islands == [
        Island("torch", "norm", "aten._to_copy to float32", lifted=True),
        Island("torch", "rotary", "aten._to_copy to float32", lifted=True),
        Island("torch", WHOLE_MODEL, "softmax with dtype=float32", lifted=True),
    ]


def test_backward_and_jvp_run_in_float64_under_lifting():
    block, reference = Block(casts=True), Block(casts=False)
    x = inputs(1).requires_grad_()
    tangent = inputs(2)

    def loss(module, x):
        return module(x, POSITIONS).pow(3).sum()

    want_grad, want_weight_grad = torch.autograd.grad(loss(reference, x), [x, reference.norm.weight])
    want_tangent = torch.func.jvp(lambda x: reference(x, POSITIONS), (x.detach(),), (tangent,))[1]
    as_written = torch.autograd.grad(loss(block, x), [x])[0]

    with FloatingOutputs() as seen, lift_float32(block):
        grad, weight_grad = torch.autograd.grad(loss(block, x), [x, block.norm.weight])
        out_tangent = torch.func.jvp(lambda x: block(x, POSITIONS), (x.detach(),), (tangent,))[1]
    assert set(seen.dtypes) == {torch.float64}, seen.dtypes.get(torch.float32)  # forward, backward and jvp
    assert grad.dtype == weight_grad.dtype == out_tangent.dtype == torch.float64
    assert relative(grad, want_grad) < 1e-13
    assert relative(weight_grad, want_weight_grad) < 1e-13
    assert relative(out_tangent, want_tangent) < 1e-13
    assert relative(as_written, want_grad) > 1e-9


def test_dtype_arguments_and_factories_ask_for_float64():
    with lift_float32() as lifting:
        made = {
            "to": torch.ones(3, dtype=torch.float64).to(dtype=torch.float32),
            "arange": torch.arange(0, 1, 0.125, dtype=torch.float32),
            "zeros": torch.zeros(2, dtype=torch.float32),
            "ones": torch.ones(2, dtype=torch.float32),
            "full": torch.full((2,), 0.1, dtype=torch.float32),
            "empty": torch.empty(2, dtype=torch.float32),
            "empty_like": torch.empty_like(torch.ones(2), dtype=torch.float32),
            "randn": torch.randn(2, dtype=torch.float32),
            "tensor": torch.tensor([0.1], dtype=torch.float32),
            "scalar_tensor": torch.scalar_tensor(0.1, dtype=torch.float32),
            "linspace": torch.linspace(0, 1, 7, dtype=torch.float32),
            "log_softmax": torch.log_softmax(torch.ones(3, dtype=torch.float64), -1, dtype=torch.float32),
            "complex": torch.zeros(2, dtype=torch.complex64),
        }
        half_softmax = torch.ops.aten._softmax.default(torch.ones(3, dtype=torch.float16), -1, True)
    assert {k: v.dtype for k, v in made.items() if v.dtype != torch.float64} == {"complex": torch.complex128}
    assert made["tensor"].item() == made["scalar_tensor"].item() == made["full"][0].item() == 0.1  # not rounded
    np.testing.assert_allclose(made["linspace"].numpy(), np.linspace(0, 1, 7), rtol=1e-15, atol=0)
    assert half_softmax.dtype == torch.float64
    assert all(island.lifted and island.module is None for island in lifting.islands)
    assert [island.what for island in lifting.islands] == [
        "to with dtype=float32",
        "arange with dtype=float32",
        "zeros with dtype=float32",
        "ones with dtype=float32",
        "full with dtype=float32",
        "empty with dtype=float32",
        "aten.ones with the default dtype float32",  # torch.ones(2) in empty_like's argument
        "empty_like with dtype=float32",
        "randn with dtype=float32",
        "tensor with dtype=float32",
        "scalar_tensor with dtype=float32",
        "linspace with dtype=float32",
        "log_softmax with dtype=float32",
        "zeros with dtype=complex64",
        "aten._softmax with half_to_float=True",
    ]


def test_bit_views_half_precision_and_integers_are_left_alone():
    x64 = inputs()
    x32 = x64.float()
    bits32 = x32.view(torch.int32)
    bf16 = x64.to(torch.bfloat16)
    with lift_float32() as lifting:
        round_trip = x64.view(torch.int64).view(torch.float64)
        bits, floats = x32.view(torch.int32), bits32.view(torch.float32)
        cast = x64.to(torch.bfloat16)
        cast_again = x64.to(torch.bfloat16).to(torch.float16)
        counts = torch.arange(5) * 3 + torch.tensor([1, 2, 3, 4, 5]) // 2
        signs = x64 > 0
    assert torch.equal(round_trip, x64)  # through the bits and back
    assert torch.equal(bits, bits32)  # float32's own bits, not float64's
    assert floats.dtype == torch.float32 and torch.equal(floats, x32)
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, bf16)
    assert relative(cast.double(), x64) > 1e-4  # bfloat16's rounding stays visible
    assert cast_again.dtype == torch.float16
    assert counts.dtype == torch.int64 and counts.tolist() == [0, 4, 7, 11, 14]
    assert signs.dtype == torch.bool
    assert lifting.islands == []


def test_writes_into_float32_run_as_written_and_are_listed():
    counter = torch.zeros(3, dtype=torch.float32)
    with lift_float32() as lifting:
        counter.add_(torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))
        doubled = counter * 2
    assert counter.dtype == torch.float32
    assert counter.tolist() == torch.tensor([0.1, 0.2, 0.3]).tolist()  # written, float32-rounded
    assert doubled.dtype == torch.float64
    assert lifting.islands == [
        Island("torch", None, "aten.add_ writes into a float32 tensor", lifted=False),
        Island("torch", None, "float32 input to aten.mul (a value made in float32: widened, still rounded)", False),
    ]


@torch.library.custom_op("flax_ln_tests::in_float32", mutates_args=())
def in_float32(x: torch.Tensor) -> torch.Tensor:
    """An op whose kernel computes in float32 whatever it is given (out of the lifting's reach)."""
    return x.float() * 3


@in_float32.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.float32)


def test_an_op_that_still_returns_float32_is_listed_not_lifted():
    with lift_float32() as lifting:
        out = in_float32(torch.ones(2, dtype=torch.float64))
    assert out.dtype == torch.float32
    assert lifting.islands == [Island("torch", None, "flax_ln_tests.in_float32 returns float32", lifted=False)]


def test_default_dtype_is_float64_inside_and_restored_after_even_on_error():
    before = torch.get_default_dtype()
    with lift_float32() as lifting:
        assert torch.get_default_dtype() == torch.float64
        assert torch.tensor(0.1).item() == 0.1
        thirds = torch.arange(3) / 3
    assert thirds.dtype == torch.float64 and thirds[1].item() == 1 / 3
    assert torch.get_default_dtype() == before
    if before == torch.float32:
        assert Island("torch", None, "aten.div with the default dtype float32", lifted=True) in lifting.islands
    with pytest.raises(KeyError), lift_float32():
        raise KeyError("inside")
    assert torch.get_default_dtype() == before


def test_islands_are_one_per_module_and_kind_with_their_paths():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = RMSNorm(D)
            self.second = nn.Sequential(RMSNorm(D))

        def forward(self, x):
            return self.second(self.first(x)).float().double()

    outer = Outer()
    x = inputs()
    with lift_float32(outer) as lifting:
        for _ in range(3):
            outer(x)
        x.float()
    assert lifting.islands == [
        Island("torch", "first", "aten._to_copy to float32", lifted=True),
        Island("torch", "second.0", "aten._to_copy to float32", lifted=True),
        Island("torch", WHOLE_MODEL, "aten._to_copy to float32", lifted=True),
        Island("torch", None, "aten._to_copy to float32", lifted=True),
    ]
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in outer.modules())  # hooks removed
    with lift_float32() as unrooted:
        outer(x)
    assert unrooted.islands == [Island("torch", None, "aten._to_copy to float32", lifted=True)]


class Rope(nn.Module):
    """A rotary table built at construction the transformers way (``.to(dtype=torch.float)``), with weights
    and a table read from float32 data."""

    def __init__(self, d: int = D):
        super().__init__()
        self.proj = nn.Linear(d, d)
        exponents = torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d
        self.register_buffer("inv_freq", 1.0 / (10000.0**exponents), persistent=False)
        self.register_buffer("mask", torch.tril(torch.ones(3, 3, dtype=torch.bool)), persistent=False)
        table = np.array([0.1, 0.3], dtype=np.float32)  # float32 data, beyond the lifting's reach
        self.register_buffer("table", torch.from_numpy(table), persistent=False)
        self.register_buffer("scale", torch.full((d,), 0.5))


class WithRope(nn.Module):
    """:class:`Rope` under a parent, so that paths show."""

    def __init__(self, d: int = D, tie: bool = False):
        super().__init__()
        self.rope = Rope(d)
        self.head = nn.Linear(d, d)
        if tie:
            self.head.weight = self.rope.proj.weight


def given_model() -> WithRope:
    """A float32 :class:`WithRope` with state no fresh build has: trained weights, a changed persistent buffer."""
    model = WithRope()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(generator=generator)
        model.rope.scale.fill_(0.25)
    model.rope.eval()
    model.head.weight.requires_grad_(False)
    return model


def test_build_lifted_rebuilds_construction_time_buffers_in_float64():
    like = given_model()
    before = {k: v.clone() for k, v in like.state_dict().items()}
    built, islands = build_lifted(WithRope, like)
    inv_freq = built.rope.inv_freq
    assert inv_freq.dtype == torch.float64
    np.testing.assert_allclose(inv_freq.numpy(), 1.0 / 10000.0 ** (np.arange(0, D, 2) / D), rtol=2e-16, atol=0)
    assert relative(like.rope.inv_freq.double(), inv_freq) > 1e-9  # float32-rounded in the given model
    assert islands == [
        Island("torch", "rope", "buffer inv_freq rebuilt in float64", lifted=True),
        Island(
            "torch", "rope", "buffer table holds float32-rounded values even when built under lifting", lifted=False
        ),
    ]
    for name, value in built.state_dict().items():
        assert value.dtype == torch.float64 and torch.equal(value, before[name].double()), name
    assert [m.training for m in built.modules()] == [m.training for m in like.modules()]
    assert [p.requires_grad for p in built.parameters()] == [p.requires_grad for p in like.parameters()]
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in like.state_dict().items())
    assert like.rope.inv_freq.dtype == torch.float32  # the given model is not changed
    assert [island.what.split()[1] for island in rounded_buffers(built, set(like.state_dict()))] == ["table"]


def test_build_lifted_keeps_a_buffer_changed_after_construction():
    like = given_model()
    like.rope.mask.fill_(False)
    built, islands = build_lifted(WithRope, like)
    assert built.rope.mask.dtype == torch.bool and not built.rope.mask.any()
    assert (
        Island(
            "torch",
            "rope",
            "buffer mask kept from the given model: the rebuilt one differs beyond float32 rounding",
            lifted=False,
        )
        in islands
    )


def test_build_lifted_refuses_a_factory_that_builds_another_model():
    like = given_model()
    with pytest.raises(ValueError, match=r"(?s)does not take the given model's state.*rope\.proj\.weight"):
        build_lifted(lambda: WithRope(d=4), like)
    with pytest.raises(ValueError, match=r"other values than the given model's: \['rope\.proj\.weight'\]"):
        build_lifted(lambda: WithRope(tie=True), like)  # the tie makes the two weights one


def test_build_lifted_restores_the_default_dtype_when_the_factory_fails():
    before = torch.get_default_dtype()

    def failing():
        assert torch.get_default_dtype() == torch.float64
        raise RuntimeError("no model")

    with pytest.raises(RuntimeError, match="no model"):
        build_lifted(failing, given_model())
    assert torch.get_default_dtype() == before


def test_default_factory_is_for_transformers_models_only():
    class Config:
        width = D

    class Pretrained(nn.Module):  # what transformers' PreTrainedModel has
        config_class = Config

        def __init__(self, config):
            super().__init__()
            self.config = config
            self.proj = nn.Linear(config.width, config.width)

        def post_init(self):
            pass

    model = Pretrained(Config())
    factory = default_factory(model)
    assert factory is not None
    built = factory()
    assert type(built) is Pretrained and built.config is not model.config and built.config.width == D
    assert default_factory(WithRope()) is None
    assert default_factory(nn.Linear(2, 2)) is None


def test_rounded_buffers_lists_float32_rounded_buffers_the_weights_leave():
    model = WithRope().double()
    unloaded = {
        "positions": torch.arange(8, dtype=torch.float64),  # integers prove nothing
        "halves": torch.tensor([0.5, 0.25, 1.75, 3.0], dtype=torch.float64),  # nor do short fractions
        "exact": 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)),  # float64 values
        "narrow": torch.tensor([0.1, 1.3]),  # float32: not a float64 buffer
        "big": torch.tensor([12345.678]).double(),  # rounded, beyond float16's range
    }
    for name, value in unloaded.items():
        model.register_buffer(name, value, persistent=False)
    model.register_buffer("loaded", torch.tensor([0.1, 12345.678]).double())  # rounded, but the weights set it
    weights = set(model.state_dict())
    assert "loaded" in weights and not weights & {"rope.inv_freq", *unloaded}
    what = "holds float32-rounded values: pass torch_factory= to rebuild it in float64"
    assert rounded_buffers(model, weights) == [
        Island("torch", WHOLE_MODEL, f"buffer big {what}", lifted=False),
        Island("torch", "rope", f"buffer inv_freq {what}", lifted=False),
        Island("torch", "rope", f"buffer table {what}", lifted=False),
    ]


def test_the_modules_import_no_torch():
    for module in (islands_module, torch_islands):
        tree = ast.parse(inspect.getsource(module))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] in ("torch", "jax", "transformers")], module.__name__


def test_transformers_llama_runs_float64_throughout_when_built_and_run_lifted():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).eval()
    factory = default_factory(model)
    assert factory is not None
    lifted, islands = build_lifted(factory, model)
    inv_freq = lifted.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float64 and not torch.equal(inv_freq.float().double(), inv_freq)
    assert Island("torch", "rotary_emb", "buffer inv_freq rebuilt in float64", lifted=True) in islands
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        as_written = lifted(input_ids=ids).last_hidden_state
        with FloatingOutputs() as seen, lift_float32(lifted) as lifting:
            out = lifted(input_ids=ids).last_hidden_state
    assert set(seen.dtypes) == {torch.float64}, seen.dtypes.get(torch.float32)  # every op, every output
    assert 1e-10 < relative(as_written, out) < 1e-5  # what lifting changed: the float32 islands' rounding
    found = {(island.module, island.what) for island in lifting.islands}
    assert {
        ("rotary_emb", "aten._to_copy to float32"),
        ("layers.0.input_layernorm", "aten._to_copy to float32"),
        ("layers.0.post_attention_layernorm", "aten._to_copy to float32"),
        ("norm", "aten._to_copy to float32"),
        ("layers.0.self_attn", "softmax with dtype=float32"),
    } <= found, found
