""":class:`EncoderDecoderConfig`: the sizes and options of the book's encoder-decoder, validated once.

The fields are the arguments of the book's ``make_model(src_vocab, tgt_vocab, N, d_model,
d_ff, h, dropout)`` under the book's names, plus this port's feed-forward activation and
the length of the positional table. A config from :mod:`torch_ref` (or any object or
mapping with the same field names) is read as plain data by :meth:`EncoderDecoderConfig.from_any`.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from flax_ln.models.checks import config_fields
from flax_ln.models.encoder_decoder.layers import ACTIVATIONS

_SIZES = ("src_vocab", "tgt_vocab", "N", "d_model", "d_ff", "h", "max_len")  # the fields that are positive ints
_REQUIRED = ("src_vocab", "tgt_vocab")  # the vocabularies are the data's: no default


@dataclasses.dataclass(frozen=True)
class EncoderDecoderConfig:
    """Hyper-parameters of the book's encoder-decoder; the same values build ``flax_ln`` and ``torch_ref`` models.

    Build the model with :meth:`flax_ln.Transformer.from_config`; :func:`flax_ln.make_model`
    takes the same values as arguments. The defaults are ``make_model``'s (the original
    paper's base model); :meth:`chapter10` is the book's translation setup.

    Args:
      src_vocab: source vocabulary size.
      tgt_vocab: target vocabulary size.
      N: layers in the encoder and in the decoder.
      d_model: model width.
      d_ff: feed-forward hidden width.
      h: attention heads; must divide ``d_model``.
      dropout: dropout rate everywhere, in ``[0, 1)``.
      ffn_activation: ``None`` (the book, no activation) or ``"relu"`` (the Annotated Transformer).
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
            object.__setattr__(self, name, int(value))  # a NumPy integer becomes a plain int
        if self.d_model % self.h:
            raise ValueError(
                f"EncoderDecoderConfig: d_model={self.d_model} is not divisible by h={self.h}; "
                "pick h among the divisors of d_model"
            )
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

        Configs cross from ``torch_ref`` (``torch_ref.EncoderDecoderConfig``), a
        ``types.SimpleNamespace`` or a mapping (a reference file's ``spec["sizes"]`` with
        its ``ffn_activation``) as plain data: the two vocabularies are required, the
        other fields take this class's defaults when absent, and other keys are ignored.
        """
        if isinstance(config, cls):
            return config
        values = config_fields(cls, config)
        missing = [name for name in _REQUIRED if name not in values]
        if missing:
            raise TypeError(
                f"encoder-decoder config {type(config).__name__} lacks {missing}: expected an EncoderDecoderConfig "
                f"or an object or mapping with the book's make_model fields {list(_REQUIRED)} (and optionally "
                f"{[f.name for f in dataclasses.fields(cls) if f.name not in _REQUIRED]})"
            )
        return cls(**values)

    @classmethod
    def base(cls, src_vocab: int, tgt_vocab: int, **overrides) -> EncoderDecoderConfig:
        """``make_model``'s defaults, the original paper's base model: N=6, d_model=512, d_ff=2048, h=8."""
        return cls(src_vocab, tgt_vocab, **overrides)

    @classmethod
    def chapter10(cls, src_vocab: int, tgt_vocab: int, **overrides) -> EncoderDecoderConfig:
        """Chapter 10's translation model: N=6, d_model=256, d_ff=1024, h=8; the vocabularies are the data's."""
        return cls(**{**dict(src_vocab=src_vocab, tgt_vocab=tgt_vocab, N=6, d_model=256, d_ff=1024, h=8), **overrides})
