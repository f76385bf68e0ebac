"""The book's chapter-9/10 encoder-decoder Transformer in Flax NNX, a twin of :mod:`torch_ref.encoder_decoder`.

Every module has the attribute names of its torch twin (``encoder.layers[0].sublayer[1].norm``,
``src_embed[0].lut``, ``src_embed[1].pe``, ``generator.proj``, ...), so its NNX path is the
torch ``state_dict`` prefix and :mod:`flax_ln.convert` maps weights both ways.

How it differs from its look-alikes: the feed-forward network has no activation by
default (the book; the Annotated Transformer applies ReLU, ``ffn_activation="relu"``),
the norms are the book's :class:`~flax_ln.models.layernorm.LayerNorm` (unbiased variance, eps
inside the root), masked attention scores are filled with -1e9 (not -inf), and every
sublayer is pre-norm.

Mixed precision: ``dtype`` is the compute dtype of the linear layers and embeddings,
``param_dtype`` the storage dtype. Norm statistics, attention scores, the softmax and
the generator's log-softmax are computed in at least float32.

Inputs are validated on their static shapes and dtypes before any compute, also under
``jax.jit``: token ids must be integers, masks must broadcast to the attention shape,
and sequences may not be longer than the positional table. The :class:`Transformer`'s
entry points (``__call__``, ``encode``, ``decode``, :func:`greedy_decode`) also check that
concrete token ids lie in ``[0, vocab)``, and traced ones with ``debug_checks=True``
(see :mod:`flax_ln.models.checks`); they validate once and call unchecked internals.

The package, by concept:

- :mod:`~flax_ln.models.encoder_decoder.config`: :class:`EncoderDecoderConfig`, the sizes and options;
- :mod:`~flax_ln.models.encoder_decoder.layers`: the building blocks (attention, feed-forward,
  the layers and stacks, embeddings, the positional table, the generator) and their input checks;
- :mod:`~flax_ln.models.encoder_decoder.model`: :class:`Transformer` and :func:`make_model`;
- :mod:`~flax_ln.models.encoder_decoder.decoding`: the masks and :func:`greedy_decode`.

Every name below is importable from this package.
"""

from flax_ln.models.encoder_decoder.config import EncoderDecoderConfig
from flax_ln.models.encoder_decoder.decoding import greedy_decode, make_src_mask, make_std_mask, subsequent_mask
from flax_ln.models.encoder_decoder.layers import (
    ACTIVATIONS,
    MASK_VALUE,
    Buffer,
    Decoder,
    DecoderLayer,
    Embeddings,
    Encoder,
    EncoderLayer,
    Generator,
    MultiHeadedAttention,
    PositionalEncoding,
    PositionwiseFeedForward,
    Sequential,
    SublayerConnection,
    sinusoid_table,
)
from flax_ln.models.encoder_decoder.model import Transformer, make_model

__all__ = [
    "ACTIVATIONS",
    "MASK_VALUE",
    "Buffer",
    "Decoder",
    "DecoderLayer",
    "Embeddings",
    "Encoder",
    "EncoderDecoderConfig",
    "EncoderLayer",
    "Generator",
    "MultiHeadedAttention",
    "PositionalEncoding",
    "PositionwiseFeedForward",
    "Sequential",
    "SublayerConnection",
    "Transformer",
    "greedy_decode",
    "make_model",
    "make_src_mask",
    "make_std_mask",
    "sinusoid_table",
    "subsequent_mask",
]
