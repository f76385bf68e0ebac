"""A Llama-family decoder (``transformers.LlamaForCausalLM``) in NNX, with its own names and its key map.

Math, per block: ``x += attn(rms(x))``, ``x += ffn(rms(x))``, then a final RMSNorm and
the head. Attention is grouped-query (``kv_heads`` key/value heads, each serving
``heads // kv_heads`` query heads) with rotary position embeddings (the halves
rotation of the original Llama code) and a causal mask; the feed-forward is SwiGLU,
``wo(silu(x @ wi[0]) * (x @ wi[1]))``. RMSNorm is ``scale * (x / sqrt(mean(x^2) + eps))``,
its statistics in at least float32, the normalised value cast back before the scale
(as transformers does).

Unlike transformers' module tree: q/k/v/o are fused 3-D kernels (``(d, heads,
head_dim)`` and ``(heads, head_dim, d)``), gate and up projections are one stacked
``(2, d, ffn)`` kernel, and the head is a wrapper module around one ``nnx.Linear`` that
keeps its own copy of the tied embedding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flax_ln.convert import KeyMap


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a Llama-family decoder."""

    vocab: int
    width: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_base: float = 10000.0
    eps: float = 1e-6


def config_from_hf(hf: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``transformers.LlamaConfig`` (default RoPE, no biases)."""
    return LlamaConfig(
        vocab=hf.vocab_size,
        width=hf.hidden_size,
        layers=hf.num_hidden_layers,
        heads=hf.num_attention_heads,
        kv_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        ffn=hf.intermediate_size,
        # transformers 5 keeps the theta in rope_parameters, 4.x in rope_theta
        rope_base=float((getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta})["rope_theta"]),
        eps=hf.rms_norm_eps,
    )


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(nnx.initializers.lecun_normal(in_axis=0, out_axis=-1)(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
    """``scale * (x / sqrt(mean(x^2) + eps))``; statistics in at least float32, cast back before the scale."""

    def __init__(self, width: int, eps: float, *, param_dtype=jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((width,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        normed = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """``x`` (B, T, n, h) rotated by RoPE angles ``pos / base^(2i/h)``, in halves: ``(x1 c - x2 s, x2 c + x1 s)``."""
    h = x.shape[-1]
    inv_freq = 1.0 / (base ** (jnp.arange(0, h, 2, dtype=x.dtype) / h))  # (h/2,)
    angles = positions.astype(x.dtype)[:, None] * inv_freq  # (T, h/2)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # (T, 1, h)
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return x * jnp.cos(angles) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(angles)


class Attention(nnx.Module):
    """Causal grouped-query attention with RoPE; kernels ``q (d, n, h)``, ``k``, ``v (d, kv, h)``, ``o (n, h, d)``."""

    def __init__(self, c: LlamaConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.c = c
        self.q = _param(rngs, (c.width, c.heads, c.head_dim), param_dtype)
        self.k = _param(rngs, (c.width, c.kv_heads, c.head_dim), param_dtype)
        self.v = _param(rngs, (c.width, c.kv_heads, c.head_dim), param_dtype)
        self.o = _param(rngs, (c.heads, c.head_dim, c.width), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.c
        t = x.shape[1]
        positions = jnp.arange(t)
        q = rotary(jnp.einsum("btd,dnh->btnh", x, self.q[...]), positions, c.rope_base)  # (B, T, n, h)
        k = rotary(jnp.einsum("btd,dkh->btkh", x, self.k[...]), positions, c.rope_base)  # (B, T, kv, h)
        v = jnp.einsum("btd,dkh->btkh", x, self.v[...])  # (B, T, kv, h)
        group = c.heads // c.kv_heads  # query head i reads key/value head i // group
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # (B, T, n, h)
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k) * c.head_dim**-0.5  # (B, n, T, T)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return jnp.einsum("bnqk,bknh,nhd->bqd", weights, v, self.o[...])  # (B, T, d)


class SwiGLU(nnx.Module):
    """``wo(silu(x @ wi[0]) * (x @ wi[1]))``; ``wi`` stacks the gate and up kernels, (2, d, ffn)."""

    def __init__(self, c: LlamaConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.wi = _param(rngs, (2, c.width, c.ffn), param_dtype)
        self.wo = _param(rngs, (c.ffn, c.width), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.einsum("btd,gdf->gbtf", x, self.wi[...])  # (2, B, T, ffn)
        return (jax.nn.silu(gate) * up) @ self.wo[...]


class Block(nnx.Module):
    """Pre-norm decoder block: ``x + attn(norm1(x))``, then ``+ ffn(norm2(.))``."""

    def __init__(self, c: LlamaConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(c.width, c.eps, param_dtype=param_dtype)
        self.attn = Attention(c, param_dtype=param_dtype, rngs=rngs)
        self.norm2 = RMSNorm(c.width, c.eps, param_dtype=param_dtype)
        self.ffn = SwiGLU(c, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class LMHead(nnx.Module):
    """A wrapper around its one child, the vocabulary projection: the same parameters, one level up."""

    def __init__(self, c: LlamaConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.proj = nnx.Linear(c.width, c.vocab, use_bias=False, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(x)


class Llama(nnx.Module):
    """Token ids (B, T) -> logits (B, T, vocab). The tied embedding is two variables: ``tok`` and ``head``."""

    def __init__(self, c: LlamaConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.c = c
        self.tok = nnx.Embed(c.vocab, c.width, param_dtype=param_dtype, rngs=rngs)
        self.blocks = nnx.List([Block(c, param_dtype=param_dtype, rngs=rngs) for _ in range(c.layers)])
        self.final_norm = RMSNorm(c.width, c.eps, param_dtype=param_dtype)
        self.head = LMHead(c, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.tok(ids)  # (B, T, d)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))  # (B, T, vocab)


_LAYER = r"model\.layers\.(\d+)\."
KEY_MAP = KeyMap(
    [
        (r"model\.embed_tokens\.weight", "tok.embedding", None),
        (r"lm_head\.weight", "head.proj.kernel", "v d -> d v"),  # one Parameter with embed_tokens in torch
        (_LAYER + r"self_attn\.(q|k|v)_proj\.weight", r"blocks.\1.attn.\2", "(n h) d -> d n h"),
        (_LAYER + r"self_attn\.o_proj\.weight", r"blocks.\1.attn.o", "d (n h) -> n h d"),
        (_LAYER + r"mlp\.gate_proj\.weight", r"blocks.\1.ffn.wi[0]", "f d -> d f"),
        (_LAYER + r"mlp\.up_proj\.weight", r"blocks.\1.ffn.wi[1]", "f d -> d f"),
        (_LAYER + r"mlp\.down_proj\.weight", r"blocks.\1.ffn.wo", "d f -> f d"),
        (_LAYER + r"input_layernorm\.weight", r"blocks.\1.norm1.scale", None),
        (_LAYER + r"post_attention_layernorm\.weight", r"blocks.\1.norm2.scale", None),
        (r"model\.norm\.weight", "final_norm.scale", None),
    ]
)


def _torch_extras(model, ids, *, dtype):
    """What transformers' ``LlamaModel.forward`` computes once and gives every layer: positions, the causal
    mask and the rotary tables, made as it makes them (for the hidden states' dtype)."""
    import torch
    from transformers.masking_utils import create_causal_mask

    batch, length = ids.shape
    like = torch.zeros(batch, length, model.config.hidden_size, dtype=dtype)  # (B, T, d): dtype and shape only
    positions = torch.arange(length).unsqueeze(0)  # (1, T)
    mask = create_causal_mask(
        config=model.config, inputs_embeds=like, attention_mask=None, cache=None, position_ids=positions
    )
    return {"mask": mask, "positions": positions, "rotary": model.model.rotary_emb(like, position_ids=positions)}


def _torch_layer(modules, x, extras):
    return modules[0](
        x, attention_mask=extras["mask"], position_ids=extras["positions"], position_embeddings=extras["rotary"]
    )


def _torch_head(modules, x, extras):
    norm, head = modules
    return head(norm(x))


def _port_head(modules, x, extras):
    norm, head = modules
    return head(norm(x))


def stages(config: LlamaConfig):
    """This port against ``transformers.LlamaForCausalLM`` as a chain of stages, for
    ``flax_ln.parity.compare_streamed``: the embedding, each decoder layer, the final norm with the head. The
    port computes its rotary tables and mask inside each block; transformers' layers take them as arguments."""
    from flax_ln.parity import Stage, Stages

    return Stages(
        [
            Stage(
                "embedding", ("model.embed_tokens",), ("tok",), lambda m, x, e: m[0](x[0]), lambda m, x, e: m[0](x[0])
            ),
            Stage(
                "layer {i}",
                ("model.layers.{i}",),
                ("blocks.{i}",),
                _torch_layer,
                lambda m, x, e: m[0](x),
                layers=config.layers,
            ),
            Stage("head", ("model.norm", "lm_head"), ("final_norm", "head"), _torch_head, _port_head),
        ],
        torch_extras=_torch_extras,
    )
