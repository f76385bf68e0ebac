"""The encoder-decoder's building blocks, each the twin of the :mod:`torch_ref.encoder_decoder` module of its name.

Attention, the feed-forward network, the pre-norm residual, the encoder and decoder layers
and stacks, the embeddings, the positional table and the generator; :class:`Transformer`
(in :mod:`flax_ln.models.encoder_decoder.model`) puts them together. Also the input checks
the modules and the Transformer share: :func:`check_hidden` and :func:`check_mask`, on
static shapes and dtypes only, so they also run while tracing under ``jax.jit``.

A module stores only what its own forward reads; the sizes and options a constructor
passes on to the submodules it builds live in those submodules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from flax_ln.models.attention import merge_heads, scaled_dot_product_attention, split_heads
from flax_ln.models.checks import check_token_ids
from flax_ln.models.dense import linear_dot_general
from flax_ln.models.dropout import Dropout
from flax_ln.models.layernorm import LayerNorm

MASK_VALUE = -1e9  # the book fills masked scores with -1e9: a fully masked row attends uniformly
ACTIVATIONS: dict[str | None, Callable[[jax.Array], jax.Array] | None] = {None: None, "relu": jax.nn.relu}

_xavier = nnx.initializers.xavier_uniform()


def _torch_bias_init(fan_in: int):
    """torch ``nn.Linear``'s bias init, uniform(±1/sqrt(fan_in)); the book re-initialises only >1-D parameters."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _linear(d_in: int, d_out: int, *, dtype, param_dtype, precision, rngs: nnx.Rngs) -> nnx.Linear:
    """``nnx.Linear`` initialised as the book's ``make_model``: Xavier-uniform kernel, torch's default bias;
    its product is :func:`~flax_ln.models.dense.linear_dot_general`."""
    return nnx.Linear(
        d_in,
        d_out,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        kernel_init=_xavier,
        bias_init=_torch_bias_init(d_in),
        dot_general=linear_dot_general,
        rngs=rngs,
    )


# ---- input validation: static shapes and dtypes only, so it also runs while tracing under jit ----


def _describe(x) -> str:
    return f"got shape {tuple(x.shape)} dtype {x.dtype}"


def check_hidden(name: str, x, shape: tuple[int | None, ...]) -> None:
    """Check that ``x`` is a floating array of rank ``len(shape)`` whose dims equal ``shape`` where it is not None.

    Raises a ``ValueError`` that names the argument ``name``, the expected and the given shape.
    """
    if (
        not jnp.issubdtype(x.dtype, jnp.floating)
        or x.ndim != len(shape)
        or any(s is not None and s != d for s, d in zip(shape, x.shape))
    ):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name}: expected a floating-point array of shape ({want}), {_describe(x)}.")


def check_mask(name: str, mask, batch: int, q_len: int, k_len: int) -> jax.Array:
    """``mask`` as bool, after checking it is a boolean (or 0/1 integer) mask of shape (batch or 1, q_len or 1, k_len).

    Raises a ``ValueError`` that names the argument ``name`` and says how the book's masks are made.
    """
    if (
        not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer))
        or mask.ndim != 3
        or mask.shape[0] not in (1, batch)
        or mask.shape[1] not in (1, q_len)
        or mask.shape[2] != k_len
    ):
        raise ValueError(
            f"{name}: expected a boolean mask of shape ({batch} or 1, {q_len} or 1, {k_len}), True where "
            f"attention is allowed, {_describe(mask)}. A padding mask is (src != pad)[:, None, :]; "
            "a target mask is make_std_mask(tgt, pad)."
        )
    return mask if mask.dtype == jnp.bool_ else mask != 0


# ---- modules ----


class Sequential(nnx.List):
    """torch's ``nn.Sequential``: applies its items in order; items are named ``0``, ``1``, ...

    Unlike ``nnx.Sequential``, which keeps its items under ``layers``, the items sit
    directly under the module's path, as in torch (``src_embed.0.lut.weight``).
    """

    def __call__(self, x):
        for module in self:
            x = module(x)
        return x


class Buffer(nnx.Variable):
    """A persistent, non-trainable array, like a buffer torch registers: saved, converted, never optimised."""


class MultiHeadedAttention(nnx.Module):
    """Multi-head attention: ``linears[3](concat_h softmax(mask(q_h k_hᵀ / sqrt(d_k), -1e9)) v_h)``.

    ``q, k, v = linears[0](query), linears[1](key), linears[2](value)``, split into ``h``
    heads of width ``d_k = d_model // h``. The mask, shape (B or 1, Tq or 1, Tk), is shared
    by every head; masked scores become -1e9 (the GPT uses -inf), so a row with no
    allowed key attends uniformly instead of giving NaN, as in torch. Dropout is applied
    to the attention probabilities. Unlike ``nnx.MultiHeadAttention`` there is one
    (d_model, d_model) kernel per projection and the mask is True = attend, False = fill.

    Args:
      h: number of heads; must divide ``d_model``.
      d_model: model width.
      dropout: dropout rate on the attention probabilities.
      dtype: compute dtype; ``None`` follows the inputs and parameters.
      param_dtype: parameter dtype.
      precision: matmul precision of the projections and the attention products.
      rngs: parameter initialisation and dropout keys.
    """

    def __init__(
        self,
        h: int,
        d_model: int,
        *,
        dropout: float = 0.1,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        if d_model % h:
            raise ValueError(f"d_model={d_model} must be divisible by the number of heads h={h}")
        self.h = h
        self.d_model = d_model
        self.precision = precision
        self.linears = nnx.List(
            [
                _linear(d_model, d_model, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
                for _ in range(4)
            ]
        )
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(
        self,
        query: Float[Array, "B Tq d_model"],
        key: Float[Array, "B Tk d_model"],
        value: Float[Array, "B Tk d_model"],
        mask: Bool[Array, "#B #Tq Tk"] | None = None,
    ) -> Float[Array, "B Tq d_model"]:
        check_hidden("query", query, (None, None, self.d_model))
        batch, q_len, _ = query.shape
        check_hidden("key", key, (batch, None, self.d_model))
        check_hidden("value", value, key.shape)
        if mask is not None:
            mask = check_mask("mask", mask, batch, q_len, key.shape[1])[:, None]  # (B, 1, Tq, Tk)
        q, k, v = (split_heads(lin(x), self.h) for lin, x in zip(self.linears, (query, key, value)))  # (B, h, T, d_k)
        x = scaled_dot_product_attention(
            q, k, v, mask, mask_value=MASK_VALUE, dropout=self.dropout, precision=self.precision
        )  # (B, h, Tq, d_k)
        return self.linears[3](merge_heads(x))  # (B, Tq, d_model)


class PositionwiseFeedForward(nnx.Module):
    """The book's feed-forward network ``w_2(dropout(w_1(x)))``, with no activation.

    The Annotated Transformer (and the original paper) puts a ReLU after ``w_1``:
    ``w_2(dropout(relu(w_1(x))))``; pass ``activation="relu"`` for that.

    Args:
      d_model: input and output width.
      d_ff: hidden width.
      dropout: dropout rate on the hidden layer.
      activation: ``None`` (the book) or ``"relu"`` (the Annotated Transformer).
      dtype: compute dtype; ``None`` follows the inputs and parameters.
      param_dtype: parameter dtype.
      precision: matmul precision.
      rngs: parameter initialisation and dropout keys.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        dropout: float = 0.1,
        activation: str | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.w_1 = _linear(d_model, d_ff, **kw)
        self.w_2 = _linear(d_ff, d_model, **kw)
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(self, x: Float[Array, "*B d_model"]) -> Float[Array, "*B d_model"]:
        h = self.w_1(x)
        activation = ACTIVATIONS[self.activation]
        if activation is not None:
            h = activation(h)
        return self.w_2(self.dropout(h))


class SublayerConnection(nnx.Module):
    """Pre-norm residual connection: ``x + dropout(sublayer(norm(x)))``.

    ``norm`` is the book's chapter-9 LayerNorm. The Annotated Transformer's version
    is the same shape of formula but with its ``(x - mean) / (std + eps)`` norm; the
    original paper is post-norm, ``norm(x + sublayer(x))``.

    Args:
      size: model width.
      dropout: dropout rate on the sublayer's output.
      dtype: output dtype of the norm; ``None`` follows the inputs and parameters.
      param_dtype: parameter dtype.
      rngs: dropout keys.
    """

    def __init__(self, size: int, *, dropout: float = 0.1, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.norm = LayerNorm(size, dtype=dtype, param_dtype=param_dtype)
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(
        self, x: Float[Array, "B T size"], sublayer: Callable[[jax.Array], jax.Array]
    ) -> Float[Array, "B T size"]:
        return x + self.dropout(sublayer(self.norm(x)))


class EncoderLayer(nnx.Module):
    """``x -> sublayer[1](sublayer[0](x, self_attn), feed_forward)``: self-attention, then feed-forward.

    Each sublayer is a pre-norm residual (:class:`SublayerConnection`). The torch twin
    takes the attention and feed-forward modules; this one builds them from sizes.

    Args:
      size: model width ``d_model``.
      h: attention heads.
      d_ff: feed-forward hidden width.
      dropout: dropout rate everywhere in the layer.
      ffn_activation: ``None`` (the book) or ``"relu"``.
      dtype, param_dtype, precision: as :class:`MultiHeadedAttention`.
      rngs: parameter initialisation and dropout keys.
    """

    def __init__(
        self,
        size: int,
        h: int,
        d_ff: int,
        *,
        dropout: float = 0.1,
        ffn_activation: str | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        kw = dict(dropout=dropout, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.self_attn = MultiHeadedAttention(h, size, precision=precision, **kw)
        self.feed_forward = PositionwiseFeedForward(size, d_ff, activation=ffn_activation, precision=precision, **kw)
        self.sublayer = nnx.List([SublayerConnection(size, **kw) for _ in range(2)])

    def __call__(self, x: Float[Array, "B S size"], mask: Bool[Array, "#B #S S"]) -> Float[Array, "B S size"]:
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, mask))
        return self.sublayer[1](x, self.feed_forward)


class DecoderLayer(nnx.Module):
    """Self-attention (causal ``tgt_mask``), attention over the encoder ``memory``, then feed-forward.

    ``sublayer[0]`` wraps ``self_attn``, ``sublayer[1]`` wraps ``src_attn`` (queries from
    the decoder, keys and values from ``memory``, ``src_mask``), ``sublayer[2]`` wraps
    ``feed_forward``; each is a pre-norm residual.

    Args:
      size: model width ``d_model``.
      h: attention heads.
      d_ff: feed-forward hidden width.
      dropout: dropout rate everywhere in the layer.
      ffn_activation: ``None`` (the book) or ``"relu"``.
      dtype, param_dtype, precision: as :class:`MultiHeadedAttention`.
      rngs: parameter initialisation and dropout keys.
    """

    def __init__(
        self,
        size: int,
        h: int,
        d_ff: int,
        *,
        dropout: float = 0.1,
        ffn_activation: str | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        kw = dict(dropout=dropout, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.self_attn = MultiHeadedAttention(h, size, precision=precision, **kw)
        self.src_attn = MultiHeadedAttention(h, size, precision=precision, **kw)
        self.feed_forward = PositionwiseFeedForward(size, d_ff, activation=ffn_activation, precision=precision, **kw)
        self.sublayer = nnx.List([SublayerConnection(size, **kw) for _ in range(3)])

    def __call__(
        self,
        x: Float[Array, "B T size"],
        memory: Float[Array, "B S size"],
        src_mask: Bool[Array, "#B #T S"],
        tgt_mask: Bool[Array, "#B #T T"],
    ) -> Float[Array, "B T size"]:
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, tgt_mask))
        x = self.sublayer[1](x, lambda y: self.src_attn(y, memory, memory, src_mask))
        return self.sublayer[2](x, self.feed_forward)


class _Stack(nnx.Module):
    """N layers of type ``layer_cls`` in ``layers``, then a final LayerNorm ``norm``; shared by Encoder and Decoder."""

    layer_cls: type[EncoderLayer] | type[DecoderLayer]

    def __init__(
        self,
        size: int,
        h: int,
        d_ff: int,
        N: int,
        *,
        dropout: float = 0.1,
        ffn_activation: str | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        rngs: nnx.Rngs,
    ):
        # Any: each subclass calls its own layer type's signature
        self.layers: nnx.List[Any] = nnx.List(
            [
                self.layer_cls(
                    size,
                    h,
                    d_ff,
                    dropout=dropout,
                    ffn_activation=ffn_activation,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    precision=precision,
                    rngs=rngs,
                )
                for _ in range(N)
            ]
        )
        self.norm = LayerNorm(size, dtype=dtype, param_dtype=param_dtype)

    @property
    def size(self) -> int:
        """The model width ``d_model`` (the final norm's features), read by the Transformer's checks."""
        return self.norm.features


class Encoder(_Stack):
    """``norm(layers[N-1](... layers[0](x, mask) ..., mask))``: N :class:`EncoderLayer` then a final LayerNorm.

    The book deep-copies one layer N times and then re-initialises every weight, so the
    layers start different; here each layer is built with its own keys.

    Args:
      size, h, d_ff: as :class:`EncoderLayer`.
      N: number of layers.
      dropout, ffn_activation, dtype, param_dtype, precision, rngs: as :class:`EncoderLayer`.
    """

    layer_cls = EncoderLayer

    def __call__(self, x: Float[Array, "B S size"], mask: Bool[Array, "#B #S S"]) -> Float[Array, "B S size"]:
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class Decoder(_Stack):
    """N :class:`DecoderLayer` over the target, each attending to ``memory``, then a final LayerNorm.

    Args:
      size, h, d_ff: as :class:`DecoderLayer`.
      N: number of layers.
      dropout, ffn_activation, dtype, param_dtype, precision, rngs: as :class:`DecoderLayer`.
    """

    layer_cls = DecoderLayer

    def __call__(
        self,
        x: Float[Array, "B T size"],
        memory: Float[Array, "B S size"],
        src_mask: Bool[Array, "#B #T S"],
        tgt_mask: Bool[Array, "#B #T T"],
    ) -> Float[Array, "B T size"]:
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class Embeddings(nnx.Module):
    """Token embedding scaled by the square root of the width: ``lut(x) * sqrt(d_model)``.

    ``lut`` is an ``nnx.Embed`` (torch ``nn.Embedding``; its ``embedding`` is torch's
    ``weight``, same layout), Xavier-uniform initialised as in the book's ``make_model``.

    Args:
      d_model: embedding width.
      vocab: vocabulary size.
      dtype: compute dtype of the looked-up vectors.
      param_dtype: parameter dtype.
      rngs: parameter initialisation key.
    """

    def __init__(self, d_model: int, vocab: int, *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.d_model = d_model
        self.lut = nnx.Embed(vocab, d_model, dtype=dtype, param_dtype=param_dtype, embedding_init=_xavier, rngs=rngs)

    @property
    def vocab(self) -> int:
        """The vocabulary size (the table's rows), read by the Transformer's token-id checks."""
        return self.lut.num_embeddings

    def __call__(self, x: Int[Array, "B T"]) -> Float[Array, "B T d_model"]:
        check_token_ids(x, "x", owner="Embeddings", vocab=None)  # static only; the Transformer checks values
        return self.lut(x) * math.sqrt(self.d_model)


def sinusoid_table(d_model: int, max_len: int = 5000) -> np.ndarray:
    """The (1, max_len, d_model) float32 sinusoid table: ``pe[p, 2i] = sin(p w_i)``, ``pe[p, 2i+1] = cos(p w_i)``.

    ``w_i = 10000^(-2i / d_model)``, computed in float32 as the book does. Its last bits
    depend on the exp/sin/cos implementation (torch's differ by up to 5e-4 at position
    5000), which is why a table loaded from torch replaces it rather than being checked.
    """
    position = np.arange(max_len, dtype=np.float32)[:, None]  # (max_len, 1)
    div_term = np.exp(np.arange(0, d_model, 2, dtype=np.float32) * np.float32(-math.log(10000.0) / d_model))
    pe = np.zeros((max_len, d_model), np.float32)
    pe[:, 0::2] = np.sin(position * div_term)
    pe[:, 1::2] = np.cos(position * div_term[: d_model // 2])
    return pe[None]  # (1, max_len, d_model)


class PositionalEncoding(nnx.Module):
    """Adds the sinusoidal table, then dropout: ``dropout(x + pe[:, :T])``.

    ``pe`` (1, max_len, d_model) is a :class:`Buffer` (torch's persistent buffer of the
    same name), stored rather than recomputed so that a table written by torch loads and
    round-trips bit for bit whatever its sin/cos implementation. It is not a parameter:
    the optimiser never sees it. It is cast to the dtype of ``x`` before the addition.

    Args:
      d_model: width.
      dropout: dropout rate after the addition.
      max_len: longest sequence the table covers, 5000 as in the book.
      param_dtype: storage dtype of ``pe``.
      rngs: dropout keys.
    """

    def __init__(
        self, d_model: int, *, dropout: float = 0.1, max_len: int = 5000, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.d_model = d_model
        self.max_len = max_len
        self.pe = Buffer(jnp.asarray(sinusoid_table(d_model, max_len), param_dtype))
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(self, x: Float[Array, "B T d_model"]) -> Float[Array, "B T d_model"]:
        check_hidden("x", x, (None, None, self.d_model))
        if x.shape[1] > self.max_len:
            raise ValueError(
                f"x: expected at most max_len={self.max_len} positions, {_describe(x)}. "
                "Build PositionalEncoding with a larger max_len."
            )
        return self.dropout(x + self.pe[...][:, : x.shape[1]].astype(x.dtype))


class Generator(nnx.Module):
    """Log-probabilities over the vocabulary: ``log_softmax(proj(x))``.

    The log-softmax runs in at least float32 and the result stays in that dtype, since
    it feeds the loss.

    Args:
      d_model: input width.
      vocab: vocabulary size.
      dtype: compute dtype of ``proj``.
      param_dtype: parameter dtype.
      precision: matmul precision.
      rngs: parameter initialisation key.
    """

    def __init__(
        self, d_model: int, vocab: int, *, dtype=None, param_dtype=jnp.float32, precision=None, rngs: nnx.Rngs
    ):
        self.proj = _linear(d_model, vocab, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

    def __call__(self, x: Float[Array, "*B d_model"]) -> Float[Array, "*B vocab"]:
        logits = self.proj(x)
        return jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
