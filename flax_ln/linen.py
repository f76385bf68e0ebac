"""Linen adapters for flax_ln's NNX modules, built with ``flax.nnx.bridge.to_linen``.

Each function returns a ``flax.linen.Module`` whose ``init``/``apply`` run the NNX
module of the same name; parameters live in the ``params`` collection under the
NNX attribute names. The NNX module is rebuilt from its constructor arguments on every
``apply`` and then filled with the given variables; under ``jax.jit`` XLA drops the
unused initialisation.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge

from flax_ln.models import encoder_decoder, gpt, layernorm
from flax_ln.models.encoder_decoder import EncoderDecoderConfig
from flax_ln.models.gpt import GPTConfig


def LayerNorm(features: int, eps: float = 1e-6, *, dtype=None, param_dtype=jnp.float32, name=None):
    """Linen ``LayerNorm``: the book's chapter-9 norm (see :class:`flax_ln.LayerNorm`)."""
    return bridge.to_linen(layernorm.LayerNorm, features, eps, dtype=dtype, param_dtype=param_dtype, name=name)


def TorchLayerNorm(features: int, eps: float = 1e-5, *, dtype=None, param_dtype=jnp.float32, name=None):
    """Linen ``TorchLayerNorm``: the ``torch.nn.LayerNorm`` twin (see :class:`flax_ln.TorchLayerNorm`)."""
    return bridge.to_linen(layernorm.TorchLayerNorm, features, eps, dtype=dtype, param_dtype=param_dtype, name=name)


# ---- whole models --------------------------------------------------------------------------------


def _build(factory, *args, deterministic: bool, **kwargs):
    """``factory(*args, **kwargs)``, switched to eval mode when ``deterministic``.

    ``bridge.to_linen`` calls this on ``init`` and on every ``apply``, with ``rngs`` made
    from the Linen RNG streams. As Linen's ``nn.Dropout`` does, active dropout needs a
    ``'dropout'`` stream; without one the NNX modules would silently use a fixed key, so
    that is an error here.
    """
    rngs = kwargs["rngs"]
    if "dropout" not in rngs:  # the dropout modules need a stream to be built; unused when deterministic
        kwargs["rngs"] = nnx.Rngs(**dict(rngs.items()), dropout=0)
    module = factory(*args, **kwargs)
    if deterministic:
        module.eval()
    elif "dropout" not in rngs and any(isinstance(m, nnx.Dropout) and m.rate > 0 for _, m in nnx.iter_modules(module)):
        raise ValueError(
            f"{getattr(factory, '__qualname__', factory)}: dropout is active (deterministic=False) but no 'dropout' "
            "PRNG stream was given; pass rngs={'params': key, 'dropout': key2} to init and rngs={'dropout': key} to "
            "apply, or build the Linen module with deterministic=True for inference."
        )
    return module


def GPT(
    config: GPTConfig,
    *,
    scan_layers: bool = False,
    deterministic: bool = False,
    dtype=None,
    param_dtype=jnp.float32,
    precision=None,
    name=None,
):
    """Linen ``GPT``: the book's GPT (see :class:`flax_ln.GPT`) as a ``flax.linen.Module``.

    ``init(rngs, idx)`` creates the ``params`` collection under the NNX attribute names
    (``transformer/wte/embedding``, ``transformer/h/0/attn/c_attn/kernel``, ...; with
    ``scan_layers`` the blocks' parameters are stacked on a leading layer axis);
    ``apply(variables, idx, targets=None)`` returns ``(logits, loss)`` like the NNX model.
    The KV-cache step is ``apply(variables, idx, cache, pos, nnx_method="decode")``.

    Args:
      config: the :class:`~flax_ln.GPTConfig`.
      scan_layers, dtype, param_dtype, precision: as :class:`flax_ln.GPT`.
      deterministic: dropout off (inference). Otherwise dropout is on, as in a fresh NNX
        model, and ``init``/``apply`` need a ``'dropout'`` PRNG stream.
      name: the Linen module name.
    """
    return bridge.to_linen(
        functools.partial(_build, gpt.GPT, deterministic=deterministic),
        config,
        scan_layers=scan_layers,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        name=name,
    )


def Transformer(
    config: EncoderDecoderConfig,
    *,
    deterministic: bool = False,
    dtype=None,
    param_dtype=jnp.float32,
    precision=None,
    name=None,
):
    """Linen encoder-decoder: :meth:`flax_ln.Transformer.from_config` as a ``flax.linen.Module``.

    ``init(rngs, src, tgt, src_mask, tgt_mask)`` creates ``params`` under the NNX
    attribute names (``encoder/layers/0/self_attn/linears/0/kernel``, ...) plus the
    positional tables ``src_embed/1/pe`` and ``tgt_embed/1/pe`` in the non-trainable
    ``Buffer`` collection; pass every collection back to ``apply``. ``apply(variables, src, tgt,
    src_mask, tgt_mask)`` returns the decoder output (B, T, d_model); the other entry
    points are ``nnx_method="encode"`` / ``"decode"``, and the log-probabilities are
    ``apply(variables, x, nnx_method=lambda m, x: m.generator(x))``.

    Args:
      config: the :class:`~flax_ln.EncoderDecoderConfig`, or anything its ``from_any`` reads.
      dtype, param_dtype, precision: as :meth:`flax_ln.Transformer.from_config`.
      deterministic: dropout off (inference). Otherwise dropout is on and ``init``/``apply``
        need a ``'dropout'`` PRNG stream.
      name: the Linen module name.
    """
    return bridge.to_linen(
        functools.partial(_build, encoder_decoder.Transformer.from_config, deterministic=deterministic),
        EncoderDecoderConfig.from_any(config),
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        name=name,
    )


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
    deterministic: bool = False,
    dtype=None,
    param_dtype=jnp.float32,
    precision=None,
    name=None,
):
    """Linen encoder-decoder: the book's ``make_model`` (see :func:`flax_ln.make_model`) as a ``flax.linen.Module``.

    :func:`Transformer` of ``EncoderDecoderConfig(src_vocab, tgt_vocab, N, d_model, d_ff, h,
    dropout, ffn_activation)``; ``init`` and ``apply`` are described there.

    Args:
      src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout, ffn_activation, dtype, param_dtype,
        precision: as :func:`flax_ln.make_model`.
      deterministic: dropout off (inference). Otherwise dropout is on and ``init``/``apply``
        need a ``'dropout'`` PRNG stream.
      name: the Linen module name.
    """
    return Transformer(
        EncoderDecoderConfig(src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout, ffn_activation),
        deterministic=deterministic,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        name=name,
    )
