"""Three ports of transformers models that do not mirror them (examples/ports), each loaded through its own KeyMap:
outputs equal transformers' in float32 and float64, the tie is found and its gradient summed, exports round-trip."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.llama import modeling_llama
from transformers.models.vit import modeling_vit

from flax_ln import load_torch_state_dict, to_torch_state_dict
from flax_ln.convert import Tie
from flax_ln.parity import TOLERANCES, compare_tensors, relative_error

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is not installed; the ports are imported from the checkout
    sys.path.insert(0, str(ROOT))
from examples.ports import llama, resnet, vit  # noqa: E402

BATCH, SEQ, IMAGE_RESNET, IMAGE_VIT = 2, 7, 32, 16


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights far from transformers' init (norm scales near 1, running statistics away from 0 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(noise / (p[0].numel() ** 0.5 if p.ndim > 1 else 3.0))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    return model.eval()


def hf_llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    return randomized(transformers.LlamaForCausalLM(config))


def hf_resnet():
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[1, 2], layer_type="bottleneck", num_labels=5
    )
    return randomized(transformers.ResNetForImageClassification(config))


def hf_vit():
    config = transformers.ViTConfig(
        image_size=IMAGE_VIT, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5, attn_implementation="eager",
    )  # fmt: skip
    return randomized(transformers.ViTForImageClassification(config))


def token_ids():
    return np.random.default_rng(1).integers(0, 64, (BATCH, SEQ))


def images(size):
    return np.random.default_rng(2).standard_normal((BATCH, 3, size, size))  # NCHW, torch's layout


# name: (transformers model, port module, port class, torch inputs, the port's inputs for a dtype)
PORTS = {
    "llama": (hf_llama, llama, llama.Llama, token_ids, lambda x, dt: jnp.asarray(x)),
    "resnet": (hf_resnet, resnet, resnet.ResNet, lambda: images(IMAGE_RESNET), lambda x, dt: nhwc(x, dt)),
    "vit": (hf_vit, vit, vit.ViT, lambda: images(IMAGE_VIT), lambda x, dt: nhwc(x, dt)),
}


def nhwc(x, dtype):
    return jnp.asarray(x.transpose(0, 2, 3, 1), dtype)  # (B, H, W, C)


def torch_input(x, dtype):
    t = torch.from_numpy(x)
    return t if not t.is_floating_point() else t.to(getattr(torch, dtype))


def build(name, dtype):
    make_hf, module, cls, make_inputs, to_port = PORTS[name]
    hf = make_hf().to(getattr(torch, dtype))
    config = module.config_from_hf(hf.config)
    # Built abstract (shapes only, no initialiser runs) and filled by the strict loader: every variable is set.
    port = nnx.eval_shape(lambda: cls(config, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0)))
    load_torch_state_dict(port, hf.state_dict(), weights=module.KEY_MAP)
    x = make_inputs()
    return hf, port, torch_input(x, dtype), to_port(x, getattr(jnp, dtype))


def run(port, x):
    """The port's forward, jitted once (split the model, merge inside): one compile instead of one per eager op."""
    graphdef, state = nnx.split(port)
    return np.asarray(jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x))


def outputs(name, dtype):
    hf, port, torch_x, port_x = build(name, dtype)
    with torch.no_grad():
        expected = hf(torch_x).logits.numpy()
    return run(port, port_x), expected


# transformers keeps float32 islands inside a float64 model: LlamaRMSNorm casts to float32 and back, the rotary
# tables are computed in float32 (inv_freq from a float32 arange, angles from .float()), and eager attention takes
# its softmax with dtype=float32 (Llama and ViT alike). The ports compute all three in the model's dtype, so a
# float64 comparison is bounded by those islands (about 1e-7 here, measured in the test below). This patch computes the
# three in the input's dtype on the torch side: both sides then run every op in float64.
def _rms_norm_in_input_dtype(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary_in_input_dtype(self, x, position_ids):
    base, dim = self.config.rope_parameters["rope_theta"], 2 * self.inv_freq.shape[0]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=x.dtype) / dim))
    angles = position_ids[..., None].to(x.dtype) * inv_freq  # (B, T, dim/2)
    angles = torch.cat((angles, angles), dim=-1)  # (B, T, dim)
    return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def _eager_attention_in_input_dtype(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = modeling_llama.repeat_kv(key, groups), modeling_llama.repeat_kv(value, groups)  # (B, n, T, h)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.size(-1) ** -0.5)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights  # (B, T, n, h)


@pytest.fixture
def float64_islands(monkeypatch):
    """transformers' float32 islands (RMSNorm, rotary tables, eager softmax) computed in float64 instead."""
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_input_dtype)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _rotary_in_input_dtype)
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", _eager_attention_in_input_dtype)
    monkeypatch.setattr(modeling_vit, "eager_attention_forward", _eager_attention_in_input_dtype)


@pytest.mark.parametrize("name", list(PORTS))
def test_port_matches_transformers_in_float32(name):
    """The policy's float32 output bound (1e-5): XLA and torch reduce in different orders, ~1e-7 per op."""
    actual, expected = outputs(name, "float32")
    result = compare_tensors("logits", "output", actual, expected, TOLERANCES["float32"]["output"], dtype="float32")
    assert result.passed, result


@pytest.mark.parametrize("name", list(PORTS))
def test_port_matches_transformers_in_float64(x64, float64_islands, name):
    """The policy's float64 output bound (1e-12): the same math on both sides, op-order rounding only."""
    actual, expected = outputs(name, "float64")
    result = compare_tensors("logits", "output", actual, expected, TOLERANCES["float64"]["output"], dtype="float64")
    assert result.passed, result


@pytest.mark.parametrize("name", ["llama", "vit"])
def test_float64_as_shipped_is_bounded_by_transformers_float32_islands(x64, name):
    """Unpatched, transformers' float32 islands dominate: measured 1.9e-7 (Llama), 4.4e-8 (ViT); bound 1e-6.

    It also stays above the float64 policy: if transformers ever drops the islands, this test says so.
    """
    actual, expected = outputs(name, "float64")
    assert actual.dtype == np.float64
    assert TOLERANCES["float64"]["output"].rtol < relative_error(actual, expected) < 1e-6


def test_resnet_running_statistics_are_batch_stats():
    hf, port, _, _ = build("resnet", "float32")
    norm = port.stages[1][0].proj.norm
    assert isinstance(norm.mean, nnx.BatchStat) and isinstance(norm.var, nnx.BatchStat)
    torch_norm = hf.resnet.encoder.stages[1].layers[0].shortcut.normalization
    np.testing.assert_array_equal(norm.var[...], torch_norm.running_var.numpy())


def test_llama_tie_is_found_and_its_gradient_is_the_sum_of_both_copies():
    """transformers ties lm_head to the embedding (one Parameter); the port keeps two variables. The plan sums
    their gradients under the canonical name. float32 gradient policy (1e-4): rounding of two backward passes."""
    hf, port, torch_ids, ids = build("llama", "float32")
    plan = llama.KEY_MAP.resolve(port, hf.state_dict())
    assert plan.ties == {
        "model.embed_tokens.weight": Tie(
            ("model.embed_tokens.weight", "lm_head.weight"), ("tok.embedding", "head.proj.kernel")
        )
    }
    weights = np.random.default_rng(3).standard_normal((BATCH, SEQ, 64)).astype(np.float32)
    (hf(torch_ids).logits * torch.from_numpy(weights)).sum().backward()
    graphdef, params = nnx.split(port)
    grads = jax.jit(jax.grad(lambda params: (nnx.merge(graphdef, params)(ids) * weights).sum()))(params)
    flat = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
    named = plan.torch_gradients(flat)
    torch_grads = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    assert named.keys() == torch_grads.keys()
    for n, g in torch_grads.items():
        result = compare_tensors(n, "param grad", named[n], g, TOLERANCES["float32"]["grad"])
        assert result.passed, result
    # either copy alone is far off: the tie matters
    embed_only = flat["tok.embedding"]
    assert relative_error(embed_only, torch_grads["model.embed_tokens.weight"]) > 0.1


@pytest.mark.parametrize("name", list(PORTS))
def test_export_round_trips_into_transformers_strict(name):
    hf, port, _, _ = build(name, "float32")
    module = PORTS[name][1]
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    state = to_torch_state_dict(port, weights=module.KEY_MAP, like=hf.state_dict())
    assert list(state) == list(original)
    fresh = PORTS[name][0]().float()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    for key, value in fresh.state_dict().items():
        assert value.dtype == original[key].dtype, key
        assert torch.equal(value, original[key]), key


def test_llama_exports_without_like_from_its_regexes():
    """Every Llama rule is a literal with groups and its layouts are einops patterns: no like= needed."""
    hf, port, _, _ = build("llama", "float32")
    state = to_torch_state_dict(port, weights=llama.KEY_MAP)
    assert set(state) == set(hf.state_dict())
    fresh = hf_llama()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    for key, value in hf.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
