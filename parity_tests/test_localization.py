"""Localisation on ports that do not mirror torch: a mistake planted in each kind of place a real port has is named on
both sides by the first divergence and by isolated mode, through the port's key map alone (no ``modules=`` hint), in
float32 and float64.

The two small models here have the shapes that real published ports have and that used to mislead localisation:

* a language model (NNX) whose torch embedding scales inside its own ``forward`` while the port scales in the module
  around a bare ``nnx.Embed``; layers in an ``nnx.List``; attention with fused ``(B, T, n, h)`` projections
  (``nnx.LinearGeneral``) whose call takes a mask, a cache and ``rngs``; a GELU computed inline between two Linears;
* a small ConvNeXt-like image model (NNX and Linen), channels-last convolutions on square inputs where H = W = C, a
  stem in an ``nnx.Sequential`` (a Linen ``nn.Sequential``), and a torch block that permutes to channels-last itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx

import flax_ln.parity.localize.locate as localize
from flax_ln.convert import KeyMap
from flax_ln.parity import Linen, compare_modules
from flax_ln.parity.records.capture import WHOLE_MODEL

VOCAB, WIDTH, HEADS, HEAD, SEQ, BATCH = 32, 24, 3, 8, 6, 2  # sqrt(24) is not a bfloat16 number
CHANNELS, IMAGE, CLASSES = 4, 8, 5  # the stem halves the image: 4 x 4 x 4 activations, H = W = C


def randomized(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """Weights of unit scale (norm scales near 1): a planted difference shows at float32's tolerance too."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name or "ln_" in name else noise / (p[0].numel() ** 0.5 or 1.0))
    return model.to(getattr(torch, dtype)).eval()


# --- the language model ----------------------------------------------------------------------------------------------


class ScaledEmbedding(torch.nn.Embedding):
    """An embedding that scales by sqrt(width) inside its own forward (as Gemma's does)."""

    def forward(self, ids):
        return super().forward(ids) * WIDTH**0.5


class TorchAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, HEAD).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = (q @ k.transpose(-1, -2) / HEAD**0.5).masked_fill(~mask, float("-inf"))  # (B, n, T, T)
        out = torch.softmax(scores, -1) @ v  # (B, n, T, h)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, WIDTH))  # (B, T, n*h)


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            torch.nn.Linear(WIDTH, 2 * WIDTH),
            torch.nn.GELU(),
            torch.nn.Linear(2 * WIDTH, WIDTH),
        )

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TorchLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = (
            torch.nn.LayerNorm(WIDTH),
            TorchAttention(),
            torch.nn.LayerNorm(WIDTH),
            TorchMLP(),
        )

    def forward(self, x, mask):
        x = x + self.attn(x=self.ln_1(x), mask=mask)  # by keyword, as transformers calls its attention
        return x + self.mlp(self.ln_2(x))


class TorchLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = ScaledEmbedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(TorchLayer() for _ in range(2))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(self.norm(x))


class Attention(nnx.Module):
    """Fused heads: q, k, v give (B, T, n, h), the output projection takes them; a cache and rngs in the call."""

    def __init__(self, *, param_dtype, rngs):
        fused = dict(param_dtype=param_dtype, rngs=rngs)
        self.q, self.k, self.v = (nnx.LinearGeneral(WIDTH, (HEADS, HEAD), **fused) for _ in range(3))
        self.o = nnx.LinearGeneral((HEADS, HEAD), WIDTH, axis=(-2, -1), **fused)
        self.dropout = nnx.Dropout(0.0)
        self.scale = HEAD**-0.5

    def __call__(self, x, mask, *, cache, rngs=None):
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, n, h)
        k, v = jnp.concatenate([cache[0], k], 1), jnp.concatenate([cache[1], v], 1)  # (B, S, n, h), S = cached + T
        scores = jnp.where(mask, jnp.einsum("btnh,bsnh->bnts", q, k) * self.scale, -jnp.inf)  # (B, n, T, S)
        probs = self.dropout(jax.nn.softmax(scores, -1), rngs=rngs, deterministic=rngs is None)
        return self.o(jnp.einsum("bnts,bsnh->btnh", probs, v))  # (B, T, d)


class MLP(nnx.Module):
    """fc2(gelu(fc1(x))) with the GELU inline; ``approximate`` plants the tanh form, ``fc1_input`` a cast."""

    def __init__(self, *, param_dtype, rngs):
        self.fc1 = nnx.Linear(WIDTH, 2 * WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.fc2 = nnx.Linear(2 * WIDTH, WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.approximate = False
        self.traced_scale = 1.0  # a planted mistake that only a traced (jit) run makes
        self.fc1_input = None  # a dtype fc1's input is cast to

    def __call__(self, x):
        scale = self.traced_scale if isinstance(x, jax.core.Tracer) else 1.0
        hidden = self.fc1(x if self.fc1_input is None else x.astype(self.fc1_input)).astype(x.dtype)
        return self.fc2(jax.nn.gelu(hidden, approximate=self.approximate)) * scale


class Layer(nnx.Module):
    def __init__(self, *, param_dtype, rngs):
        norm = dict(epsilon=1e-5, param_dtype=param_dtype, rngs=rngs)
        self.ln_1, self.ln_2 = nnx.LayerNorm(WIDTH, **norm), nnx.LayerNorm(WIDTH, **norm)
        self.attn, self.mlp = Attention(param_dtype=param_dtype, rngs=rngs), MLP(param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, mask, *, cache, rngs=None):
        x = x + self.attn(self.ln_1(x), mask, cache=cache, rngs=rngs)
        return x + self.mlp(self.ln_2(x))


class Embedder(nnx.Module):
    """A bare ``nnx.Embed`` (``table``) and the scale; ``scale_here=False`` leaves the scaling to the model."""

    def __init__(self, *, param_dtype, rngs):
        self.table = nnx.Embed(VOCAB, WIDTH, param_dtype=param_dtype, rngs=rngs)
        self.scale, self.scale_here = WIDTH**0.5, True

    def __call__(self, ids):
        x = self.table(ids)
        return x * self.scale if self.scale_here else x


class LM(nnx.Module):
    def __init__(self, dtype, *, rngs=None):
        rngs, param_dtype = rngs or nnx.Rngs(0), getattr(jnp, dtype)
        self.embedder = Embedder(param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([Layer(param_dtype=param_dtype, rngs=rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, param_dtype=param_dtype, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.rngs = nnx.Rngs(dropout=1)

    def __call__(self, ids):
        mask = jnp.tril(jnp.ones((ids.shape[1], ids.shape[1]), bool))
        x = self.embedder(ids)
        if not self.embedder.scale_here:
            x = x * self.embedder.scale
        empty = jnp.zeros((ids.shape[0], 0, HEADS, HEAD), x.dtype)  # (B, 0, n, h): nothing cached
        for layer in self.layers:
            x = layer(x, mask, cache=(empty, empty), rngs=self.rngs)
        return self.head(self.norm(x))


_LAYER = r"layers\.(\d+)\."


def lm_key_map(q_heads: str = "n h") -> KeyMap:
    """The LM port's key map; ``q_heads`` is how layer 0's q rows split into heads (``"h n"`` plants a scramble)."""
    qkv = r"layers\.(?!0\.attn\.q_)(\d+)\.attn\.(q|k|v)_proj\."  # every q, k, v but layer 0's q
    return KeyMap(
        [
            (r"embed_tokens\.weight", "embedder.table.embedding", None),
            (r"layers\.0\.attn\.q_proj\.weight", "layers.0.attn.q.kernel", f"({q_heads}) d -> d n h"),
            (r"layers\.0\.attn\.q_proj\.bias", "layers.0.attn.q.bias", f"({q_heads}) -> n h"),
            (qkv + "weight", r"layers.\1.attn.\2.kernel", "(n h) d -> d n h"),
            (qkv + "bias", r"layers.\1.attn.\2.bias", "(n h) -> n h"),
            (_LAYER + r"attn\.o_proj\.weight", r"layers.\1.attn.o.kernel", "d (n h) -> n h d"),
            (_LAYER + r"attn\.o_proj\.bias", r"layers.\1.attn.o.bias", None),
            (_LAYER + r"(ln_1|ln_2)\.weight", r"layers.\1.\2.scale", None),
            (_LAYER + r"(ln_1|ln_2)\.bias", r"layers.\1.\2.bias", None),
            (_LAYER + r"mlp\.(fc1|fc2)\.weight", r"layers.\1.mlp.\2.kernel", "o i -> i o"),
            (_LAYER + r"mlp\.(fc1|fc2)\.bias", r"layers.\1.mlp.\2.bias", None),
            (r"norm\.weight", "norm.scale", None),
            (r"norm\.bias", "norm.bias", None),
            (r"lm_head\.weight", "head.kernel", "v d -> d v"),
        ]
    )


def lm_parity(dtype, plant=None, key_map=None):
    """The LM port against its torch twin; ``plant(port)`` changes the port before the comparison fills it."""
    ids = np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ))
    with jax.enable_x64(dtype == "float64"):
        port = nnx.eval_shape(lambda: LM(dtype))
        if plant is not None:
            plant(port)
        return compare_modules(randomized(TorchLM(), dtype), port, (ids,), weights=key_map or lm_key_map(), dtype=dtype)


def named(report, torch_path, flax_path, between=None):
    """The first divergence names ``torch_path``/``flax_path`` (and ``between``), and isolated mode the same."""
    fd = report.first_divergence
    assert not report.passed and fd is not None, str(report)
    assert (fd.module, fd.flax_module, fd.between) == (torch_path, flax_path, between), str(report)
    assert (report.isolation.culprits, report.isolation.flax_culprits) == ([torch_path], [flax_path]), str(report)
    assert report.localization_note is None, report.localization_note


DTYPES = ["float32", "float64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lm_port_passes_and_pairs_the_embedding_by_its_output(dtype):
    """The embedding's parameters are held by the bare nnx.Embed and by the Embedder around it; torch's embedding
    scales, so its twin is the Embedder. Every attention module is run alone through the port's own call."""
    report = lm_parity(dtype)
    assert report.passed, str(report)


def _plant_ln_eps(port):
    port.layers[1].ln_2.epsilon = 1e-1


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_norm_eps_is_named_and_the_scaled_embedding_is_not_blamed(dtype):
    report = lm_parity(dtype, _plant_ln_eps)
    named(report, "layers.1.ln_2", "layers.1.ln_2")
    assert "embed_tokens" not in report.isolation.skipped


def _plant_embedding_scale(port):
    port.embedder.scale = float(jnp.bfloat16(WIDTH**0.5))  # rounded to bfloat16: 1.5e-3 relative


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rounded_embedding_scale_is_named_at_the_module_that_scales(dtype):
    report = lm_parity(dtype, _plant_embedding_scale)
    named(report, "embed_tokens", "embedder")


def _plant_scale_in_the_model(port):
    port.embedder.scale_here = False
    _plant_embedding_scale(port)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_embedding_scaled_by_its_parent_is_unpaired_and_the_parent_code_is_named(dtype):
    """The port scales in the model's own code, around a bare nnx.Embed: torch's embedding has no flax module whose
    output is its output, so it is unpaired (and listed), and the gap is the model's code before the first layer."""
    report = lm_parity(dtype, _plant_scale_in_the_model)
    named(report, WHOLE_MODEL, WHOLE_MODEL, between=(None, "layers.0"))
    assert report.first_divergence.flax_between == (None, "layers.0")
    assert "no flax module's output is its output" in report.module_skipped["embed_tokens"]
    assert "in (whole model) <-> (whole model), between its start and layers.0: its own code" in str(report)


def _plant_attention_scale(port):
    port.layers[1].attn.scale = WIDTH**-0.5  # the model width instead of the head width


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_with_a_cache_mask_and_rngs_is_isolated_through_the_ports_own_call(dtype):
    """The scale is the attention's own code, between its projections: run alone through the port's own call (a
    mask, a cache and rngs the port's; only the activation torch's), the attention is named, its projections not."""
    report = lm_parity(dtype, _plant_attention_scale)
    named(report, "layers.1.attn", "layers.1.attn", between=("layers.1.attn.v_proj", "layers.1.attn.o_proj"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_heads_loaded_in_the_wrong_order_are_named_in_the_attention(dtype):
    """Layer 0's q kernel loaded as (h n) instead of (n h): q's (B, T, n, h) output is compared with torch's
    (B, T, n*h) in the layout torch's own code gives it (``.view(b, t, HEADS, HEAD)``), not the key map's, which is
    the bug: the q projection is named, not the attention's code after it."""
    report = lm_parity(dtype, key_map=lm_key_map(q_heads="h n"))
    named(report, "layers.0.attn.q_proj", "layers.0.attn.q")
    assert "layers.0.attn.q_proj" not in report.module_skipped


def _plant_tanh_gelu(port):
    port.layers[0].mlp.approximate = True


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_activation_inline_between_two_linears_is_named_between_them(dtype):
    """torch's GELU is a module of its own (``act``), the port's inline between fc1 and fc2: torch's side is ``act``,
    the port's the MLP's own code between the two Linears."""
    report = lm_parity(dtype, _plant_tanh_gelu)
    named(report, "layers.0.mlp.act", "layers.0.mlp")
    assert report.first_divergence.flax_between == ("layers.0.mlp.fc1", "layers.0.mlp.fc2")
    assert report.isolation.own_code == []  # torch's disagreeing output is its act module's own
    line = "layers.0.mlp.act <-> in layers.0.mlp, between layers.0.mlp.fc1 and layers.0.mlp.fc2: its own code"
    assert line in str(report)


def _plant_bfloat16_input(port):
    port.layers[1].mlp.fc1_input = jnp.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cast_to_bfloat16_before_a_child_is_named_in_the_parent_not_the_child(dtype):
    """The MLP rounds fc1's input to bfloat16: fc1's input already differs (a bfloat16 activation is recorded and
    compared), and fc1 run alone on torch's input, not narrowed to the port's bfloat16, agrees; the cast is the
    MLP's code before fc1."""
    report = lm_parity(dtype, _plant_bfloat16_input)
    named(report, "layers.1.mlp", "layers.1.mlp", between=(None, "layers.1.mlp.fc1"))
    assert "layers.1.mlp.fc1" in [r.name for r in report.module_inputs if not r.passed]


def test_an_error_in_localisation_keeps_the_verdict_and_every_result(monkeypatch):
    """Pairing raises: the report still holds the verdict and every tensor's result, and says what failed."""

    def broken(*args, **kwargs):
        raise RuntimeError("pairing broke")

    monkeypatch.setattr(localize, "pair_modules", broken)
    report = lm_parity("float32", _plant_ln_eps)
    assert not report.passed and report.first_divergence is None and report.isolation is None
    assert {r.name for r in report.results} >= {"output", "embed_tokens.weight", "lm_head.weight"}
    assert not report["output"].passed
    assert "pairing torch's modules with flax's failed (RuntimeError: pairing broke)" in report.localization_note
    assert "pairing broke" in str(report) and "pairing broke" in report.to_json()["localization_note"]


def _plant_traced_only(port):
    port.layers[0].mlp.traced_scale = 1.01


def test_a_failure_the_eager_localisation_run_does_not_reproduce_is_said_so():
    """The port differs only when traced (the verdict's compiled run): localisation, which records an eager run, sees
    every module agree, and the report says that it did not reproduce the failure rather than naming nothing."""
    report = lm_parity("float64", _plant_traced_only)
    assert not report.passed and report.first_divergence is None
    assert "does not reproduce the failure of output" in report.localization_note
    assert "does not reproduce" in str(report)


# --- the image model -------------------------------------------------------------------------------------------------


class LayerNorm2d(torch.nn.LayerNorm):
    """A LayerNorm over the channels of an NCHW activation: it permutes to channels-last and back itself."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class TorchBlock(torch.nn.Module):
    """ConvNeXt's block: a depthwise conv, then channels-last (permuted here) norm, fc1, GELU, fc2, and back."""

    def __init__(self):
        super().__init__()
        self.dwconv = torch.nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, groups=CHANNELS)
        self.norm = torch.nn.LayerNorm(CHANNELS)
        self.fc1, self.fc2 = torch.nn.Linear(CHANNELS, 2 * CHANNELS), torch.nn.Linear(2 * CHANNELS, CHANNELS)

    def forward(self, x):
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))  # (B, H, W, C)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(y))).permute(0, 3, 1, 2)  # (B, C, H, W)


class TorchConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = torch.nn.Sequential(torch.nn.Conv2d(3, CHANNELS, 2, stride=2), LayerNorm2d(CHANNELS))
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(2))
        self.head_norm, self.head = torch.nn.LayerNorm(CHANNELS), torch.nn.Linear(CHANNELS, CLASSES)

    def forward(self, x):
        x = self.embeddings(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.head_norm(x.mean((2, 3))))


class Block(nnx.Module):
    def __init__(self, *, param_dtype, rngs):
        dense = dict(param_dtype=param_dtype, rngs=rngs)
        self.dwconv = nnx.Conv(
            CHANNELS, CHANNELS, (3, 3), padding=((1, 1), (1, 1)), feature_group_count=CHANNELS, **dense
        )
        self.norm = nnx.LayerNorm(CHANNELS, epsilon=1e-5, **dense)
        self.fc1, self.fc2 = nnx.Linear(CHANNELS, 2 * CHANNELS, **dense), nnx.Linear(2 * CHANNELS, CHANNELS, **dense)

    def __call__(self, x):  # (B, H, W, C)
        return x + self.fc2(jax.nn.gelu(self.fc1(self.norm(self.dwconv(x))), approximate=False))


class ConvNet(nnx.Module):
    def __init__(self, dtype, *, rngs=None):
        rngs, param_dtype = rngs or nnx.Rngs(0), getattr(jnp, dtype)
        dense = dict(param_dtype=param_dtype, rngs=rngs)
        self.stem = nnx.Sequential(
            nnx.Conv(3, CHANNELS, (2, 2), strides=2, padding="VALID", **dense),
            nnx.LayerNorm(CHANNELS, epsilon=1e-5, **dense),
        )
        self.blocks = nnx.List([Block(**dense) for _ in range(2)])
        self.head_norm = nnx.LayerNorm(CHANNELS, epsilon=1e-5, **dense)
        self.head = nnx.Linear(CHANNELS, CLASSES, **dense)

    def __call__(self, x):  # (B, H, W, 3)
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.head_norm(x.mean((1, 2))))


class LinenBlock(linen.Module):
    eps: float = 1e-5
    padding: tuple = ((1, 1), (1, 1))
    param_dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x):  # (B, H, W, C)
        dense = dict(param_dtype=self.param_dtype)
        y = linen.Conv(CHANNELS, (3, 3), padding=self.padding, feature_group_count=CHANNELS, name="dwconv", **dense)(x)
        y = linen.LayerNorm(epsilon=self.eps, name="norm", **dense)(y)
        y = linen.Dense(2 * CHANNELS, name="fc1", **dense)(y)
        return x + linen.Dense(CHANNELS, name="fc2", **dense)(jax.nn.gelu(y, approximate=False))


class LinenStem(linen.Module):
    """A patchify conv and a norm held in a list (``layers_0``, ``layers_1``), called in order."""

    eps: float = 1e-5
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        dense = dict(param_dtype=self.param_dtype)
        conv = linen.Conv(CHANNELS, (2, 2), strides=2, padding="VALID", **dense)
        self.layers = [conv, linen.LayerNorm(epsilon=self.eps, **dense)]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class LinenConvNet(linen.Module):
    stem_eps: float = 1e-5
    block_eps: tuple = (1e-5, 1e-5)
    block_padding: tuple = (((1, 1), (1, 1)), ((1, 1), (1, 1)))
    param_dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x):  # (B, H, W, 3)
        dense = dict(param_dtype=self.param_dtype)
        x = LinenStem(self.stem_eps, self.param_dtype, name="stem")(x)
        for i in range(2):
            x = LinenBlock(self.block_eps[i], self.block_padding[i], self.param_dtype, name=f"blocks_{i}")(x)
        return linen.Dense(CLASSES, name="head", **dense)(
            linen.LayerNorm(epsilon=1e-5, name="head_norm", **dense)(x.mean((1, 2)))
        )


def conv_key_map(stem: str, block: str) -> KeyMap:
    """The image model's key map; ``stem``/``block`` spell the port's paths (NNX ``stem.layers.0``/``blocks.0``,
    Linen ``stem.layers_0``/``blocks_0``)."""
    conv, norm = stem.format(0), stem.format(1)
    at = block.format(r"\1")
    return KeyMap(
        [
            (r"embeddings\.0\.weight", f"{conv}.kernel", "o i kh kw -> kh kw i o"),
            (r"embeddings\.0\.bias", f"{conv}.bias", None),
            (r"embeddings\.1\.weight", f"{norm}.scale", None),
            (r"embeddings\.1\.bias", f"{norm}.bias", None),
            (r"blocks\.(\d+)\.dwconv\.weight", f"{at}.dwconv.kernel", "o i kh kw -> kh kw i o"),
            (r"blocks\.(\d+)\.dwconv\.bias", f"{at}.dwconv.bias", None),
            (r"blocks\.(\d+)\.norm\.weight", f"{at}.norm.scale", None),
            (r"blocks\.(\d+)\.norm\.bias", f"{at}.norm.bias", None),
            (r"blocks\.(\d+)\.(fc1|fc2)\.weight", f"{at}.\\2.kernel", "o i -> i o"),
            (r"blocks\.(\d+)\.(fc1|fc2)\.bias", f"{at}.\\2.bias", None),
            (r"head_norm\.weight", "head_norm.scale", None),
            (r"head_norm\.bias", "head_norm.bias", None),
            (r"head\.weight", "head.kernel", "o i -> i o"),
            (r"head\.bias", "head.bias", None),
        ]
    )


NNX_CONV_MAP = conv_key_map("stem.layers.{}", "blocks.{}")
LINEN_CONV_MAP = conv_key_map("stem.layers_{}", "blocks_{}")


def conv_parity(kind, dtype, **plants):
    """The NNX or Linen image port against its torch twin, on a square image; ``plants`` go to the port:
    ``stem_eps``, ``block_eps`` (block 1's norm), ``block_padding`` (block 0's depthwise conv)."""
    x = np.random.default_rng(2).standard_normal((BATCH, 3, IMAGE, IMAGE)).astype(dtype)  # NCHW, torch's layout
    with jax.enable_x64(dtype == "float64"):
        if kind == "nnx":
            port = nnx.eval_shape(lambda: ConvNet(dtype))
            if "stem_eps" in plants:
                port.stem.layers[1].epsilon = plants["stem_eps"]
            if "block_eps" in plants:
                port.blocks[1].norm.epsilon = plants["block_eps"]
            if "block_padding" in plants:
                port.blocks[0].dwconv.padding = plants["block_padding"]
            flax, key_map = port, NNX_CONV_MAP
        else:
            fields = dict(param_dtype=getattr(jnp, dtype))
            fields.update(stem_eps=plants["stem_eps"]) if "stem_eps" in plants else None
            fields.update(block_eps=(1e-5, plants["block_eps"])) if "block_eps" in plants else None
            if "block_padding" in plants:
                fields.update(block_padding=(plants["block_padding"], ((1, 1), (1, 1))))
            module = LinenConvNet(**fields)
            variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, IMAGE, IMAGE, 3)))
            flax, key_map = Linen(module, variables), LINEN_CONV_MAP
        return compare_modules(
            randomized(TorchConvNet(), dtype), flax, (x,), flax_inputs=(x.transpose(0, 2, 3, 1),), weights=key_map,
            dtype=dtype,
        )  # fmt: skip


PATHS = {
    "nnx": {"stem": "stem.layers.1", "norm": "blocks.1.norm", "dwconv": "blocks.0.dwconv"},
    "linen": {"stem": "stem.layers_1", "norm": "blocks_1.norm", "dwconv": "blocks_0.dwconv"},
}
KINDS = ["nnx", "linen"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_image_port_passes_on_square_inputs(kind, dtype):
    report = conv_parity(kind, dtype)
    assert report.passed, str(report)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_norm_in_a_sequential_after_a_channels_last_conv_is_named(kind, dtype):
    """The stem's norm sits in an nnx.Sequential (a Linen nn.Sequential); torch's permutes NCHW itself, the port's
    works on NHWC, and H = W = C: its layout is decided by its inputs, which agree."""
    report = conv_parity(kind, dtype, stem_eps=1e-1)
    named(report, "embeddings.1", PATHS[kind]["stem"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_norm_of_a_torch_block_that_permutes_to_channels_last_itself_is_named(kind, dtype):
    report = conv_parity(kind, dtype, block_eps=1e-1)
    named(report, "blocks.1.norm", PATHS[kind]["norm"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shifted_channels_last_convolution_on_a_square_image_is_named(kind, dtype):
    report = conv_parity(kind, dtype, block_padding=((2, 0), (2, 0)))
    named(report, "blocks.0.dwconv", PATHS[kind]["dwconv"])
