"""The encoder-decoder :class:`Transformer` and the book's ``make_model``, built from an :class:`EncoderDecoderConfig`.

The :class:`Transformer` holds the modules of :mod:`flax_ln.models.encoder_decoder.layers`
under the attribute names of its torch twin; :meth:`Transformer.from_config` builds them
from a config, as the book's ``make_model`` does from its arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from flax_ln.models.checks import check_token_ids
from flax_ln.models.encoder_decoder.config import EncoderDecoderConfig
from flax_ln.models.encoder_decoder.layers import (
    Decoder,
    Embeddings,
    Encoder,
    Generator,
    PositionalEncoding,
    Sequential,
    check_hidden,
    check_mask,
)


class Transformer(nnx.Module):
    """The encoder-decoder: ``decode(encode(src, src_mask), src_mask, tgt, tgt_mask)``.

    ``src_embed`` and ``tgt_embed`` are ``Sequential(Embeddings, PositionalEncoding)``.
    Calling the model returns the decoder output (B, T, d_model), as the book's;
    ``model.generator`` maps it to log-probabilities. ``model.eval()`` / ``model.train()``
    switch every dropout off / on, like torch. Build one with :meth:`from_config` (or the
    book's :func:`make_model`); the constructor takes the modules, as torch's does.

    ``src`` ids must lie in ``[0, src_vocab)`` and ``tgt`` ids in ``[0, tgt_vocab)``. Each entry
    point checks every argument once, before any compute; concrete ids are checked by value
    (``ValueError``), traced ones (under ``jit``) only with ``debug_checks=True``, through
    ``checkify``; otherwise a negative id wraps around and an id >= vocab gives NaN
    (:mod:`flax_ln.models.checks`).

    Args:
      encoder: an :class:`Encoder`.
      decoder: a :class:`Decoder`.
      src_embed: source embedding, ``Sequential(Embeddings, PositionalEncoding)``.
      tgt_embed: target embedding, the same.
      generator: a :class:`Generator`.
      debug_checks: also check the values of traced token ids, with ``jax.experimental.checkify``
        (wrap the jitted function in ``checkify.checkify``).
    """

    def __init__(
        self,
        encoder: Encoder,
        decoder: Decoder,
        src_embed: Sequential,
        tgt_embed: Sequential,
        generator: Generator,
        *,
        debug_checks: bool = False,
    ):
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator
        self.debug_checks = debug_checks

    @classmethod
    def from_config(
        cls,
        config: EncoderDecoderConfig,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        debug_checks: bool = False,
        rngs: nnx.Rngs,
    ) -> Transformer:
        """The book's encoder-decoder of ``config``'s sizes, the twin of ``torch_ref.Transformer.from_config``.

        Every parameter with more than one dimension is Xavier-uniform initialised, as in the
        book; biases keep torch's default uniform(±1/sqrt(fan_in)), the norms ones and zeros.

        Args:
          config: an :class:`~flax_ln.EncoderDecoderConfig`, or anything its ``from_any`` reads
            (``torch_ref.EncoderDecoderConfig``, a mapping of its fields).
          dtype: compute dtype; ``None`` follows the parameters.
          param_dtype: parameter dtype.
          precision: matmul precision.
          debug_checks: also check traced token ids (see :class:`Transformer`).
          rngs: parameter initialisation and dropout keys.
        """
        c = EncoderDecoderConfig.from_any(config)
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        layer_kw = dict(dropout=c.dropout, ffn_activation=c.ffn_activation, **kw)

        def embed(vocab: int) -> Sequential:
            return Sequential(
                [
                    Embeddings(c.d_model, vocab, dtype=dtype, param_dtype=param_dtype, rngs=rngs),
                    PositionalEncoding(
                        c.d_model, dropout=c.dropout, max_len=c.max_len, param_dtype=param_dtype, rngs=rngs
                    ),
                ]
            )

        return cls(
            Encoder(c.d_model, c.h, c.d_ff, c.N, **layer_kw),
            Decoder(c.d_model, c.h, c.d_ff, c.N, **layer_kw),
            embed(c.src_vocab),
            embed(c.tgt_vocab),
            Generator(c.d_model, c.tgt_vocab, **kw),
            debug_checks=debug_checks,
        )

    def _check_encode(self, src, src_mask, owner: str) -> jax.Array:
        """``src`` as a JAX array, after checking it (shape, dtype, ids in ``[0, src_vocab)``) and ``src_mask``."""
        src = check_token_ids(
            src,
            "src",
            owner=owner,
            vocab=self.src_embed[0].vocab,
            max_len=self.src_embed[1].max_len,
            debug=self.debug_checks,
        )
        batch, src_len = src.shape
        check_mask("src_mask", src_mask, batch, src_len, src_len)
        return src

    def _check_decode(self, memory_shape: tuple[int, ...], src_mask, tgt, tgt_mask, owner: str) -> jax.Array:
        """``tgt`` as a JAX array, after checking it against the memory's shape, and both masks."""
        batch, src_len, _ = memory_shape
        tgt = check_token_ids(
            tgt,
            "tgt",
            owner=owner,
            vocab=self.tgt_embed[0].vocab,
            max_len=self.tgt_embed[1].max_len,
            batch=batch,
            debug=self.debug_checks,
        )
        tgt_len = tgt.shape[1]
        check_mask("src_mask", src_mask, batch, tgt_len, src_len)
        check_mask("tgt_mask", tgt_mask, batch, tgt_len, tgt_len)
        return tgt

    def encode(self, src: Int[Array, "B S"], src_mask: Bool[Array, "#B #S S"]) -> Float[Array, "B S d_model"]:
        return self._encode(self._check_encode(src, src_mask, "Transformer.encode"), src_mask)

    def _encode(self, src, src_mask):
        return self.encoder(self.src_embed(src), src_mask)

    def decode(
        self,
        memory: Float[Array, "B S d_model"],
        src_mask: Bool[Array, "#B #T S"],
        tgt: Int[Array, "B T"],
        tgt_mask: Bool[Array, "#B #T T"],
    ) -> Float[Array, "B T d_model"]:
        check_hidden("memory", memory, (None, None, self.decoder.size))
        tgt = self._check_decode(memory.shape, src_mask, tgt, tgt_mask, "Transformer.decode")
        return self._decode(memory, src_mask, tgt, tgt_mask)

    def _decode(self, memory, src_mask, tgt, tgt_mask):
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)

    def __call__(
        self,
        src: Int[Array, "B S"],
        tgt: Int[Array, "B T"],
        src_mask: Bool[Array, "#B 1 S"],
        tgt_mask: Bool[Array, "#B #T T"],
    ) -> Float[Array, "B T d_model"]:
        src = self._check_encode(src, src_mask, "Transformer")  # every argument checked once, before any compute
        tgt = self._check_decode((*src.shape, self.decoder.size), src_mask, tgt, tgt_mask, "Transformer")
        return self._decode(self._encode(src, src_mask), src_mask, tgt, tgt_mask)


def make_model(
    src_vocab: int,
    tgt_vocab: int,
    N: int = 6,
    d_model: int = 512,
    d_ff: int = 2048,
    h: int = 8,
    dropout: float = 0.1,
    ffn_activation: str | None = None,
    *,
    dtype=None,
    param_dtype=jnp.float32,
    precision=None,
    debug_checks: bool = False,
    rngs: nnx.Rngs,
) -> Transformer:
    """The book's encoder-decoder, the twin of ``torch_ref.make_model``.

    ``Transformer.from_config(EncoderDecoderConfig(src_vocab, tgt_vocab, N, d_model, d_ff,
    h, dropout, ffn_activation))`` (see :meth:`Transformer.from_config`) with the book's
    signature; the config checks the sizes. Every parameter with more than one dimension
    is Xavier-uniform initialised, as in the book; biases keep torch's default
    uniform(±1/sqrt(fan_in)), the norms ones and zeros. Chapter 10 uses ``N=6,
    d_model=256, d_ff=1024, h=8`` (:meth:`~flax_ln.EncoderDecoderConfig.chapter10`).

    Args:
      src_vocab: source vocabulary size.
      tgt_vocab: target vocabulary size.
      N: layers in the encoder and in the decoder.
      d_model: model width.
      d_ff: feed-forward hidden width.
      h: attention heads; must divide ``d_model``.
      dropout: dropout rate everywhere, in ``[0, 1)``.
      ffn_activation: ``None`` (the book, no activation) or ``"relu"`` (the Annotated Transformer).
      dtype: compute dtype; ``None`` follows the parameters.
      param_dtype: parameter dtype.
      precision: matmul precision.
      debug_checks: also check traced token ids (see :class:`Transformer`).
      rngs: parameter initialisation and dropout keys.
    """
    config = EncoderDecoderConfig(src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout, ffn_activation)
    return Transformer.from_config(
        config, dtype=dtype, param_dtype=param_dtype, precision=precision, debug_checks=debug_checks, rngs=rngs
    )
