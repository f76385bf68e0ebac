"""A ViT classifier (``transformers.ViTForImageClassification``) in NNX, channels-last, with its key map.

Math: non-overlapping ``p x p`` patches embedded by a stride-``p`` conv, a class token
prepended, learned position embeddings added; pre-norm encoder blocks ``x + attn(ln(x))``,
``x + mlp(ln(x))`` with the exact (erf) GELU; a final LayerNorm; the class token's
features through a linear classifier. LayerNorm eps is transformers' 1e-12, its
variance two-pass.

Unlike transformers' module tree: images are NHWC, the patch conv's kernel is
``(p, p, C, d)`` inside a wrapper module; q, k and v are one stacked kernel
``(3, d, heads, head_dim)`` (bias ``(3, heads, head_dim)``) and the output kernel is
``(heads, head_dim, d)``; the class token is ``(d,)`` and the position table ``(T, d)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flax_ln.convert import KeyMap


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """The sizes of a ViT classifier."""

    image: int
    patch: int
    channels: int
    width: int
    layers: int
    heads: int
    mlp: int
    classes: int
    eps: float = 1e-12


def config_from_hf(hf: Any) -> ViTConfig:
    """The :class:`ViTConfig` of a ``transformers.ViTConfig`` (erf GELU, q/k/v biases)."""
    if hf.hidden_act != "gelu" or not hf.qkv_bias:
        raise ValueError("this port covers ViTs with the exact GELU and q/k/v biases")
    return ViTConfig(
        hf.image_size, hf.patch_size, hf.num_channels, hf.hidden_size, hf.num_hidden_layers,
        hf.num_attention_heads, hf.intermediate_size, hf.num_labels, hf.layer_norm_eps,
    )  # fmt: skip


class PatchEmbed(nnx.Module):
    """A wrapper around its one child, the stride-``p`` conv: NHWC images -> patch features (B, patches, d)."""

    def __init__(self, c: ViTConfig, *, param_dtype, rngs: nnx.Rngs):
        p = c.patch
        self.conv = nnx.Conv(
            c.channels, c.width, (p, p), strides=p, padding="VALID", param_dtype=param_dtype, rngs=rngs
        )

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.conv(images)  # (B, H/p, W/p, d)
        return x.reshape(x.shape[0], -1, x.shape[-1])  # (B, patches, d), row-major over the grid as torch


class SelfAttention(nnx.Module):
    """Bidirectional multi-head attention: ``qkv (3, d, n, h)``, ``qkv_bias (3, n, h)``, ``o (n, h, d)``, ``o_bias``."""

    def __init__(self, c: ViTConfig, *, param_dtype, rngs: nnx.Rngs):
        h = c.width // c.heads
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=(2, 3))
        self.qkv = nnx.Param(init(rngs.params(), (3, c.width, c.heads, h), param_dtype))
        self.qkv_bias = nnx.Param(jnp.zeros((3, c.heads, h), param_dtype))
        self.o = nnx.Param(
            nnx.initializers.lecun_normal(in_axis=(0, 1))(rngs.params(), (c.heads, h, c.width), param_dtype)
        )
        self.o_bias = nnx.Param(jnp.zeros((c.width,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = jnp.einsum("btd,sdnh->sbtnh", x, self.qkv[...]) + self.qkv_bias[...][:, None, None]  # (3, B, T, n, h)
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k) * q.shape[-1] ** -0.5  # (B, n, T, T)
        weights = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bnqk,bknh,nhd->bqd", weights, v, self.o[...]) + self.o_bias[...]  # (B, T, d)


class EncoderBlock(nnx.Module):
    """``x + attn(ln1(x))``, then ``+ fc2(gelu(fc1(ln2(.))))`` with the exact GELU; ``gelu_approximate`` plants tanh."""

    def __init__(self, c: ViTConfig, *, param_dtype, rngs: nnx.Rngs):
        ln = dict(epsilon=c.eps, use_fast_variance=False, param_dtype=param_dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(c.width, **ln)
        self.attn = SelfAttention(c, param_dtype=param_dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(c.width, **ln)
        self.fc1 = nnx.Linear(c.width, c.mlp, param_dtype=param_dtype, rngs=rngs)
        self.fc2 = nnx.Linear(c.mlp, c.width, param_dtype=param_dtype, rngs=rngs)
        self.gelu_approximate = False

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)), approximate=self.gelu_approximate))


class ViT(nnx.Module):
    """NHWC images (B, H, W, C) -> class logits (B, classes)."""

    def __init__(self, c: ViTConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        tokens = (c.image // c.patch) ** 2 + 1
        self.patches = PatchEmbed(c, param_dtype=param_dtype, rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((c.width,), param_dtype))
        self.pos = nnx.Param(jnp.zeros((tokens, c.width), param_dtype))
        self.layers = nnx.List([EncoderBlock(c, param_dtype=param_dtype, rngs=rngs) for _ in range(c.layers)])
        self.norm = nnx.LayerNorm(c.width, epsilon=c.eps, use_fast_variance=False, param_dtype=param_dtype, rngs=rngs)
        self.classify = nnx.Linear(c.width, c.classes, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.patches(images)  # (B, patches, d)
        cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, x.shape[-1]))  # (B, 1, d)
        x = jnp.concatenate([cls, x], axis=1) + self.pos[...]  # (B, T, d)
        for layer in self.layers:
            x = layer(x)
        return self.classify(self.norm(x)[:, 0])  # (B, classes)


def _transformers_major() -> int | None:
    """The installed transformers' major version (``None``: not installed), read without importing it."""
    import importlib.metadata

    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


_LAYER = r"vit\.layers\.(\d+)\."
_LN = {"layernorm_before": "ln1", "layernorm_after": "ln2"}
_LAYER4 = r"vit\.encoder\.layer\.(\d+)\."  # transformers 4.x's names of the same layers
_MLP4 = {"intermediate": "fc1", "output": "fc2"}

# transformers 5 names the layers vit.layers.N.attention.q_proj (...), 4.x vit.encoder.layer.N.attention.attention.query
# (...): the key map takes the installed transformers' names (rules that match nothing would warn on every load)
TRANSFORMERS_4 = _transformers_major() == 4
_LAYERS_5 = [
    (_LAYER + r"attention\.q_proj\.weight", r"layers.\1.attn.qkv[0]", "(n h) d -> d n h"),
    (_LAYER + r"attention\.k_proj\.weight", r"layers.\1.attn.qkv[1]", "(n h) d -> d n h"),
    (_LAYER + r"attention\.v_proj\.weight", r"layers.\1.attn.qkv[2]", "(n h) d -> d n h"),
    (_LAYER + r"attention\.q_proj\.bias", r"layers.\1.attn.qkv_bias[0]", "(n h) -> n h"),
    (_LAYER + r"attention\.k_proj\.bias", r"layers.\1.attn.qkv_bias[1]", "(n h) -> n h"),
    (_LAYER + r"attention\.v_proj\.bias", r"layers.\1.attn.qkv_bias[2]", "(n h) -> n h"),
    (_LAYER + r"attention\.o_proj\.weight", r"layers.\1.attn.o", "d (n h) -> n h d"),
    (_LAYER + r"attention\.o_proj\.bias", r"layers.\1.attn.o_bias", None),
    *[(_LAYER + rf"{t}\.weight", rf"layers.\1.{f}.scale", None) for t, f in _LN.items()],
    *[(_LAYER + rf"{t}\.bias", rf"layers.\1.{f}.bias", None) for t, f in _LN.items()],
    (_LAYER + r"mlp\.(fc1|fc2)\.weight", r"layers.\1.\2.kernel", "o i -> i o"),
    (_LAYER + r"mlp\.(fc1|fc2)\.bias", r"layers.\1.\2.bias", None),
]
_LAYERS_4 = [
    *[
        (_LAYER4 + rf"attention\.attention\.{t}\.weight", rf"layers.\1.attn.qkv[{i}]", "(n h) d -> d n h")
        for i, t in enumerate(("query", "key", "value"))
    ],
    *[
        (_LAYER4 + rf"attention\.attention\.{t}\.bias", rf"layers.\1.attn.qkv_bias[{i}]", "(n h) -> n h")
        for i, t in enumerate(("query", "key", "value"))
    ],
    (_LAYER4 + r"attention\.output\.dense\.weight", r"layers.\1.attn.o", "d (n h) -> n h d"),
    (_LAYER4 + r"attention\.output\.dense\.bias", r"layers.\1.attn.o_bias", None),
    *[(_LAYER4 + rf"{t}\.weight", rf"layers.\1.{f}.scale", None) for t, f in _LN.items()],
    *[(_LAYER4 + rf"{t}\.bias", rf"layers.\1.{f}.bias", None) for t, f in _LN.items()],
    *[(_LAYER4 + rf"{t}\.dense\.weight", rf"layers.\1.{f}.kernel", "o i -> i o") for t, f in _MLP4.items()],
    *[(_LAYER4 + rf"{t}\.dense\.bias", rf"layers.\1.{f}.bias", None) for t, f in _MLP4.items()],
]
KEY_MAP = KeyMap(
    [
        (r"vit\.embeddings\.cls_token", "cls", "1 1 d -> d"),
        (r"vit\.embeddings\.position_embeddings", "pos", "1 t d -> t d"),
        (r"vit\.embeddings\.patch_embeddings\.projection\.weight", "patches.conv.kernel", "o i kh kw -> kh kw i o"),
        (r"vit\.embeddings\.patch_embeddings\.projection\.bias", "patches.conv.bias", None),
        *(_LAYERS_4 if TRANSFORMERS_4 else _LAYERS_5),
        (r"vit\.layernorm\.weight", "norm.scale", None),
        (r"vit\.layernorm\.bias", "norm.bias", None),
        (r"classifier\.weight", "classify.kernel", "o i -> i o"),
        (r"classifier\.bias", "classify.bias", None),
    ]
)
