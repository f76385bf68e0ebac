"""The book's GPT (chapter 11 GPT-2XL, chapter 12 text GPT, chapter 14 music Transformer) in Flax NNX.

The module tree mirrors :mod:`torch_ref.gpt` (minGPT layout) attribute for attribute,
so ``flax_ln.to_torch_state_dict`` names every weight as the book's ``state_dict``
does: ``transformer.wte``, ``transformer.h.{i}.attn.c_attn``, ``lm_head``, ...

:class:`GPTConfig` is torch-free; a config from ``torch_ref`` (or any object with the same
field names) is accepted as plain data through :meth:`GPTConfig.from_any`.

The loss is computed by :mod:`flax_ln.models.losses` (its three functions are importable from
here too), remat and the scan over layers by :mod:`flax_ln.models.remat`, which needs of a block
only what :class:`~flax_ln.models.remat.RematBlock` describes; sampling, :func:`flax_ln.generate`,
is in :mod:`flax_ln.models.sampling`, which imports this module.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from flax_ln._deprecated import module_getattr
from flax_ln.models.attention import merge_heads, scaled_dot_product_attention, split_heads
from flax_ln.models.checks import check_token_ids, config_fields
from flax_ln.models.dense import linear_dot_general
from flax_ln.models.dropout import Dropout
from flax_ln.models.layernorm import TorchLayerNorm
from flax_ln.models.losses import cross_entropy as cross_entropy
from flax_ln.models.losses import head_cross_entropy as head_cross_entropy
from flax_ln.models.losses import head_logits_and_cross_entropy as head_logits_and_cross_entropy
from flax_ln.models.remat import remat_block, remat_policy, scan_blocks


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of the book's GPT; the same values build ``flax_ln.GPT`` and ``torch_ref.GPT``.

    Args:
      n_layer: number of Transformer blocks.
      n_head: attention heads; must divide ``n_embd``.
      n_embd: model width.
      vocab_size: number of token ids.
      block_size: longest sequence (the positional-embedding table and causal mask size).
      embd_pdrop: dropout rate on the summed token and position embeddings; 0.1, as in the book.
      resid_pdrop: dropout rate on each residual branch's output; 0.1.
      attn_pdrop: dropout rate on the attention probabilities; 0.1.
      ignore_index: target id the loss skips (chapter 11: -1; chapter 14: 389, the padding id).
      c_proj_reinit: initialise every ``c_proj.weight`` as normal(0, 0.02/sqrt(2*n_layer)),
        as chapters 12 and 14 do; otherwise normal(0, 0.02) like every other weight.
    """

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    embd_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    ignore_index: int = -1
    c_proj_reinit: bool = False

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "pick n_head among the divisors of n_embd"
            )
        for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GPTConfig: {name} must be in [0, 1), got {getattr(self, name)!r}")

    @classmethod
    def from_any(cls, config) -> GPTConfig:
        """``config`` as a :class:`GPTConfig`: itself, or copied field by field from any object or mapping.

        Configs cross from ``torch_ref`` (or the book's ``Config``, or a
        ``types.SimpleNamespace``) as plain data: the five sizes are required, the other
        fields take this class's defaults when absent. The models call this, so they keep
        a frozen, hashable config (NNX needs one as static graph data).
        """
        if isinstance(config, cls):
            return config
        values = config_fields(cls, config)
        sizes = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
        missing = [name for name in sizes if name not in values]
        if missing:
            raise TypeError(
                f"GPT config {type(config).__name__} lacks {missing}: expected a GPTConfig or an object "
                f"or dict with the book's fields {list(sizes)}"
            )
        return cls(**values)

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def gpt2(cls, **overrides) -> GPTConfig:
        """GPT-2 small: 12 layers, 12 heads, width 768, vocab 50257, block 1024."""
        return cls(**{**dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024), **overrides})

    @classmethod
    def gpt2_xl(cls, **overrides) -> GPTConfig:
        """Chapter 11's GPT-2XL: 48 layers, 25 heads, width 1600, vocab 50257, block 1024."""
        return cls(**{**dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024), **overrides})

    @classmethod
    def chapter12(cls, vocab_size: int, **overrides) -> GPTConfig:
        """Chapter 12's text GPT: 3 layers, 4 heads, width 256, block 128, scaled ``c_proj`` init."""
        base = dict(n_layer=3, n_head=4, n_embd=256, vocab_size=vocab_size, block_size=128, c_proj_reinit=True)
        return cls(**{**base, **overrides})

    @classmethod
    def music(cls, **overrides) -> GPTConfig:
        """Chapter 14's music Transformer: 6/8/512, vocab 390, block 2048, loss ignores padding id 389."""
        base = dict(
            n_layer=6, n_head=8, n_embd=512, vocab_size=390, block_size=2048, ignore_index=389, c_proj_reinit=True
        )
        return cls(**{**base, **overrides})


def causal_mask_buffer(block_size: int) -> np.ndarray:
    """torch's persistent ``attn.bias`` buffer: ``tril(ones(block, block))`` shaped (1, 1, block, block), float32."""
    return np.tril(np.ones((block_size, block_size), np.float32))[None, None]  # (1, 1, block, block)


def causal_mask(q_len: int, k_len: int, offset=0) -> jax.Array:
    """(q_len, k_len) bool mask, True where key ``j`` may be attended by query ``i``: ``j <= offset + i``.

    Built from iotas at trace time, so no (block, block) array is stored. ``offset`` is
    the absolute position of the first query (0 without a KV cache; may be traced).
    """
    q_pos = offset + jax.lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0)
    return jax.lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1) <= q_pos


def gelu(x: jax.Array) -> jax.Array:
    """tanh GELU, as the book (and GPT-2's ``gelu_new``): ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * jnp.power(x, 3.0))))


class KVCache(NamedTuple):
    """Keys and values of every layer, preallocated: each (n_layer, B, nh, S, hs), S <= block_size slots."""

    k: jax.Array
    v: jax.Array


def _cache_write(buffer: jax.Array, new: jax.Array, layer, pos) -> jax.Array:
    """``buffer`` (L, B, nh, S, hs) with ``new`` (B, nh, T, hs) written at layer ``layer``, slots ``pos..pos+T-1``.

    One ``dynamic_update_slice`` into the whole buffer, which XLA performs in place; slicing
    the layer out, updating it and setting it back would copy the buffer once per layer.
    """
    return jax.lax.dynamic_update_slice(buffer, new[None].astype(buffer.dtype), (layer, 0, 0, pos, 0))


def _split(rngs: nnx.Rngs, n: int) -> nnx.Rngs:
    """``rngs.split(n)``: each stream's next key split ``n`` ways. flax 0.12.6 added ``Rngs.split``; before it
    ``rngs.fork(split=n)`` gives the same keys (and is deprecated after)."""
    split = getattr(rngs, "split", None)
    return split(n) if callable(split) else rngs.fork(split=n)


def _init_fns(config: GPTConfig):
    """minGPT/book initialisers: weights normal(0, 0.02), biases zero; optionally scaled ``c_proj``."""
    normal = nnx.initializers.normal(0.02)
    c_proj_std = 0.02 / math.sqrt(2 * config.n_layer) if config.c_proj_reinit else 0.02
    return normal, nnx.initializers.normal(c_proj_std)


def _linear(n_in, n_out, kernel_init, *, dtype, param_dtype, precision, rngs, use_bias=True):
    """``nnx.Linear`` with zero-initialised bias; its product is :func:`~flax_ln.models.dense.linear_dot_general`."""
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=use_bias,
        kernel_init=kernel_init,
        bias_init=nnx.initializers.zeros_init(),
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        dot_general=linear_dot_general,
        rngs=rngs,
    )


class GELU(nnx.Module):
    """The tanh-form GELU as a module (torch's ``mlp.act``); see :func:`gelu`.

    Differs from ``torch.nn.GELU()`` and ``jax.nn.gelu(approximate=False)``, which use the
    exact erf form (up to ~1e-3 apart); equals ``jax.nn.gelu(approximate=True)`` in math.
    Computes in the input dtype.
    """

    def __call__(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return gelu(x)


class CausalSelfAttention(nnx.Module):
    """Masked multi-head self-attention: ``c_proj(softmax(mask(q kᵀ / sqrt(hs), -inf)) v)``, with dropouts.

    ``c_attn`` projects to q, k, v (split in that order along the features); positions
    above the diagonal get ``-inf`` before the softmax (the encoder-decoder uses -1e9);
    attention dropout acts on the probabilities and residual dropout after ``c_proj``.
    Unlike torch's module, the causal mask is computed from iotas rather than stored;
    the converter still writes and checks torch's persistent ``attn.bias`` buffer.

    Args:
      config: a :class:`GPTConfig` itself (:class:`Block` and :class:`GPT` convert theirs once).
      dtype: compute dtype (``None``: inferred from inputs and parameters).
      param_dtype: parameter dtype.
      precision: matmul precision for the projections and attention.
      rngs: parameter initialisation and dropout randomness.
    """

    def __init__(self, config: GPTConfig, *, dtype=None, param_dtype=jnp.float32, precision=None, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.block_size = config.block_size
        init, c_proj_init = _init_fns(config)
        opts = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.c_attn = _linear(config.n_embd, 3 * config.n_embd, init, **opts)
        self.c_proj = _linear(config.n_embd, config.n_embd, c_proj_init, **opts)
        self.attn_dropout = Dropout(config.attn_pdrop, rngs=rngs)
        self.resid_dropout = Dropout(config.resid_pdrop, rngs=rngs)

    def __call__(self, x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        return self.attend(x, None, 0)[0]

    def attend(self, x, cache: KVCache | None, pos, layer=0):
        """``(y, cache)``: attention of ``x`` at absolute positions ``pos..pos+T-1``.

        With ``cache``, the :class:`KVCache` of every layer (each (L, B, nh, S, hs)), the new
        keys and values are written into layer ``layer`` at ``pos`` (one in-place
        ``dynamic_update_slice`` of T slots per buffer) and the queries attend to that
        layer's S cached positions up to their own; with ``cache=None`` they attend to
        ``x`` alone (``pos`` must then be 0). ``layer`` may be traced (a scan over layers).
        """
        T = x.shape[1]
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)  # 3 x (B, T, C)
        q, k, v = (split_heads(t, self.n_head) for t in (q, k, v))  # 3 x (B, nh, T, hs)
        if cache is not None:
            cache = KVCache(_cache_write(cache.k, k, layer, pos), _cache_write(cache.v, v, layer, pos))
            k = jax.lax.dynamic_index_in_dim(cache.k, layer, 0, keepdims=False)  # (B, nh, S, hs)
            v = jax.lax.dynamic_index_in_dim(cache.v, layer, 0, keepdims=False)  # (B, nh, S, hs)
        y = scaled_dot_product_attention(
            q,
            k,
            v,
            causal_mask(T, k.shape[2], pos),
            mask_value=-jnp.inf,
            dropout=self.attn_dropout,
            precision=self.precision,
        )  # (B, nh, T, hs)
        return self.resid_dropout(self.c_proj(merge_heads(y))), cache  # (B, T, C)


class MLP(nnx.Module):
    """Position-wise feed-forward: ``dropout(c_proj(gelu_tanh(c_fc(x))))``, width 4*n_embd.

    The book's GPT uses the tanh GELU (its encoder-decoder feed-forward has no activation).

    Args:
      config: a :class:`GPTConfig` itself, as :class:`CausalSelfAttention`.
      dtype, param_dtype, precision, rngs: as :class:`CausalSelfAttention`.
    """

    def __init__(self, config: GPTConfig, *, dtype=None, param_dtype=jnp.float32, precision=None, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        init, c_proj_init = _init_fns(config)
        opts = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.c_fc = _linear(config.n_embd, 4 * config.n_embd, init, **opts)
        self.c_proj = _linear(4 * config.n_embd, config.n_embd, c_proj_init, **opts)
        self.act = GELU()
        self.dropout = Dropout(config.resid_pdrop, rngs=rngs)

    def __call__(self, x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nnx.Module):
    """Pre-norm Transformer block: ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``.

    ``ln_1``/``ln_2`` are ``torch.nn.LayerNorm`` twins (:class:`TorchLayerNorm`, biased
    variance, eps 1e-5), not the book's chapter-9 LayerNorm (unbiased, eps 1e-6) that the
    encoder-decoder uses.

    Args:
      config: the :class:`GPTConfig`, or anything :meth:`GPTConfig.from_any` takes; converted
        once here and passed on to ``attn`` and ``mlp``.
      dtype: compute dtype; norm statistics stay at least float32.
      param_dtype: parameter dtype.
      precision: matmul precision.
      rngs: parameter initialisation and dropout randomness.
    """

    def __init__(self, config: GPTConfig, *, dtype=None, param_dtype=jnp.float32, precision=None, rngs: nnx.Rngs):
        self.config = config = GPTConfig.from_any(config)
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        opts = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.ln_1 = TorchLayerNorm(config.n_embd, dtype=dtype, param_dtype=param_dtype)
        self.attn = CausalSelfAttention(config, **opts)
        self.ln_2 = TorchLayerNorm(config.n_embd, dtype=dtype, param_dtype=param_dtype)
        self.mlp = MLP(config, **opts)

    def __call__(self, x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        return self.attend(x, None, 0)[0]

    def attend(self, x, cache, pos, layer=0):
        """``(x, cache)`` with an optional all-layer KV cache, this block being ``layer``; see
        :meth:`CausalSelfAttention.attend`."""
        y, cache = self.attn.attend(self.ln_1(x), cache, pos, layer)
        x = x + y
        return x + self.mlp(self.ln_2(x)), cache


class GPT(nnx.Module):
    """The book's GPT: ``lm_head(ln_f(blocks(drop(wte(idx) + wpe(pos)))))``, plus the loss.

    ``model(idx, targets=None)`` returns ``(logits, loss)`` like chapter 11's model; the
    loss is the mean cross-entropy ignoring ``config.ignore_index``, ``None`` without
    targets, computed with the head in one piece (:func:`~flax_ln.models.losses.head_cross_entropy`: a training
    step that uses only the loss never keeps the (B, T, V) logits). ``lm_head``
    has no bias and is *not* tied to ``wte`` (as in minGPT and the book; Hugging Face
    GPT-2 ties them, see :func:`flax_ln.load_hf_gpt2`).

    With ``scan_layers=True`` the blocks' parameters are stacked on a leading
    ``n_layer`` axis (created with ``nnx.vmap``) and run with ``jax.lax.scan``: one
    compiled block instead of n_layer copies. The converter maps torch's
    ``transformer.h.{i}.*`` keys onto either layout. The two layouts draw different
    random initial weights from the same ``rngs``.

    With ``remat`` each block runs under ``jax.checkpoint``: the backward pass keeps only
    what the policy saves (with ``remat=True``, each block's input) and recomputes the
    rest, trading about one more forward pass of the blocks for most of their activation
    memory (benchmarks/RESULTS.md). Outputs and gradients are unchanged.

    Every JAX transformation works through the model (``jit``, ``vmap``, ``grad``,
    ``jvp``, ``jacfwd``, ``hessian``, ``linearize``, ``scan``, ``checkpoint``), with one
    exception: ``scan_layers=False`` with ``remat`` enabled is reverse mode only
    (see :func:`~flax_ln.models.remat.remat_in_backward`); use ``scan_layers=True`` for forward mode with remat.

    Call ``model.eval()`` to switch dropout off (``model.train()`` to switch it back).

    Token ids (``idx``; ``targets``, which may also be ``config.ignore_index``) must lie in
    ``[0, vocab_size)``. Concrete ids are checked before any compute (``ValueError``); traced
    ids (under ``jit``) only with ``debug_checks=True``, through ``checkify``; otherwise a
    negative id wraps around and an id >= vocab_size gives NaN (:mod:`flax_ln.models.checks`).

    Args:
      config: the :class:`GPTConfig`, or anything :meth:`GPTConfig.from_any` takes; converted
        once here and passed on to every block.
      scan_layers: stack the blocks and scan over them.
      remat: rematerialise each block in the backward pass: ``False`` (off), ``True``
        (``jax.checkpoint_policies.nothing_saveable``) or any ``jax.checkpoint`` policy.
      dtype: compute dtype, e.g. ``jnp.bfloat16``; norm statistics, attention softmax and
        the loss stay at least float32. Logits come out in this dtype.
      param_dtype: parameter dtype.
      precision: matmul precision.
      debug_checks: also check the values of traced token ids, with ``jax.experimental.checkify``
        (wrap the jitted function in ``checkify.checkify``).
      rngs: ``params`` and ``dropout`` randomness.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        scan_layers: bool = False,
        remat=False,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        debug_checks: bool = False,
        rngs: nnx.Rngs,
    ):
        remat_policy(remat)  # validate early
        self.config = config = GPTConfig.from_any(config)
        self.debug_checks = debug_checks
        self.scan_layers = scan_layers
        self.remat = remat
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        init, _ = _init_fns(config)
        opts = dict(dtype=dtype, param_dtype=param_dtype, precision=precision)
        make_block = functools.partial(Block, config, **opts)
        h: nnx.Module  # the blocks: stacked (scan_layers) or a list
        if scan_layers:
            h = nnx.vmap(lambda r: make_block(rngs=r))(_split(rngs, config.n_layer))
        else:
            h = nnx.List([make_block(rngs=rngs) for _ in range(config.n_layer)])
        embed = functools.partial(nnx.Embed, embedding_init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.transformer = nnx.Dict(
            wte=embed(config.vocab_size, config.n_embd),
            wpe=embed(config.block_size, config.n_embd),
            drop=Dropout(config.embd_pdrop, rngs=rngs),
            h=h,
            ln_f=TorchLayerNorm(config.n_embd, dtype=dtype, param_dtype=param_dtype),
        )
        self.lm_head = _linear(config.n_embd, config.vocab_size, init, use_bias=False, rngs=rngs, **opts)

    def __call__(
        self, idx: Int[Array, "B T"], targets: Int[Array, "B T"] | None = None
    ) -> tuple[Float[Array, "B T V"], Float[Array, ""] | None]:
        idx = self._check_ids(idx, "idx", "GPT")
        if targets is not None:
            targets = self._check_ids(targets, "targets", "GPT", ignore=("ignore_index", self.config.ignore_index))
            if targets.shape != idx.shape:
                raise ValueError(f"GPT: targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
        hidden, _ = self._hidden(idx, None, 0)
        # The logits come from lm_head itself, so that the parity engine's capture sees the call;
        # under jit XLA computes the product once (CSE), or not at all when only the loss is used.
        logits = self.lm_head(hidden)  # (B, T, V)
        loss = None if targets is None else head_cross_entropy(self.lm_head, hidden, targets, self.config.ignore_index)
        return logits, loss

    def init_cache(self, batch_size: int, dtype=None, *, length: int | None = None) -> KVCache:
        """A zeroed :class:`KVCache` for ``batch_size`` sequences of up to ``length`` tokens.

        Each cached token costs every later step a read of its keys and values, so a
        sequence known to stay shorter than ``block_size`` decodes faster with a cache of
        just its length (:func:`~flax_ln.models.sampling.generate` does this).

        Args:
          batch_size: number of sequences B.
          dtype: cache dtype; default the model's compute dtype, else its parameter dtype.
          length: number of positions S, 1 <= S <= block_size; ``None``: ``block_size``.
        """
        c = self.config
        length = c.block_size if length is None else length
        if not isinstance(length, int) or not 1 <= length <= c.block_size:
            raise ValueError(
                f"GPT.init_cache: length must be an int in [1, block_size={c.block_size}] or None, got {length!r}"
            )
        dtype = dtype or self.dtype or self.param_dtype
        shape = (c.n_layer, batch_size, c.n_head, length, c.head_size)  # (L, B, nh, S, hs)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def decode(self, idx: Int[Array, "B T"], cache: KVCache, pos) -> tuple[Float[Array, "B T V"], KVCache]:
        """Logits of ``idx`` placed at absolute positions ``pos..pos+T-1``, reading and extending ``cache``.

        The cache (from :meth:`init_cache`) must hold the keys/values of positions
        ``0..pos-1`` of the same sequences (e.g. from earlier ``decode`` calls starting at
        0). ``pos + T`` must not exceed the cache's length S (``block_size`` by default);
        that is checked only when ``pos`` is a Python int (a traced ``pos`` beyond it
        would be clamped by ``dynamic_update_slice``, silently).
        """
        idx = self._check_ids(idx, "idx", "GPT.decode")
        length = cache.k.shape[3]
        if isinstance(pos, int) and not 0 <= pos <= length - idx.shape[1]:
            limit = f"block_size {length}" if length == self.config.block_size else f"the cache's length {length}"
            raise ValueError(
                f"GPT.decode: positions {pos}..{pos + idx.shape[1] - 1} do not fit {limit}; recompute on "
                f"the last block_size tokens instead, or make a longer cache with init_cache(length=...)"
            )
        return self._forward(idx, cache, pos)

    def _check_ids(self, ids, name: str, owner: str, *, any_length: bool = False, ignore=None) -> jax.Array:
        """``ids`` checked by :func:`~flax_ln.models.checks.check_token_ids` against this model's vocabulary.

        At most ``block_size`` tokens unless ``any_length``; ``ignore`` names one more legal value.
        """
        c = self.config
        return check_token_ids(
            ids,
            name,
            owner=owner,
            vocab=c.vocab_size,
            max_len=None if any_length else c.block_size,
            limit_name="block_size",
            crop_hint=True,
            ignore=ignore,
            debug=self.debug_checks,
        )

    def _forward(self, idx, cache: KVCache | None, pos, *, last_only: bool = False):
        """``(logits, cache)`` of ``idx`` at positions ``pos..``; only the last position's logits
        (B, 1, V) with ``last_only`` (sampling needs no more, and the head is a large share of a prefill)."""
        hidden, cache = self._hidden(idx, cache, pos, last_only=last_only)
        return self.lm_head(hidden), cache

    def _hidden(self, idx, cache: KVCache | None, pos, *, last_only: bool = False):
        """``(ln_f(x), cache)``: :meth:`_forward` without the head, (B, T or 1, C)."""
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(pos + jnp.arange(idx.shape[1])))  # (B, T, C)
        policy = remat_policy(self.remat)
        if self.scan_layers:
            x, cache = scan_blocks(t.h, x, cache, pos, policy)
        else:
            for i, block in enumerate(t.h):  # type: ignore[arg-type]  # nnx.Dict members are typed Module
                if cache is None and policy is not None:
                    x = remat_block(block, x, pos, policy)
                    continue
                x, cache = block.attend(x, cache, pos, i)
        if last_only:
            x = x[:, -1:]  # (B, 1, C)
        return t.ln_f(x), cache


__getattr__ = module_getattr(  # deprecated aliases of names this module had in 0.1.0, see CHANGELOG.md
    __name__,
    {
        "checkpoint": "flax_ln.models.remat.remat_in_backward",
        "generate": "flax_ln.models.sampling.generate",
    },
    globals(),
)
