"""A ViT classifier (``transformers.ViTForImageClassification``) in Linen, channels-last, with its key map.

The Linen twin of :mod:`.vit`, written again from the torch modules' math: non-overlapping
``p x p`` patches embedded by a stride-``p`` conv, a class token prepended, learned position
embeddings added; pre-norm encoder blocks ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))`` with the
exact (erf) GELU; a final LayerNorm; the class token's features through a linear classifier.
LayerNorm eps is the config's (transformers' 1e-12), its variance two-pass.

Its own layout, unlike transformers' module tree: images are NHWC; the patch conv's kernel is
``(p, p, C, d)``; q, k and v are ``nn.DenseGeneral`` kernels ``(d, heads, head_dim)`` and the
output kernel is ``(heads, head_dim, d)``; the blocks are ``blocks_0``, ``blocks_1``, ...
(a list in ``setup``); the class token is ``(d,)`` and the position table ``(T, d)``.
Compared through ``flax_ln.parity.Linen(ViT(config), variables)`` with ``weights=KEY_MAP``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from examples.ports.vit import ViTConfig, config_from_hf
from flax_ln.convert import KeyMap

__all__ = ["KEY_MAP", "ViT", "ViTConfig", "config_from_hf"]


def _layer_norm(eps: float, dtype, param_dtype, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(eps, dtype, param_dtype, use_fast_variance=False, name=name)


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention over (B, T, d)."""

    config: ViTConfig
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        h = c.width // c.heads
        project = dict(features=(c.heads, h), dtype=self.dtype, param_dtype=self.param_dtype)
        q, k, v = (nn.DenseGeneral(**project, name=n)(x) for n in ("query", "key", "value"))  # each (B, T, n, h)
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k) * h**-0.5  # (B, n, T, T)
        weights = jax.nn.softmax(scores, axis=-1)
        mixed = jnp.einsum("bnqk,bknh->bqnh", weights, v)  # (B, T, n, h)
        out = nn.DenseGeneral(c.width, axis=(-2, -1), dtype=self.dtype, param_dtype=self.param_dtype, name="out")
        return out(mixed)  # (B, T, d)


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))``, the exact GELU unless ``approximate`` (a planted mistake: the tanh form)."""

    config: ViTConfig
    approximate: bool = False
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        hidden = nn.Dense(self.config.mlp, **dense, name="fc1")(x)  # (B, T, mlp)
        return nn.Dense(self.config.width, **dense, name="fc2")(jax.nn.gelu(hidden, approximate=self.approximate))


class Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``+ mlp(ln_2(.))``; ``ln_2_eps`` overrides ln_2's epsilon (a planted mistake)."""

    config: ViTConfig
    approximate_gelu: bool = False
    ln_2_eps: float | None = None
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        c, dt, pdt = self.config, self.dtype, self.param_dtype
        self.ln_1 = _layer_norm(c.eps, dt, pdt, "ln_1")
        self.attn = SelfAttention(c, dt, pdt)
        self.ln_2 = _layer_norm(c.eps if self.ln_2_eps is None else self.ln_2_eps, dt, pdt, "ln_2")
        self.mlp = MLP(c, self.approximate_gelu, dt, pdt)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """NHWC images (B, H, W, C) -> class logits (B, classes).

    Planted mistakes (none by default): ``tanh_gelu_blocks``, the blocks whose MLP takes the tanh GELU;
    ``ln_2_eps``, ``(block, eps)`` pairs whose ln_2 takes another epsilon.
    ``dtype``: the compute dtype (``None``: the parameters'), ``param_dtype`` the parameters'.
    """

    config: ViTConfig
    tanh_gelu_blocks: tuple[int, ...] = ()
    ln_2_eps: tuple[tuple[int, float], ...] = ()
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        c, dt, pdt = self.config, self.dtype, self.param_dtype
        p, tokens = c.patch, (c.image // c.patch) ** 2 + 1
        self.patch_embed = nn.Conv(c.width, (p, p), strides=p, padding="VALID", dtype=dt, param_dtype=pdt)
        self.cls = self.param("cls", nn.initializers.zeros, (c.width,), pdt)
        self.pos = self.param("pos", nn.initializers.normal(0.02), (tokens, c.width), pdt)
        eps = dict(self.ln_2_eps)
        self.blocks = [Block(c, i in self.tanh_gelu_blocks, eps.get(i), dt, pdt) for i in range(c.layers)]
        self.norm = _layer_norm(c.eps, dt, pdt, "norm")
        self.head = nn.Dense(c.classes, dtype=dt, param_dtype=pdt)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.patch_embed(images)  # (B, H/p, W/p, d)
        x = x.reshape(x.shape[0], -1, x.shape[-1])  # (B, patches, d), row-major over the grid as torch
        cls = jnp.broadcast_to(self.cls, (x.shape[0], 1, x.shape[-1])).astype(x.dtype)  # (B, 1, d)
        x = jnp.concatenate([cls, x], axis=1) + self.pos  # (B, T, d)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])  # (B, classes)


def _transformers_major() -> int | None:
    """The installed transformers' major version (``None``: not installed), read without importing it."""
    import importlib.metadata

    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


_LAYER = r"vit\.layers\.(\d+)\."
_ATTN = _LAYER + r"attention\."
_QKV = {"q": "query", "k": "key", "v": "value"}
_LN = {"layernorm_before": "ln_1", "layernorm_after": "ln_2"}
_LAYER4 = r"vit\.encoder\.layer\.(\d+)\."  # transformers 4.x's names of the same layers
_ATTN4 = _LAYER4 + r"attention\."

# transformers 5 names the layers vit.layers.N.attention.q_proj (...), 4.x vit.encoder.layer.N.attention.attention.query
# (...): the key map takes the installed transformers' names (rules that match nothing would warn on every load)
TRANSFORMERS_4 = _transformers_major() == 4
_LAYERS_5 = [
    *[(_ATTN + rf"{t}_proj\.weight", rf"blocks_\1.attn.{f}.kernel", "(n h) d -> d n h") for t, f in _QKV.items()],
    *[(_ATTN + rf"{t}_proj\.bias", rf"blocks_\1.attn.{f}.bias", "(n h) -> n h") for t, f in _QKV.items()],
    (_LAYER + r"attention\.o_proj\.weight", r"blocks_\1.attn.out.kernel", "d (n h) -> n h d"),
    (_LAYER + r"attention\.o_proj\.bias", r"blocks_\1.attn.out.bias", None),
    *[(_LAYER + rf"{t}\.weight", rf"blocks_\1.{f}.scale", None) for t, f in _LN.items()],
    *[(_LAYER + rf"{t}\.bias", rf"blocks_\1.{f}.bias", None) for t, f in _LN.items()],
    (_LAYER + r"mlp\.(fc1|fc2)\.weight", r"blocks_\1.mlp.\2.kernel", "o i -> i o"),
    (_LAYER + r"mlp\.(fc1|fc2)\.bias", r"blocks_\1.mlp.\2.bias", None),
]
_LAYERS_4 = [
    *[(_ATTN4 + rf"attention\.{f}\.weight", rf"blocks_\1.attn.{f}.kernel", "(n h) d -> d n h") for f in _QKV.values()],
    *[(_ATTN4 + rf"attention\.{f}\.bias", rf"blocks_\1.attn.{f}.bias", "(n h) -> n h") for f in _QKV.values()],
    (_ATTN4 + r"output\.dense\.weight", r"blocks_\1.attn.out.kernel", "d (n h) -> n h d"),
    (_ATTN4 + r"output\.dense\.bias", r"blocks_\1.attn.out.bias", None),
    *[(_LAYER4 + rf"{t}\.weight", rf"blocks_\1.{f}.scale", None) for t, f in _LN.items()],
    *[(_LAYER4 + rf"{t}\.bias", rf"blocks_\1.{f}.bias", None) for t, f in _LN.items()],
    (_LAYER4 + r"intermediate\.dense\.weight", r"blocks_\1.mlp.fc1.kernel", "o i -> i o"),
    (_LAYER4 + r"intermediate\.dense\.bias", r"blocks_\1.mlp.fc1.bias", None),
    (_LAYER4 + r"output\.dense\.weight", r"blocks_\1.mlp.fc2.kernel", "o i -> i o"),
    (_LAYER4 + r"output\.dense\.bias", r"blocks_\1.mlp.fc2.bias", None),
]
KEY_MAP = KeyMap(
    [
        (r"vit\.embeddings\.cls_token", "cls", "1 1 d -> d"),
        (r"vit\.embeddings\.position_embeddings", "pos", "1 t d -> t d"),
        (r"vit\.embeddings\.patch_embeddings\.projection\.weight", "patch_embed.kernel", "o i kh kw -> kh kw i o"),
        (r"vit\.embeddings\.patch_embeddings\.projection\.bias", "patch_embed.bias", None),
        *(_LAYERS_4 if TRANSFORMERS_4 else _LAYERS_5),
        (r"vit\.layernorm\.weight", "norm.scale", None),
        (r"vit\.layernorm\.bias", "norm.bias", None),
        (r"classifier\.weight", "head.kernel", "o i -> i o"),
        (r"classifier\.bias", "head.bias", None),
    ]
)  # fmt: skip
