"""Dropout whose random mask is hashed once per element on every backend, bit-identical to ``nnx.Dropout``'s.

``jax.random.bernoulli`` hashes a counter per element with Threefry-2x32 (20 rounds).
On the CPU, JAX lowers that hash as a rolled 5-iteration ``while`` loop, so XLA
writes and re-reads two full-size ``uint32`` arrays per iteration and keeps the
``uint32`` bits alive for the backward pass (benchmarks/RESULTS.md, "GPT on this CPU"). The
same hash written out round by round is plain element-wise integer arithmetic that XLA
fuses. On GPUs and TPUs JAX already emits the unrolled hash.

Written element-wise, though, the hash reads no array (only the key and an iota), so
XLA:CPU counts it free to duplicate and recomputes it inside every fusion that uses the
mask: the forward select, the backward select and the transposed copies made for
weight gradients, about four times per mask in a training step (benchmarks/RESULTS.md,
"the dropout mask hashed once"). The mask is therefore packed 32 samples to a ``uint32`` word by
a reduction, which XLA computes once; its users unpack a bit with a shift, and the
packed mask (one bit per element) is all that stays alive for the backward pass.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KS_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(v: jax.Array, d: int) -> jax.Array:
    return (v << np.uint32(d)) | (v >> np.uint32(32 - d))


def threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block cipher, 20 rounds (Salmon et al. 2011), as JAX's PRNG computes it, unrolled.

    Key ``(k0, k1)`` and counters ``(x0, x1)`` are ``uint32``; every round is
    ``x0 += x1; x1 = rotl(x1, r) ^ x0``, with the key schedule ``(k0, k1, k0 ^ k1 ^
    0x1BD11BDA)`` injected every four rounds. Returns the two output words.
    """
    ks = (k0, k1, k0 ^ k1 ^ _KS_PARITY)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _fusable(key: jax.Array, p, size: int) -> bool:
    """Whether :func:`bernoulli` reproduces ``jax.random.bernoulli`` for this key, probability and size."""
    if not (isinstance(p, (float, int)) and jax.dtypes.canonicalize_dtype(float) == jnp.float32):
        return False  # float64 probabilities (jax_enable_x64) draw 64-bit uniforms: left to JAX
    if size > 2**32 - 32 or not jax.config.jax_threefry_partitionable:  # type: ignore[attr-defined]  # flags are set as attributes at run time
        return False  # JAX then counts with two words (or the packed words would), or hashes blocks of the flat array
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.shape == () and str(jax.random.key_impl(key)) == "threefry2x32"
    return key.shape == (2,) and key.dtype == jnp.uint32  # a raw (legacy) threefry key


def bernoulli(key: jax.Array, p: float, shape) -> jax.Array:
    """``jax.random.bernoulli(key, p, shape)``, bit for bit, the hash unrolled and run once per element.

    For the element with row-major index ``n``: ``(b0, b1) = threefry2x32(key, (0, n))``,
    ``u = float32(((b0 ^ b1) >> 9) | 0x3F800000) - 1`` (a uniform on [0, 1) with 23
    random mantissa bits) and the sample is ``u < p``: JAX's own recipe with the
    partitionable Threefry (the default since JAX 0.5). Any other key implementation,
    ``jax_threefry_partitionable=False``, a float64 ``p`` (``jax_enable_x64``) or more than
    2**32 - 32 elements fall back to ``jax.random.bernoulli`` itself.
    """
    shape = tuple(shape)
    if not _fusable(key, p, math.prod(shape)):
        return jax.random.bernoulli(key, p, shape)
    k = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key  # (2,) uint32
    return _fused_bernoulli(k, float(p), shape)


@functools.partial(jax.jit, static_argnums=(1, 2))  # one dispatch when called eagerly, inlined under jit
def _fused_bernoulli(key_data: jax.Array, p: float, shape: tuple[int, ...]) -> jax.Array:
    """The samples hashed element by element, packed 32 to a word by one reduction, then unpacked (module docstring)."""
    size = math.prod(shape)
    words = -(-size // 32)
    counter = jax.lax.iota(jnp.uint32, words * 32).reshape(words, 32)  # row-major element index, low word
    b0, b1 = threefry2x32(key_data[0], key_data[1], jnp.zeros_like(counter), counter)
    mantissa = ((b0 ^ b1) >> np.uint32(9)) | np.uint32(0x3F800000)  # 1.0's exponent: a float in [1, 2)
    sample = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - np.float32(1.0) < np.float32(p)  # (words, 32)
    lanes = jax.lax.iota(jnp.uint32, 32)
    packed = jax.lax.reduce(sample.astype(jnp.uint32) << lanes, np.uint32(0), jax.lax.bitwise_or, (1,))  # (words,)
    unpacked = ((packed[:, None] >> lanes) & np.uint32(1)).astype(jnp.bool_)  # (words, 32)
    return unpacked.reshape(-1)[:size].reshape(shape)


class Dropout(nnx.Dropout):
    """``nnx.Dropout`` with its mask drawn by :func:`bernoulli`: the same masks, the same state, faster on CPU.

    ``y = where(keep, x / (1 - rate), 0)`` with ``keep ~ Bernoulli(1 - rate)`` per
    element (shared along ``broadcast_dims``). The constructor, the ``rngs`` stream
    (one key per call, as ``nnx.Dropout`` draws it), ``train()``/``eval()`` and the
    saved state are ``nnx.Dropout``'s, so a model switches between the two without any
    change in its outputs or checkpoints. Like ``torch.nn.Dropout`` in distribution,
    not in the random stream (torch's generator is another one).
    """

    def __call__(self, inputs, *, deterministic: bool | None = None, rngs=None) -> jax.Array:
        deterministic = self.deterministic if deterministic is None else deterministic
        if deterministic is None:
            raise ValueError(
                "Dropout: deterministic is None; call model.train() / model.eval(), or pass deterministic=True/False"
            )
        if self.rate == 0.0 or deterministic:
            return inputs
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)
        rngs = self.rngs if rngs is None else rngs
        if rngs is None:
            raise ValueError("Dropout: deterministic is False but no rngs were given to the constructor or the call")
        if isinstance(rngs, nnx.Rngs):
            key = rngs[self.rng_collection]()
        elif isinstance(rngs, nnx.RngStream):
            key = rngs()
        else:
            key = rngs
        keep_prob = 1.0 - self.rate
        shared = {d % inputs.ndim for d in self.broadcast_dims}
        mask_shape = tuple(1 if d in shared else n for d, n in enumerate(inputs.shape))
        keep = jnp.broadcast_to(bernoulli(key, keep_prob, mask_shape), inputs.shape)
        return jax.lax.select(keep, inputs / keep_prob, jnp.zeros_like(inputs))
