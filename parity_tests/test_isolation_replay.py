"""Isolation replays the port's own call truthfully: on the module's state as the call found it (a KV cache whose
index moves), with each floating argument replaced by the torch value it stands for (by provenance: a
cross-attention's keys and values passed by keyword take torch's encoder output), Python values as they were
(a ``bool`` flag stays a ``bool``), inside ``nn.remat``, through every method (a tied head's ``attend``), and one
module that cannot run alone skips only itself. Small purpose-built ports, each planted with one mistake, in
float32 and float64; every one of them blamed the wrong module before.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx
from torch_weights import randomized

from flax_ln.convert import KeyMap
from flax_ln.parity import Linen, compare_modules, compare_tensors

VOCAB, WIDTH, HEADS, HEAD, SEQ, BATCH, FEATURES = 16, 8, 2, 4, 5, 2, 6
DTYPES = ["float32", "float64"]


def culprits(report) -> tuple[list[str], list[str]]:
    return report.isolation.culprits, report.isolation.flax_culprits


# --- a language model whose attention writes a KV cache and masks by the cache's index ----------------------------


class TorchAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, HEAD).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, n, T, h)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2) * HEAD**-0.5).masked_fill(~causal, float("-inf"))  # (B, n, T, T)
        return self.o((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, WIDTH))  # (B, T, n*h)


class TorchLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = torch.nn.LayerNorm(WIDTH), TorchAttention()

    def forward(self, x):
        return x + self.attn(self.norm(x))


class TorchLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(TorchLayer() for _ in range(2))
        self.final_norm = torch.nn.LayerNorm(WIDTH)
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.final_norm(x))


class KVCache(nnx.Module):
    """One layer's keys, values and write index, made by the model for each forward and written by its attention."""

    def __init__(self, dtype):
        self.keys = nnx.Cache(jnp.zeros((BATCH, 2 * SEQ, HEADS, HEAD), dtype))  # (B, S, n, h)
        self.values = nnx.Cache(jnp.zeros((BATCH, 2 * SEQ, HEADS, HEAD), dtype))  # (B, S, n, h)
        self.index = nnx.Cache(jnp.array(0, jnp.int32))


class CachedAttention(nnx.Module):
    """Writes k and v into the cache at its index and masks every slot past a query's own position (the module's
    own call counter advances too): a call made again on the advanced cache would let every query see every key."""

    def __init__(self, dtype, *, rngs):
        linear = dict(use_bias=False, param_dtype=dtype, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(WIDTH, WIDTH, **linear) for _ in range(4))

    def __call__(self, x, cache: KVCache):
        b, t, _ = x.shape
        q, k, v = (p(x).reshape(b, t, HEADS, HEAD) for p in (self.q, self.k, self.v))  # (B, T, n, h)
        at = cache.index[...]
        start = (jnp.zeros_like(at), at, jnp.zeros_like(at), jnp.zeros_like(at))
        cache.keys[...] = jax.lax.dynamic_update_slice(cache.keys[...], k, start)
        cache.values[...] = jax.lax.dynamic_update_slice(cache.values[...], v, start)
        cache.index[...] = at + t
        visible = jnp.arange(2 * SEQ)[None, :] <= (at + jnp.arange(t))[:, None]  # (T, S)
        scores = jnp.einsum("btnh,bsnh->bnts", q, cache.keys[...]) * HEAD**-0.5  # (B, n, T, S)
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), -1)
        return self.o(jnp.einsum("bnts,bsnh->btnh", probs, cache.values[...]).reshape(b, t, WIDTH))  # (B, T, n*h)


class Block(nnx.Module):
    def __init__(self, dtype, *, rngs):
        self.ln = nnx.LayerNorm(WIDTH, epsilon=1e-5, param_dtype=dtype, rngs=rngs)
        self.attention = CachedAttention(dtype, rngs=rngs)

    def __call__(self, x, cache):
        return x + self.attention(self.ln(x), cache=cache)


class CachedLM(nnx.Module):
    def __init__(self, dtype):
        rngs, self.dtype = nnx.Rngs(0), getattr(jnp, dtype)
        self.tokens = nnx.Embed(VOCAB, WIDTH, param_dtype=self.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(self.dtype, rngs=rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, param_dtype=self.dtype, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, use_bias=False, param_dtype=self.dtype, rngs=rngs)

    def __call__(self, ids):
        x = self.tokens(ids)
        for block in self.blocks:
            x = block(x, KVCache(self.dtype))
        return self.head(self.norm(x))


LM_MAP = KeyMap(
    [
        (r"embed\.weight", "tokens.embedding", None),
        (r"layers\.(\d+)\.norm\.weight", r"blocks.\1.ln.scale", None),
        (r"layers\.(\d+)\.norm\.bias", r"blocks.\1.ln.bias", None),
        (r"layers\.(\d+)\.attn\.(q|k|v|o)\.weight", r"blocks.\1.attention.\2.kernel", "o i -> i o"),
        (r"final_norm\.weight", "norm.scale", None),
        (r"final_norm\.bias", "norm.bias", None),
        (r"lm_head\.weight", "head.kernel", "v d -> d v"),
    ]
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_with_a_kv_cache_is_replayed_on_the_cache_it_found(dtype):
    """A norm eps planted in the last layer: isolation names that norm only; each attention's own error is the
    error of the same module run directly, on a fresh cache, on torch's input (and the port's own model keeps the
    cache its run left)."""
    ids = np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ))
    torch_lm = randomized(TorchLM(), dtype)
    with jax.enable_x64(dtype == "float64"):
        port = CachedLM(dtype)
        port.blocks[1].ln.epsilon = 1e-1
        report = compare_modules(torch_lm, port, (ids,), weights=LM_MAP, dtype=dtype)
        assert culprits(report) == (["layers.1.norm"], ["blocks.1.ln"]), str(report)
        assert report.first_divergence.module == "layers.1.norm", str(report)
        seen = {}
        hooks = [
            torch_lm.layers[i].attn.register_forward_hook(lambda m, a, o, i=i: seen.update({i: (a[0], o)}))
            for i in (0, 1)
        ]
        with torch.no_grad():
            torch_lm(torch.as_tensor(ids))
        for hook in hooks:
            hook.remove()
        isolated = {r.name: r for r in report.isolation.results}
        for i in (0, 1):
            direct = port.blocks[i].attention(jnp.asarray(seen[i][0].numpy()), KVCache(port.dtype))  # a fresh cache
            tolerance = isolated[f"layers.{i}.attn"].tolerance  # the engine's, for a module output
            alone = compare_tensors("attn", "module output", direct, seen[i][1].numpy(), tolerance)
            assert isolated[f"layers.{i}.attn"].relative_error == alone.relative_error, str(report)
            assert isolated[f"layers.{i}.attn"].passed


# --- an encoder-decoder whose cross-attention takes keys and values by keyword ----------------------------------------


class TorchCross(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, hidden_states, key_value_states=None):
        q, k, v = self.q(hidden_states), self.k(key_value_states), self.v(key_value_states)
        probs = torch.softmax(q @ k.transpose(-1, -2) * WIDTH**-0.5, -1)  # (B, T, S)
        return self.o(probs @ v)


class TorchEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.norm = torch.nn.Linear(FEATURES, WIDTH), torch.nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(torch.tanh(self.proj(x)))


class TorchSeq2Seq(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.embed = TorchEncoder(), torch.nn.Embedding(VOCAB, WIDTH)
        self.dec_norm, self.encoder_attn = torch.nn.LayerNorm(WIDTH), TorchCross()
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, features, ids):
        enc = self.encoder(features)
        x = self.embed(ids)
        x = x + self.encoder_attn(self.dec_norm(x), key_value_states=enc)
        return self.lm_head(x)


class CrossAttention(nnx.Module):
    def __init__(self, dtype, *, rngs):
        self.q, self.k, self.v, self.o = (nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs) for _ in range(4))

    def __call__(self, inputs_q, inputs_k, inputs_v):
        probs = jax.nn.softmax(self.q(inputs_q) @ jnp.swapaxes(self.k(inputs_k), -1, -2) * WIDTH**-0.5, -1)  # (B, T, S)
        return self.o(probs @ self.v(inputs_v))


class Encoder(nnx.Module):
    def __init__(self, dtype, eps, *, rngs):
        self.linear = nnx.Linear(FEATURES, WIDTH, param_dtype=dtype, rngs=rngs)
        self.ln = nnx.LayerNorm(WIDTH, epsilon=eps, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.ln(jnp.tanh(self.linear(x)))


class Seq2Seq(nnx.Module):
    def __init__(self, dtype, eps):
        rngs, dtype = nnx.Rngs(0), getattr(jnp, dtype)
        self.enc = Encoder(dtype, eps, rngs=rngs)
        self.tokens = nnx.Embed(VOCAB, WIDTH, param_dtype=dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, param_dtype=dtype, rngs=rngs)
        self.cross = CrossAttention(dtype, rngs=rngs)
        self.out = nnx.Linear(WIDTH, VOCAB, param_dtype=dtype, rngs=rngs)

    def __call__(self, features, ids):
        enc = self.enc(features)
        x = self.tokens(ids)
        return self.out(x + self.cross(inputs_q=self.norm(x), inputs_k=enc, inputs_v=enc))


SEQ2SEQ_MAP = KeyMap(
    [
        (r"encoder\.proj\.weight", "enc.linear.kernel", "o i -> i o"),
        (r"encoder\.proj\.bias", "enc.linear.bias", None),
        (r"encoder\.norm\.weight", "enc.ln.scale", None),
        (r"encoder\.norm\.bias", "enc.ln.bias", None),
        (r"embed\.weight", "tokens.embedding", None),
        (r"dec_norm\.weight", "norm.scale", None),
        (r"dec_norm\.bias", "norm.bias", None),
        (r"encoder_attn\.(q|k|v|o)\.weight", r"cross.\1.kernel", "o i -> i o"),
        (r"encoder_attn\.(q|k|v|o)\.bias", r"cross.\1.bias", None),
        (r"lm_head\.weight", "out.kernel", "o i -> i o"),
        (r"lm_head\.bias", "out.bias", None),
    ]
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_attention_by_keyword_takes_torchs_encoder_output(dtype):
    """The encoder's norm eps differs: the cross-attention's keys and values (by keyword) take torch's encoder
    output by provenance, so the faithful cross-attention is not a culprit; the encoder's norm is."""
    rng = np.random.default_rng(2)
    features, ids = rng.standard_normal((BATCH, 3, FEATURES)).astype(dtype), rng.integers(0, VOCAB, (BATCH, SEQ))
    with jax.enable_x64(dtype == "float64"):
        report = compare_modules(
            randomized(TorchSeq2Seq(), dtype), Seq2Seq(dtype, 1e-1), (features, ids), weights=SEQ2SEQ_MAP, dtype=dtype
        )
    assert culprits(report) == (["encoder.norm"], ["enc.ln"]), str(report)
    cross = next(r for r in report.isolation.results if r.name == "encoder_attn")
    assert cross.passed and "encoder_attn" not in report.isolation.kept, str(report)


# --- Linen: activations by keyword, a Python bool flag, blocks in nn.remat --------------------------------------------


class TorchMix(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, gate):
        return torch.tanh(self.lin(x)) if gate else x


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mix = torch.nn.LayerNorm(WIDTH), TorchMix()

    def forward(self, x):
        return x + self.mix(self.norm(x), True)


class TorchStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LinenMix(linen.Module):
    param_dtype: jnp.dtype

    @linen.compact
    def __call__(self, *, x, gate):
        assert isinstance(gate, bool), f"gate must be a Python bool, got {type(gate).__name__}"  # as typeguard would
        return jnp.tanh(linen.Dense(WIDTH, param_dtype=self.param_dtype, name="lin")(x)) if gate else x


class LinenBlock(linen.Module):
    param_dtype: jnp.dtype
    eps: float

    @linen.compact
    def __call__(self, x):
        h = linen.LayerNorm(epsilon=self.eps, param_dtype=self.param_dtype, name="norm")(x)
        return x + LinenMix(self.param_dtype, name="mix")(x=h, gate=True)


class LinenStack(linen.Module):
    param_dtype: jnp.dtype
    eps: tuple[float, float]

    @linen.compact
    def __call__(self, x):
        for i, eps in enumerate(self.eps):
            x = linen.remat(LinenBlock)(self.param_dtype, eps, name=f"blocks_{i}")(x)
        return linen.Dense(WIDTH, param_dtype=self.param_dtype, name="head")(x)


STACK_MAP = KeyMap(
    [
        (r"blocks\.(\d+)\.norm\.weight", r"blocks_\1.norm.scale", None),
        (r"blocks\.(\d+)\.norm\.bias", r"blocks_\1.norm.bias", None),
        (r"blocks\.(\d+)\.mix\.lin\.weight", r"blocks_\1.mix.lin.kernel", "o i -> i o"),
        (r"blocks\.(\d+)\.mix\.lin\.bias", r"blocks_\1.mix.lin.bias", None),
        (r"head\.weight", "head.kernel", "o i -> i o"),
        (r"head\.bias", "head.bias", None),
    ]
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linen_keywords_a_bool_flag_and_remat_name_the_inner_module(dtype):
    """Block 1's norm eps differs, inside nn.remat: the calls inside the rematerialised blocks are recorded, the
    mix takes torch's activation by keyword and its flag as the bool it was, and block 1's norm is named."""
    x = np.random.default_rng(3).standard_normal((BATCH, SEQ, WIDTH)).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        module = LinenStack(getattr(jnp, dtype), (1e-5, 1e-1))
        variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, SEQ, WIDTH), dtype))
        report = compare_modules(
            randomized(TorchStack(), dtype), Linen(module, variables), (x,), weights=STACK_MAP, dtype=dtype
        )
    assert culprits(report) == (["blocks.1.norm"], ["blocks_1.norm"]), str(report)
    assert report.first_divergence.module == "blocks.1.norm", str(report)
    ran = {r.name for r in report.isolation.results}
    assert {"blocks.0.mix", "blocks.1.mix", "blocks.0.norm"} <= ran, str(report)


# --- a head tied to the embedding, called through attend --------------------------------------------------------------


class TorchTied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.mlp, self.norm = torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH)
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        x = self.embed_tokens(ids)
        return self.lm_head(self.norm(x + torch.tanh(self.mlp(x))))


class Embedder(nnx.Module):
    def __init__(self, dtype, *, rngs):
        self.table = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, WIDTH), dtype))

    def __call__(self, ids):
        return self.table[...][ids]

    def attend(self, x):
        return x @ self.table[...].T  # (B, T, V)


class TiedLM(nnx.Module):
    def __init__(self, dtype, eps):
        rngs, dtype = nnx.Rngs(0), getattr(jnp, dtype)
        self.embedder = Embedder(dtype, rngs=rngs)
        self.ffn = nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs)
        self.final_ln = nnx.LayerNorm(WIDTH, epsilon=eps, param_dtype=dtype, rngs=rngs)

    def __call__(self, ids):
        x = self.embedder(ids)
        return self.embedder.attend(self.final_ln(x + jnp.tanh(self.ffn(x))))


TIED_MAP = KeyMap(
    [
        (r"embed_tokens\.weight", "embedder.table", None),
        (r"lm_head\.weight", "embedder.table", None),  # tied
        (r"mlp\.weight", "ffn.kernel", "o i -> i o"),
        (r"mlp\.bias", "ffn.bias", None),
        (r"norm\.weight", "final_ln.scale", None),
        (r"norm\.bias", "final_ln.bias", None),
    ]
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tied_head_through_attend_pairs_with_lm_head_and_the_final_norm_is_named(dtype):
    """The embedder's attend is a call of its own (embedder.attend), paired with torch's lm_head; the final norm,
    its eps planted, keeps its pair and is named on both sides."""
    ids = np.random.default_rng(4).integers(0, VOCAB, (BATCH, SEQ))
    with jax.enable_x64(dtype == "float64"):
        torch_model, port = randomized(TorchTied(), dtype), TiedLM(dtype, 1e-1)
        report = compare_modules(torch_model, port, (ids,), weights=TIED_MAP, dtype=dtype)
    assert report.module_pairs["lm_head"] == "embedder.attend", str(report)
    assert report.module_pairs["embed_tokens"] == "embedder", str(report)
    fd = report.first_divergence
    assert (fd.module, fd.flax_module, fd.between) == ("norm", "final_ln", None), str(report)
    assert culprits(report) == (["norm"], ["final_ln"]), str(report)


# --- a module that raises when called alone ---------------------------------------------------------------------------


class TorchPair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x):
        return self.c(self.b(self.a(x)) + x)


class Strict(linen.Module):
    """A dense layer that insists on the bfloat16 activations its parent rounds to: torch's float32 (float64)
    input, which isolation keeps unrounded, makes it raise."""

    param_dtype: jnp.dtype

    @linen.compact
    def __call__(self, x):
        assert x.dtype == jnp.bfloat16, f"expects bfloat16 activations, got {x.dtype}"
        kernel = self.param("kernel", linen.initializers.lecun_normal(), (WIDTH, WIDTH), self.param_dtype)
        bias = self.param("bias", linen.initializers.zeros, (WIDTH,), self.param_dtype)
        return x.astype(self.param_dtype) @ kernel + bias


class LinenPair(linen.Module):
    param_dtype: jnp.dtype

    @linen.compact
    def __call__(self, x):
        h = linen.Dense(WIDTH, param_dtype=self.param_dtype, name="a")(x)
        h = Strict(self.param_dtype, name="b")(h.astype(jnp.bfloat16))
        return linen.Dense(WIDTH, param_dtype=self.param_dtype, name="c")(h + x)


PAIR_MAP = KeyMap(
    [
        (r"(a|c)\.weight", r"\1.kernel", "o i -> i o"),
        (r"(a|c)\.bias", r"\1.bias", None),
        (r"b\.weight", "b.kernel", "o i -> i o"),
        (r"b\.bias", "b.bias", None),
    ]
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_module_that_raises_alone_skips_itself_and_its_siblings_are_isolated(dtype):
    x = np.random.default_rng(5).standard_normal((BATCH, SEQ, WIDTH)).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        module = LinenPair(getattr(jnp, dtype))
        variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, SEQ, WIDTH), dtype))
        report = compare_modules(
            randomized(TorchPair(), dtype), Linen(module, variables), (x,), weights=PAIR_MAP, dtype=dtype
        )
    assert not report.passed, str(report)
    assert "raised AssertionError: expects bfloat16" in report.isolation.skipped["b"], str(report)
    ran = {r.name: r for r in report.isolation.results}
    assert ran["a"].passed and ran["c"].passed, str(report)
