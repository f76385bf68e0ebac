"""Sampling from :class:`flax_ln.GPT`: :func:`generate`, the book's loop with a KV cache, and its step.

:func:`generate` appends sampled (or greedy) tokens to a prompt in one jitted loop:
a prefill and one cached :func:`decode_step` per token while the sequence fits
``block_size``, then a recomputation on the last ``block_size`` tokens per token, as the
book does. :func:`decode_step` is one cached step as a pure function of
``nnx.split(model)``, which the planner compiles for a TPU topology.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from flax_ln.models.gpt import GPT, KVCache


def _pick(logits, key, temperature, *, greedy: bool, top_k: int | None, vocab_limit: int | None):
    """Next token ids (B,) from last-position logits (B, V): argmax, or a top-k/temperature sample."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))[:, :vocab_limit]  # (B, V or vocab_limit)
    if greedy:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k is not None:
        # the k-th largest logit as the min of the top k: slicing out the last value instead makes
        # XLA:CPU lower top_k as a full sort of the vocabulary (benchmarks/RESULTS.md)
        kth = jnp.min(jax.lax.top_k(logits, top_k)[0], axis=-1, keepdims=True)  # (B, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def decode_step(
    graphdef: nnx.GraphDef, state: nnx.State, token: Int[Array, "B T"], cache: KVCache, pos
) -> tuple[Float[Array, "B T V"], KVCache]:
    """One step of :func:`generate`'s cached loop as a pure function: ``GPT.decode`` of the merged model, dropout off.

    ``(graphdef, state)`` is ``nnx.split(model)``; jit it with ``graphdef`` static (the
    planner compiles exactly this for a TPU topology).
    """
    model = nnx.merge(graphdef, state)
    model.eval()
    return model._forward(token, cache, pos)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "top_k", "vocab_limit"))
def _generate(graphdef, state, idx, rng, temperature, *, max_new_tokens, greedy, top_k, vocab_limit):
    # The model is merged afresh inside every traced scope (loop bodies get `state` through
    # their carry), because NNX refuses Variables that hold tracers of an outer trace.
    # Carrying `state` costs nothing: XLA passes unchanged loop-carried buffers through
    # without copying (checked in the optimised HLO; the cache is what must not be copied).
    def model(state):
        m = nnx.merge(graphdef, state)
        m.eval()
        return m

    bs = model(state).config.block_size
    B, T0 = idx.shape
    total = T0 + max_new_tokens
    keys = jax.random.split(rng, max_new_tokens)  # keys[j] draws token T0 + j
    out = jnp.zeros((B, total), idx.dtype).at[:, :T0].set(idx)  # (B, T0 + new)
    pick = functools.partial(_pick, temperature=temperature, greedy=greedy, top_k=top_k, vocab_limit=vocab_limit)

    def put(out, n, logits):  # write token n, drawn from the logits that follow the first n tokens
        token = pick(logits[:, -1], keys[n - T0]).astype(out.dtype)  # (B,)
        return jax.lax.dynamic_update_slice(out, token[:, None], (0, n))

    length = T0  # tokens known so far
    if T0 <= bs:  # cached phase: prefill, then one token at a time while the context fits
        m = model(state)
        # slots for every token fed to the model while it fits: positions 0..min(bs, total - 1) - 1
        cache = m.init_cache(B, length=min(bs, total - 1))
        logits, cache = m._forward(idx, cache, 0, last_only=True)  # ids were checked by generate()
        out = put(out, length, logits)
        length += 1
        n_cached = max(0, min(bs, total - 1) - length + 1)

        def cached_step(i, carry):
            out, cache, state = carry
            n = length + i
            token = jax.lax.dynamic_slice(out, (0, n - 1), (B, 1))  # (B, 1)
            logits, cache = decode_step(graphdef, state, token, cache, n - 1)
            return put(out, n, logits), cache, state

        out, _, _ = jax.lax.fori_loop(0, n_cached, cached_step, (out, cache, state))
        length += n_cached

    def window_step(n, carry):  # the context exceeds block_size: recompute on the last block_size tokens
        out, state = carry
        context = jax.lax.dynamic_slice(out, (0, n - bs), (B, bs))  # (B, block)
        logits, _ = model(state)._forward(context, None, 0, last_only=True)
        return put(out, n, logits), state

    if length < total:
        out = jax.lax.fori_loop(length, total, window_step, (out, state))[0]
    return out


def generate(
    model: GPT,
    idx: Int[Array, "B T"],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    vocab_limit: int | None = None,
    rng: jax.Array,
) -> Int[Array, "B T+new"]:
    """Append ``max_new_tokens`` sampled tokens to ``idx``, as the book's sampling loop does.

    Each new token is drawn from ``softmax(logits[:, -1] / temperature)`` restricted to
    the ids below ``vocab_limit`` (chapter 14 draws only its 388 event ids: softmax over
    all ids then keeping the first 388, as the book does, is this renormalised) and to
    the ``top_k`` largest logits (ties with the k-th value are kept, as in torch); with
    ``temperature == 0`` it is the argmax instead (greedy; ``rng`` is then unused). The
    context is the last ``block_size`` tokens. While the sequence fits in ``block_size``
    a KV cache gives each step in O(S) work, S = min(block_size, prompt + max_new_tokens - 1)
    being the cache's preallocated length (each layer's new keys and values are written
    in place); beyond that every position shifts, so each step recomputes the last
    ``block_size`` tokens, exactly like the book. The prefill and those recomputations
    apply the head to the last position only. The whole loop is one jitted function with static
    shapes (compiled once per prompt shape, ``max_new_tokens``, ``top_k`` and greedy or
    not). Dropout is always off, whatever the model's mode; ``model`` is not modified.

    Args:
      model: a :class:`GPT`.
      idx: prompt token ids in ``[0, vocab_size)``, (B, T), any length >= 1 (longer than block_size is
        cropped for context); concrete ids are checked before anything is compiled.
      max_new_tokens: number of tokens to append.
      temperature: softmax temperature, > 0, or 0 for greedy decoding.
      top_k: keep only the k largest logits before sampling (1 <= k <= vocab_size).
      vocab_limit: draw only ids < vocab_limit (1 <= vocab_limit <= vocab_size); None: all.
      rng: a JAX PRNG key.

    Returns:
      (B, T + max_new_tokens) token ids, prompt included, in ``idx``'s dtype.
    """
    idx = model._check_ids(idx, "idx", "generate", any_length=True)  # longer prompts are cropped for context
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"generate: temperature must be >= 0 (0 means greedy), got {temperature!r}")
    if vocab_limit is not None and not 1 <= vocab_limit <= model.config.vocab_size:
        raise ValueError(
            f"generate: vocab_limit must be in [1, {model.config.vocab_size}] or None, got {vocab_limit!r}"
        )
    n_drawable = vocab_limit or model.config.vocab_size
    if top_k is not None and not 1 <= top_k <= n_drawable:
        raise ValueError(f"generate: top_k must be in [1, {n_drawable}] or None, got {top_k!r}")
    if max_new_tokens == 0:
        return idx
    graphdef, state = nnx.split(model)
    greedy = temperature == 0
    return _generate(
        graphdef,
        state,
        idx,
        rng,
        jnp.float32(1.0 if greedy else temperature),
        max_new_tokens=max_new_tokens,
        greedy=greedy,
        top_k=top_k,
        vocab_limit=vocab_limit,
    )
