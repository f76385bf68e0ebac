"""No culprit without evidence: a pair's activation layout comes from structure (never from its own output agreeing),
a pair whose layout nothing decides is not compared and blames nothing, and isolation runs each module on its torch
twin's own recorded arguments. Small purpose-built ports with one planted mistake each, named on both sides with
nothing else blamed, in float32 and in the default call's float64 check:

* per-head q/k norms: torch normalises after its ``transpose(1, 2)`` on ``(B, heads, T, head_dim)``, the port before
  its own transpose on ``(B, T, heads, head_dim)``; heads = T = head_dim, so the shapes admit several layouts;
* a Linen CNN with channels-last convolutions and BatchNorms (torch's code permutes nothing) on square images
  (H = W = C), a BatchNorm eps planted in the later stage;
* a block that drops its attention residual: the faithful norm after it agrees when run on torch's own input;
* a channel mixer whose two layouts fit the shapes and that no structural fact decides, next to a planted bug.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import linen, nnx
from torch_weights import randomized

from flax_ln.convert import KeyMap
from flax_ln.parity import Linen, compare_modules
from flax_ln.parity.records.capture import WHOLE_MODEL

VOCAB, BATCH, SEQ, HEADS, HEAD = 16, 2, 4, 4, 4  # heads = T = head_dim: (B, n, T, h) and (B, T, n, h) look alike
WIDTH = HEADS * HEAD


def reports(report):
    """The default call's float32 run and its float64 check, both of which must name the planted module."""
    assert report.float64_check is not None, str(report)
    return [("float32", report), ("float64", report.float64_check)]


def named(report, torch_path, flax_path, between=None):
    """The first divergence and isolation name ``torch_path``/``flax_path`` and nothing else, in both runs."""
    for dtype, run in reports(report):
        fd = run.first_divergence
        assert not run.passed and fd is not None, (dtype, str(run))
        assert (fd.module, fd.flax_module, fd.between) == (torch_path, flax_path, between), (dtype, str(run))
        isolation = run.isolation
        assert (isolation.culprits, isolation.flax_culprits) == ([torch_path], [flax_path]), (dtype, str(run))


# --- per-head q/k norms -----------------------------------------------------------------------------------------------


class TorchAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.q_norm, self.k_norm = torch.nn.LayerNorm(HEAD), torch.nn.LayerNorm(HEAD)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, HEADS, HEAD).transpose(1, 2))  # (B, n, T, h)
        k = self.k_norm(self.k_proj(x).view(b, t, HEADS, HEAD).transpose(1, 2))  # (B, n, T, h)
        v = self.v_proj(x).view(b, t, HEADS, HEAD).transpose(1, 2)  # (B, n, T, h)
        probs = torch.softmax(q @ k.transpose(-1, -2) * HEAD**-0.5, -1)  # (B, n, T, T)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, t, WIDTH))  # (B, T, n*h)


class TorchLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = torch.nn.LayerNorm(WIDTH), TorchAttention(), torch.nn.LayerNorm(WIDTH)
        self.fc1, self.fc2 = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.fc2(torch.tanh(self.fc1(self.ln_2(x))))


class TorchLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList([TorchLayer()])
        self.norm, self.head = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Attention(nnx.Module):
    def __init__(self, dense):
        self.q, self.k, self.v, self.o = (nnx.Linear(WIDTH, WIDTH, **dense) for _ in range(4))
        self.q_norm, self.k_norm = (nnx.LayerNorm(HEAD, epsilon=1e-5, **dense) for _ in range(2))

    def __call__(self, x):
        b, t, _ = x.shape
        q = self.q_norm(self.q(x).reshape(b, t, HEADS, HEAD))  # (B, T, n, h): normalised before the transpose
        k = self.k_norm(self.k(x).reshape(b, t, HEADS, HEAD))  # (B, T, n, h)
        v = self.v(x).reshape(b, t, HEADS, HEAD)  # (B, T, n, h)
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) * HEAD**-0.5  # (B, n, T, T)
        out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)  # (B, T, n, h)
        return self.o(out.reshape(b, t, WIDTH))  # (B, T, n*h)


class Layer(nnx.Module):
    def __init__(self, dense):
        self.norm1, self.norm2 = (nnx.LayerNorm(WIDTH, epsilon=1e-5, **dense) for _ in range(2))
        self.attn = Attention(dense)
        self.up, self.down = nnx.Linear(WIDTH, 2 * WIDTH, **dense), nnx.Linear(2 * WIDTH, WIDTH, **dense)
        self.residual = True  # False plants a dropped attention residual

    def __call__(self, x):
        attended = self.attn(self.norm1(x))
        x = x + attended if self.residual else attended
        return x + self.down(jnp.tanh(self.up(self.norm2(x))))


class LM(nnx.Module):
    def __init__(self, dtype):
        dense = dict(param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0))
        self.tokens = nnx.Embed(VOCAB, WIDTH, **dense)
        self.blocks = nnx.List([Layer(dense)])
        self.final, self.out = nnx.LayerNorm(WIDTH, epsilon=1e-5, **dense), nnx.Linear(WIDTH, VOCAB, **dense)

    def __call__(self, ids):
        x = self.tokens(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(self.final(x))


_AT = r"layers\.(\d+)\."
LM_MAP = KeyMap(
    [
        (r"embed\.weight", "tokens.embedding", None),
        (_AT + r"attn\.(q|k|v|o)_proj\.weight", r"blocks.\1.attn.\2.kernel", "o i -> i o"),
        (_AT + r"attn\.(q|k|v|o)_proj\.bias", r"blocks.\1.attn.\2.bias", None),
        (_AT + r"attn\.(q|k)_norm\.weight", r"blocks.\1.attn.\2_norm.scale", None),
        (_AT + r"attn\.(q|k)_norm\.bias", r"blocks.\1.attn.\2_norm.bias", None),
        (_AT + r"ln_1\.weight", r"blocks.\1.norm1.scale", None),
        (_AT + r"ln_1\.bias", r"blocks.\1.norm1.bias", None),
        (_AT + r"ln_2\.weight", r"blocks.\1.norm2.scale", None),
        (_AT + r"ln_2\.bias", r"blocks.\1.norm2.bias", None),
        (_AT + r"fc1\.weight", r"blocks.\1.up.kernel", "o i -> i o"),
        (_AT + r"fc1\.bias", r"blocks.\1.up.bias", None),
        (_AT + r"fc2\.weight", r"blocks.\1.down.kernel", "o i -> i o"),
        (_AT + r"fc2\.bias", r"blocks.\1.down.bias", None),
        (r"norm\.weight", "final.scale", None),
        (r"norm\.bias", "final.bias", None),
        (r"head\.weight", "out.kernel", "o i -> i o"),
        (r"head\.bias", "out.bias", None),
    ]
)


def lm_parity(plant):
    """The default call (float32, then its float64 check) of the LM port with ``plant(port)`` applied."""
    ids = np.random.default_rng(3).integers(0, VOCAB, (BATCH, SEQ))
    port = nnx.eval_shape(lambda: LM("float32"))
    plant(port)
    return compare_modules(randomized(TorchLM(), "float32"), port, (ids,), weights=LM_MAP)


def test_per_head_norms_before_the_ports_transpose_are_not_blamed_for_a_bug_elsewhere():
    """The norm before the MLP has a wrong eps. Each q/k norm's layout follows from its input: torch's is its
    projection's output viewed and transposed, the port's the same output reshaped, so one layout fits."""

    def plant(port):
        port.blocks[0].norm2.epsilon = 1e-1

    report = lm_parity(plant)
    named(report, "layers.0.ln_2", "blocks.0.norm2")
    for _, run in reports(report):
        norms = [r for r in run.isolation.results if r.name.endswith(("q_norm", "k_norm"))]
        assert len(norms) == 2 and all(r.passed for r in norms), str(run)


def test_a_dropped_attention_residual_blames_the_block_not_the_faithful_norm_after_it():
    """The block passes its attention's output on without the residual. Its second norm, run on torch's own input to
    that norm, agrees; the difference is the block's own code, between the attention and that norm."""

    def plant(port):
        port.blocks[0].residual = False

    report = lm_parity(plant)
    named(report, "layers.0", "blocks.0", between=("layers.0.attn", "layers.0.ln_2"))
    for _, run in reports(report):
        norm2 = next(r for r in run.isolation.results if r.name == "layers.0.ln_2")
        assert norm2.passed, str(run)


# --- a Linen CNN: channels-last convolutions and BatchNorms on square images ------------------------------------------

CHANNELS, IMAGE, CLASSES = 4, 8, 3  # the stem halves the image: 4 x 4 x 4 activations, H = W = C


class TorchStem(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, CHANNELS, 2, stride=2), torch.nn.BatchNorm2d(CHANNELS)

    def forward(self, x):
        return torch.tanh(self.bn(self.conv(x)))


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), torch.nn.BatchNorm2d(CHANNELS)

    def forward(self, x):
        return x + torch.tanh(self.bn(self.conv(x)))


class TorchCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.stages = TorchStem(), torch.nn.Sequential(TorchBlock(), TorchBlock())
        self.head = torch.nn.Linear(CHANNELS, CLASSES)

    def forward(self, x):  # (B, C, H, W), never permuted
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class LinenStem(linen.Module):
    param_dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x):  # (B, H, W, 3)
        x = linen.Conv(CHANNELS, (2, 2), strides=2, padding="VALID", name="conv", param_dtype=self.param_dtype)(x)
        bn = linen.BatchNorm(use_running_average=True, epsilon=1e-5, name="bn", param_dtype=self.param_dtype)
        return jnp.tanh(bn(x))


class LinenBlock(linen.Module):
    eps: float = 1e-5
    param_dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x):  # (B, H, W, C)
        y = linen.Conv(CHANNELS, (3, 3), padding=1, name="conv", param_dtype=self.param_dtype)(x)
        bn = linen.BatchNorm(use_running_average=True, epsilon=self.eps, name="bn", param_dtype=self.param_dtype)
        return x + jnp.tanh(bn(y))


class LinenCNN(linen.Module):
    """Takes torch's NCHW image and moves it to channels-last itself, as ports of torch vision models do."""

    block_eps: tuple = (1e-5, 1e-5)
    param_dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, x):  # (B, 3, H, W)
        x = LinenStem(self.param_dtype, name="stem")(jnp.transpose(x, (0, 2, 3, 1)))  # (B, H, W, C)
        for i, eps in enumerate(self.block_eps):
            x = LinenBlock(eps, self.param_dtype, name=f"stage_{i}")(x)
        return linen.Dense(CLASSES, name="head", param_dtype=self.param_dtype)(x.mean((1, 2)))


def _cnn_rules():
    stem, stage = r"stem\.", r"stages\.(\d+)\."
    rules = [(r"head\.weight", "head.kernel", "o i -> i o"), (r"head\.bias", "head.bias", None)]
    for torch_at, flax_at in ((stem, "stem."), (stage, r"stage_\1.")):
        rules += [
            (torch_at + r"conv\.weight", flax_at + "conv.kernel", "o i kh kw -> kh kw i o"),
            (torch_at + r"conv\.bias", flax_at + "conv.bias", None),
            (torch_at + r"bn\.weight", flax_at + "bn.scale", None),
            (torch_at + r"bn\.bias", flax_at + "bn.bias", None),
            (torch_at + r"bn\.running_mean", "batch_stats." + flax_at + "bn.mean", None),
            (torch_at + r"bn\.running_var", "batch_stats." + flax_at + "bn.var", None),
            (torch_at + r"bn\.num_batches_tracked", None, None),
        ]
    return KeyMap(rules)


def randomized_cnn() -> torch.nn.Module:
    model = randomized(TorchCNN(), "float32")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
            elif name.endswith("running_var"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=gen))
    return model


def test_a_later_batchnorm_eps_in_a_channels_last_linen_cnn_on_square_images_is_named_alone():
    """Stage 1's BatchNorm eps differs (1e-1 against 1e-5). The port moves the image to channels-last itself, so
    the shapes of every stage (H = W = C) fit several layouts; Linen's convolutions and BatchNorms are
    channels-last, which decides them, and no faithful conv nor the stem is blamed."""
    x = np.random.default_rng(4).standard_normal((BATCH, 3, IMAGE, IMAGE)).astype("float32")  # NCHW, torch's
    module = LinenCNN(block_eps=(1e-5, 1e-1))
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 3, IMAGE, IMAGE)))
    report = compare_modules(randomized_cnn(), Linen(module, variables), (x,), weights=_cnn_rules())
    named(report, "stages.1.bn", "stage_1.bn")


# --- a pair whose layout nothing decides ------------------------------------------------------------------------------

MIXED = 4  # channels = length: (B, C, L) and (B, L, C) look alike


class TorchMixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mix, self.head = torch.nn.Conv1d(MIXED, MIXED, 1), torch.nn.Linear(MIXED, CLASSES)

    def forward(self, x):  # (B, C, L)
        return self.head(self.mix(torch.tanh(x)).mean(-1))


class Mixer(nnx.Module):
    """A pointwise conv as a Linear over channels-last activations; ``gain`` plants a mistake in the code before it."""

    def __init__(self):
        self.mix, self.head = nnx.Linear(MIXED, MIXED, rngs=nnx.Rngs(0)), nnx.Linear(MIXED, CLASSES, rngs=nnx.Rngs(1))
        self.gain = 1.0

    def __call__(self, x):  # (B, C, L)
        return self.head(self.mix(jnp.transpose(jnp.tanh(self.gain * x), (0, 2, 1))).mean(1))  # mixed over C


MIXER_MAP = KeyMap(
    [
        (r"mix\.weight", "mix.kernel", "o i k -> (i k) o"),
        (r"mix\.bias", "mix.bias", None),
        (r"head\.weight", "head.kernel", "o i -> i o"),
        (r"head\.bias", "head.bias", None),
    ]
)


def test_a_pair_whose_layout_nothing_decides_is_not_compared_and_blames_nothing():
    """The port scales the input before its tanh. The mixer's input is made by inline code on both sides (no pair's
    output, no model input), its two layouts fit the shapes, and its inputs agree under neither (the mistake is
    upstream): it is not compared, so neither the first divergence nor isolation may name it."""
    port = Mixer()
    port.gain = 1.5
    x = np.random.default_rng(5).standard_normal((BATCH, MIXED, MIXED)).astype("float32")
    report = compare_modules(randomized(TorchMixer(), "float32"), port, (x,), weights=MIXER_MAP)
    for dtype, run in reports(report):
        assert not run.passed, (dtype, str(run))
        assert "no structural fact decides" in run.module_skipped.get("mix", ""), (dtype, run.module_skipped)
        assert "mix" in run.isolation.skipped and "mix" not in run.isolation.culprits, (dtype, str(run))
        assert run.first_divergence is None or run.first_divergence.module != "mix", (dtype, str(run))
        assert run.isolation.culprits == [WHOLE_MODEL], (dtype, str(run))
