"""A 2-layer MLP with a LayerNorm as a plain ``jax.numpy`` function over a dict of arrays, with its key map.

``apply(params, x) = x + fc2(gelu(fc1(layer_norm(x))))``: a pre-norm residual feed-forward
block (the exact GELU, LayerNorm's variance two-pass, ``eps`` its epsilon), written from the
torch math of ``LayerNorm -> Linear -> GELU -> Linear`` plus the shortcut. ``params``::

    {"norm": {"scale": (d,), "bias": (d,)},
     "fc1": {"w": (d, hidden), "b": (hidden,)},   # (in, out): torch's weight transposed
     "fc2": {"w": (hidden, d), "b": (d,)}}

Compared through ``flax_ln.parity.Function(apply, params)`` with ``weights=KEY_MAP``, for a
torch module whose submodules are ``norm``, ``fc1`` and ``fc2``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_ln.convert import KeyMap


def init(width: int, hidden: int, dtype=np.float32) -> dict[str, Any]:
    """Parameters of the right shapes and dtype (zeros; the comparison fills them through the key map)."""
    zeros = lambda *shape: np.zeros(shape, dtype)  # noqa: E731
    return {
        "norm": {"scale": zeros(width), "bias": zeros(width)},
        "fc1": {"w": zeros(width, hidden), "b": zeros(hidden)},
        "fc2": {"w": zeros(hidden, width), "b": zeros(width)},
    }


def apply(params: dict[str, Any], x: jax.Array, *, eps: float = 1e-5, approximate: bool = False) -> jax.Array:
    """``x + fc2(gelu(fc1(layer_norm(x))))`` over the last axis; ``approximate``: the tanh GELU (a planted mistake)."""
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)  # two-pass, as torch
    h = (x - mean) * jax.lax.rsqrt(var + eps) * params["norm"]["scale"] + params["norm"]["bias"]
    h = jax.nn.gelu(h @ params["fc1"]["w"] + params["fc1"]["b"], approximate=approximate)  # (..., hidden)
    return x + h @ params["fc2"]["w"] + params["fc2"]["b"]  # (..., d)


KEY_MAP = KeyMap(
    [
        (r"norm\.weight", "norm.scale", None),
        (r"norm\.bias", "norm.bias", None),
        (r"(fc1|fc2)\.weight", r"\1.w", "o i -> i o"),
        (r"(fc1|fc2)\.bias", r"\1.b", None),
    ]
)
