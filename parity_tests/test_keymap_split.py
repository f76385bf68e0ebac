"""One torch tensor split across several flax variables: a key map's split rule (``{torch slab: template}``) for
torch's fused ``in_proj_weight`` (``nn.MultiheadAttention``), GPT-2's ``c_attn`` (Conv1D, (in, 3E)) and a stacked
tensor; loading, strict export, the source, gradients slab by slab, tangents through torch's attention."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from split_attention import MHA_FORWARD, MHA_MAP, Attention, E, torch_attention

from flax_ln.convert import ConversionError, KeyMap, load_torch_state_dict, to_torch_state_dict
from flax_ln.parity import compare_modules

X = np.random.default_rng(0).normal(size=(2, 5, E)).astype(np.float32)


def test_split_loads_each_slab_and_exports_the_tensor_whole():
    torch_module = torch_attention()
    port = load_torch_state_dict(Attention(nnx.Rngs(0)), torch_module.state_dict(), weights=MHA_MAP)
    w = torch_module.in_proj_weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(port.v.kernel[...]), w[32:48].T)
    np.testing.assert_array_equal(np.asarray(port.k.bias[...]), torch_module.in_proj_bias.detach().numpy()[16:32])
    back = to_torch_state_dict(port, weights=MHA_MAP, like=torch_module.state_dict())
    assert list(back) == list(torch_module.state_dict())
    for key, value in torch_module.state_dict().items():
        np.testing.assert_array_equal(back[key], value.numpy(), err_msg=key)


def test_split_source_round_trips():
    source = MHA_MAP.to_source()
    assert '{r"[0:16]": r"q.kernel", r"[16:32]": r"k.kernel", r"[32:48]": r"v.kernel"}, "o i -> i o"' in source
    again = eval(source, {"KeyMap": KeyMap, "np": np})  # noqa: S307 - the map's own source
    assert again.to_source() == source
    torch_module = torch_attention()
    a = load_torch_state_dict(Attention(nnx.Rngs(0)), torch_module.state_dict(), weights=again)
    np.testing.assert_array_equal(np.asarray(a.q.kernel[...]), torch_module.in_proj_weight.detach().numpy()[:16].T)


def test_split_slabs_must_tile_the_tensor_and_fit_it():
    state = torch_attention().state_dict()
    gap = KeyMap(
        [
            (r"in_proj_weight", {"[0:16]": "q.kernel", "[32:48]": "v.kernel"}, "o i -> i o"),
            (r"in_proj_bias|out_proj\..*", None, None),
        ]
    )
    with pytest.raises(ConversionError, match=r"in_proj_weight.*torch slabs: a gap: elements \[16:32, 0:16\]"):
        load_torch_state_dict(Attention(nnx.Rngs(0)), state, weights=gap)
    outside = KeyMap(
        [(r"in_proj_weight", {"[40:56]": "q.kernel"}, "o i -> i o"), (r"in_proj_bias|out_proj\..*", None, None)]
    )
    with pytest.raises(ConversionError, match=r"\[40:56\] -> 'q.kernel'.*does not fit the tensor"):
        load_torch_state_dict(Attention(nnx.Rngs(0)), state, weights=outside)
    with pytest.raises(ValueError, match=r"torch slab '0:16' is not '\[items\]'"):
        KeyMap([(r"in_proj_weight", {"0:16": "q.kernel"}, None)])


def test_split_export_without_like_says_to_pass_it():
    port = load_torch_state_dict(Attention(nnx.Rngs(0)), torch_attention().state_dict(), weights=MHA_MAP)
    with pytest.raises(ConversionError, match="splits a torch tensor into slabs; pass like="):
        to_torch_state_dict(port, weights=MHA_MAP)


def test_split_gradients_are_compared_slab_by_slab_under_the_torch_key():
    report = compare_modules(torch_attention(), Attention(nnx.Rngs(0)), X, weights=MHA_MAP, forward=MHA_FORWARD)
    assert report.passed, report
    assert [r.name for r in report.results if "in_proj_weight" in r.name] == [
        "in_proj_weight[0:16]",
        "in_proj_weight[16:32]",
        "in_proj_weight[32:48]",
    ]
    assert report.float64_check is not None and report.float64_check.passed


def test_a_wrong_v_is_blamed_on_the_v_slab_not_q():
    # the default dtype: float64 shows k's bias gradient is zero (softmax ignores a shift), slab by slab
    report = compare_modules(
        torch_attention(), Attention(nnx.Rngs(0), frozen_v=True), X, weights=MHA_MAP, forward=MHA_FORWARD
    )
    failed = {r.name for r in report.results if not r.passed}
    assert failed == {"in_proj_weight[32:48]", "in_proj_bias[32:48]"}, failed


def test_split_tangents_through_torch_attention_jvp():
    """torch's MultiheadAttention takes fused kernels with no forward-mode derivative; jvp must still run."""
    report = compare_modules(
        torch_attention(), Attention(nnx.Rngs(0)), X, weights=MHA_MAP, forward=MHA_FORWARD, mode="jvp", dtype="float32"
    )
    assert report.passed, report
    assert "tangent output" in {r.name for r in report.results}


# GPT-2's c_attn: a Conv1D weight (E, 3E), (in, out), split along its columns into three kernels.


class FusedQKV(torch.nn.Module):
    """GPT-2's layout: one Conv1D ``c_attn`` gives q, k and v; the output mixes them (no attention needed)."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c_attn = Conv1D(3 * E, E)
        torch.nn.init.normal_(self.c_attn.bias)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(E, dim=-1)
        return q * torch.tanh(k) + v


class SeparateQKV(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.q, self.k, self.v = (nnx.Linear(E, E, rngs=rngs) for _ in range(3))

    def __call__(self, x):
        return self.q(x) * jnp.tanh(self.k(x)) + self.v(x)


C_ATTN_MAP = KeyMap(
    [
        (r"c_attn\.weight", {"[:, 0:16]": "q.kernel", "[:, 16:32]": "k.kernel", "[:, 32:48]": "v.kernel"}, None),
        (r"c_attn\.bias", {"[0:16]": "q.bias", "[16:32]": "k.bias", "[32:48]": "v.bias"}, None),
    ]
)


def test_gpt2_c_attn_into_separate_kernels_loads_exports_and_compares():
    torch.manual_seed(1)
    torch_module = FusedQKV()
    port = load_torch_state_dict(SeparateQKV(nnx.Rngs(0)), torch_module.state_dict(), weights=C_ATTN_MAP)
    np.testing.assert_array_equal(np.asarray(port.k.kernel[...]), torch_module.c_attn.weight.detach().numpy()[:, 16:32])
    back = to_torch_state_dict(port, weights=C_ATTN_MAP, like=torch_module.state_dict())
    for key, value in torch_module.state_dict().items():
        np.testing.assert_array_equal(back[key], value.numpy(), err_msg=key)
    report = compare_modules(torch_module, SeparateQKV(nnx.Rngs(0)), X, weights=C_ATTN_MAP)
    assert report.passed, report
    assert "c_attn.weight[:, 32:48]" in {r.name for r in report.results}


# A stacked torch tensor into per-layer variables.


class Stacked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, E, E) / 4)

    def forward(self, x):
        for w in self.weight:
            x = torch.tanh(x @ w)
        return x


class Layers(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(E, E, use_bias=False, rngs=rngs) for _ in range(3)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def test_a_stacked_tensor_into_per_layer_variables():
    key_map = KeyMap([(r"weight", {f"[{i}]": f"layers.{i}.kernel" for i in range(3)}, None)])
    torch.manual_seed(2)
    torch_module = Stacked()
    port = load_torch_state_dict(Layers(nnx.Rngs(0)), torch_module.state_dict(), weights=key_map)
    np.testing.assert_array_equal(np.asarray(port.layers[2].kernel[...]), torch_module.weight.detach().numpy()[2])
    back = to_torch_state_dict(port, weights=key_map, like=torch_module.state_dict())
    np.testing.assert_array_equal(back["weight"], torch_module.weight.detach().numpy())
    report = compare_modules(torch_module, Layers(nnx.Rngs(0)), X, weights=key_map, dtype="float32")
    assert report.passed, report
    assert {"weight[0]", "weight[1]", "weight[2]"} <= {r.name for r in report.results}
