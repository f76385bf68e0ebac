"""The book's chapter-9/10 encoder-decoder Transformer in PyTorch, the reference that flax_ln mirrors.

Module tree and ``state_dict`` keys are the book's (``encoder.layers.0.sublayer.1.norm.a_2``,
``src_embed.0.lut.weight``, ``src_embed.1.pe``, ``generator.proj.weight``, ...), so a
checkpoint of the book's model loads here with ``strict=True``. Also the book's
chapter-10 training pieces: :class:`LabelSmoothing` and :func:`noam_rate`.

:class:`EncoderDecoderConfig` is this package's own plain-data config (``flax_ln`` reads it,
field by field, with its ``EncoderDecoderConfig.from_any``); nothing here imports the port.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from typing import Any

import torch
from torch import nn

from torch_ref.config import config_fields
from torch_ref.layernorm import LayerNorm

MASK_VALUE = -1e9  # the book fills masked attention scores with -1e9, not -inf
ACTIVATIONS = (None, "relu")  # the feed-forward activations: none (the book) or ReLU (the Annotated Transformer)
_SIZES = ("src_vocab", "tgt_vocab", "N", "d_model", "d_ff", "h", "max_len")
_REQUIRED_FIELDS = ("src_vocab", "tgt_vocab")


@dataclasses.dataclass(frozen=True)
class EncoderDecoderConfig:
    """Sizes and options of the book's encoder-decoder, torch- and JAX-free plain data.

    The fields are ``make_model``'s arguments plus ``max_len``, the positional table's
    length; :meth:`Transformer.from_config` builds the model. The reference defines its own
    config so that it never imports the port; ``flax_ln.EncoderDecoderConfig`` has the same fields.

    Args:
      src_vocab, tgt_vocab: vocabulary sizes.
      N: layers in the encoder and in the decoder.
      d_model: model width.
      d_ff: feed-forward hidden width.
      h: attention heads; must divide ``d_model``.
      dropout: dropout rate everywhere, in ``[0, 1)``.
      ffn_activation: ``None`` (the book) or ``"relu"`` (the Annotated Transformer).
      max_len: longest sequence the positional tables cover, 5000 as in the book.
    """

    src_vocab: int
    tgt_vocab: int
    N: int = 6
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8
    dropout: float = 0.1
    ffn_activation: str | None = None
    max_len: int = 5000

    def __post_init__(self):
        for name in _SIZES:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EncoderDecoderConfig: {name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.d_model % self.h:
            raise ValueError(f"EncoderDecoderConfig: d_model={self.d_model} is not divisible by h={self.h}")
        dropout = self.dropout
        if not isinstance(dropout, numbers.Real) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"EncoderDecoderConfig: dropout must be a float in [0, 1), got {dropout!r}")
        if self.ffn_activation not in ACTIVATIONS:
            raise ValueError(
                f"EncoderDecoderConfig: ffn_activation must be one of {list(ACTIVATIONS)}, got {self.ffn_activation!r}"
            )

    @classmethod
    def from_any(cls, config: Any) -> EncoderDecoderConfig:
        """``config`` as an :class:`EncoderDecoderConfig`: itself, or read field by field from attributes or keys.

        The two vocabularies are required; the other fields take this class's defaults when absent.
        """
        if isinstance(config, cls):
            return config
        values = config_fields(cls, config)
        missing = [name for name in _REQUIRED_FIELDS if name not in values]
        if missing:
            raise TypeError(
                f"encoder-decoder config {type(config).__name__} lacks {missing}: expected an object or mapping "
                f"with make_model's fields (e.g. torch_ref.EncoderDecoderConfig or flax_ln.EncoderDecoderConfig)"
            )
        return cls(**values)


def _clones(module: nn.Module, n: int) -> nn.ModuleList:
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


def attention(query, key, value, mask=None, dropout: nn.Module | None = None):
    """``softmax(masked_fill(q kᵀ / sqrt(d_k), mask == 0, -1e9)) v``; returns (output, probabilities)."""
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))  # (B, h, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, MASK_VALUE)
    probs = scores.softmax(dim=-1)
    if dropout is not None:
        probs = dropout(probs)
    return probs @ value, probs


class MultiHeadedAttention(nn.Module):
    """``h`` heads of width ``d_model // h``; ``linears`` are q, k, v and the output projection."""

    def __init__(self, h: int, d_model: int, dropout: float = 0.1):
        super().__init__()
        assert d_model % h == 0, f"d_model={d_model} is not divisible by h={h}"
        self.d_k = d_model // h
        self.h = h
        self.linears = _clones(nn.Linear(d_model, d_model), 4)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # (B, 1, Tq|1, Tk): the same mask for every head
        batch = query.size(0)
        query, key, value = [
            lin(x).view(batch, -1, self.h, self.d_k).transpose(1, 2)  # (B, h, T, d_k)
            for lin, x in zip(self.linears, (query, key, value))
        ]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(batch, -1, self.h * self.d_k)  # (B, T, d_model)
        return self.linears[-1](x)


class PositionwiseFeedForward(nn.Module):
    """The book's ``w_2(dropout(w_1(x)))``, no activation; ``activation="relu"`` gives the Annotated Transformer's."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1, activation: str | None = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be None (the book) or 'relu', got {activation!r}")
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = activation

    def forward(self, x):
        h = self.w_1(x)
        if self.activation == "relu":
            h = h.relu()
        return self.w_2(self.dropout(h))


class SublayerConnection(nn.Module):
    """Pre-norm residual: ``x + dropout(sublayer(norm(x)))``."""

    def __init__(self, size: int, dropout: float):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class EncoderLayer(nn.Module):
    """Self-attention (``sublayer[0]``) then feed-forward (``sublayer[1]``)."""

    def __init__(self, size: int, self_attn: nn.Module, feed_forward: nn.Module, dropout: float):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = _clones(SublayerConnection(size, dropout), 2)
        self.size = size

    def forward(self, x, mask):
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, mask))
        return self.sublayer[1](x, self.feed_forward)


class Encoder(nn.Module):
    """``N`` copies of ``layer`` then a final ``norm``."""

    def __init__(self, layer: EncoderLayer, N: int):
        super().__init__()
        self.layers = _clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class DecoderLayer(nn.Module):
    """Self-attention, source attention over ``memory``, then feed-forward (``sublayer[0..2]``)."""

    def __init__(self, size: int, self_attn: nn.Module, src_attn: nn.Module, feed_forward: nn.Module, dropout: float):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = _clones(SublayerConnection(size, dropout), 3)

    def forward(self, x, memory, src_mask, tgt_mask):
        x = self.sublayer[0](x, lambda y: self.self_attn(y, y, y, tgt_mask))
        x = self.sublayer[1](x, lambda y: self.src_attn(y, memory, memory, src_mask))
        return self.sublayer[2](x, self.feed_forward)


class Decoder(nn.Module):
    """``N`` copies of ``layer`` then a final ``norm``."""

    def __init__(self, layer: DecoderLayer, N: int):
        super().__init__()
        self.layers = _clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, memory, src_mask, tgt_mask):
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class Embeddings(nn.Module):
    """``lut(x) * sqrt(d_model)``."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        return self.lut(x) * math.sqrt(self.d_model)


def sinusoid_table(d_model: int, max_len: int = 5000) -> torch.Tensor:
    """The (1, max_len, d_model) table: sin on even features, cos on odd, wavelengths up to 10000·2π."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)  # (max_len, 1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe.unsqueeze(0)  # (1, max_len, d_model)


class PositionalEncoding(nn.Module):
    """``dropout(x + pe[:, :T])`` with the persistent buffer ``pe`` of shape (1, max_len, d_model)."""

    pe: torch.Tensor  # the sinusoid table buffer

    def __init__(self, d_model: int, dropout: float, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.register_buffer("pe", sinusoid_table(d_model, max_len))

    def forward(self, x):
        return self.dropout(x + self.pe[:, : x.size(1)])


class Generator(nn.Module):
    """``log_softmax(proj(x))`` over the vocabulary."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        return torch.log_softmax(self.proj(x), dim=-1)


class Transformer(nn.Module):
    """The encoder-decoder: ``forward`` returns the decoder output; ``generator`` maps it to log-probabilities."""

    def __init__(
        self, encoder: Encoder, decoder: Decoder, src_embed: nn.Module, tgt_embed: nn.Module, generator: Generator
    ):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator

    @classmethod
    def from_config(cls, config: Any) -> Transformer:
        """The book's model of ``config``'s sizes (anything :meth:`EncoderDecoderConfig.from_any` reads).

        Every parameter with more than one dimension is re-initialised Xavier-uniform, as in the book.
        """
        c = EncoderDecoderConfig.from_any(config)
        attn = MultiHeadedAttention(c.h, c.d_model, c.dropout)
        ff = PositionwiseFeedForward(c.d_model, c.d_ff, c.dropout, c.ffn_activation)
        position = PositionalEncoding(c.d_model, c.dropout, c.max_len)
        model = cls(
            Encoder(EncoderLayer(c.d_model, copy.deepcopy(attn), copy.deepcopy(ff), c.dropout), c.N),
            Decoder(
                DecoderLayer(c.d_model, copy.deepcopy(attn), copy.deepcopy(attn), copy.deepcopy(ff), c.dropout), c.N
            ),
            nn.Sequential(Embeddings(c.d_model, c.src_vocab), copy.deepcopy(position)),
            nn.Sequential(Embeddings(c.d_model, c.tgt_vocab), copy.deepcopy(position)),
            Generator(c.d_model, c.tgt_vocab),
        )
        for p in model.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        return model

    def encode(self, src, src_mask):
        return self.encoder(self.src_embed(src), src_mask)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)

    def forward(self, src, tgt, src_mask, tgt_mask):
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)


def make_model(
    src_vocab: int,
    tgt_vocab: int,
    N: int = 6,
    d_model: int = 512,
    d_ff: int = 2048,
    h: int = 8,
    dropout: float = 0.1,
    ffn_activation: str | None = None,
) -> Transformer:
    """The book's model: :meth:`Transformer.from_config` of :class:`EncoderDecoderConfig` with these fields."""
    return Transformer.from_config(
        EncoderDecoderConfig(src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout, ffn_activation)
    )


def subsequent_mask(size: int) -> torch.Tensor:
    """(1, size, size) boolean mask, True on and below the diagonal: position i may attend to j <= i."""
    return torch.tril(torch.ones(1, size, size, dtype=torch.bool))


def make_std_mask(tgt: torch.Tensor, pad: int) -> torch.Tensor:
    """The target mask: not padding AND causal, shape (B, T, T)."""
    return (tgt != pad).unsqueeze(-2) & subsequent_mask(tgt.size(-1)).to(tgt.device)  # (B, 1, T) & (1, T, T)


class LabelSmoothing(nn.Module):
    """Chapter 10's loss: ``KLDivLoss(reduction="sum")`` against a smoothed target distribution.

    The target class gets ``1 - smoothing``, every other class ``smoothing / (size - 2)``,
    the padding class 0, and rows whose target is padding are all 0 (they add no loss).
    ``x`` are log-probabilities of shape (N, size), ``target`` class ids of shape (N,).
    """

    def __init__(self, size: int, padding_idx: int, smoothing: float = 0.1):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.size = size
        self.padding_idx = padding_idx
        self.smoothing = smoothing
        self.confidence = 1.0 - smoothing
        self.true_dist: torch.Tensor | None = None

    def forward(self, x, target):
        assert x.size(1) == self.size, f"expected {self.size} classes, got {x.size(1)}"
        dist = torch.full_like(x.detach(), self.smoothing / (self.size - 2))
        dist.scatter_(1, target.unsqueeze(1), self.confidence)
        dist[:, self.padding_idx] = 0
        dist[target == self.padding_idx] = 0
        self.true_dist = dist
        return self.criterion(x, dist)


def noam_rate(step: int, model_size: int, factor: float = 1.0, warmup: int = 2000) -> float:
    """The Noam learning rate ``factor * model_size^-0.5 * min(step^-0.5, step * warmup^-1.5)``; steps count from 1."""
    return factor * model_size ** (-0.5) * min(step ** (-0.5), step * warmup ** (-1.5))
