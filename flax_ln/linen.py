"""Linen adapters for flax_ln's NNX modules, built with ``flax.nnx.bridge.to_linen``.

Each function returns a ``flax.linen.Module`` whose ``init``/``apply`` run the NNX
module of the same name; parameters live in the ``params`` collection under the
NNX attribute names.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax.nnx import bridge

from flax_ln import layernorm as _nnx


def LayerNorm(features: int, eps: float = 1e-6, *, robust: bool = False, dtype=None, param_dtype=jnp.float32, name=None):
    """Linen ``LayerNorm``: the book's chapter-9 norm (see :class:`flax_ln.LayerNorm`)."""
    return bridge.to_linen(
        _nnx.LayerNorm, features, eps, robust=robust, dtype=dtype, param_dtype=param_dtype, name=name
    )


def TorchLayerNorm(features: int, eps: float = 1e-5, *, robust: bool = False, dtype=None, param_dtype=jnp.float32, name=None):
    """Linen ``TorchLayerNorm``: the ``torch.nn.LayerNorm`` twin (see :class:`flax_ln.TorchLayerNorm`)."""
    return bridge.to_linen(
        _nnx.TorchLayerNorm, features, eps, robust=robust, dtype=dtype, param_dtype=param_dtype, name=name
    )
