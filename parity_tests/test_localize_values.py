"""Localisation on the values that are not plain activations: additive masks at a dtype's most negative number, a 0/1
mask against torch's additive one, a difference seen only in a gradient, a summary over a tensor that fails with NaN.

Each port is small (one attention, a norm, a head) and each comparison is the default call: the run in the torch
parameters' dtype (float32) and the float64 check beside it, both asserted.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from flax_ln.convert import KeyMap
from flax_ln.parity import ParityReport, Tolerance, compare_modules, compare_tensors
from flax_ln.parity.records.capture import WHOLE_MODEL

VOCAB, WIDTH, PAD = 11, 8, 0
IDS = np.array([[3, 4, 5, PAD, PAD], [1, 2, 3, 4, PAD]])  # padded: the mask has masked positions in every row


def both_runs(report):
    """The run in the torch parameters' dtype and the float64 check, each with its name for the assertions."""
    assert report.float64_check is not None, str(report)
    return [("float32", report), ("float64", report.float64_check)]


# --- an additive mask at finfo.min ------------------------------------------------------------------------------------


class TorchAttention(torch.nn.Module):
    """Returns its masked scores beside its output, as T5's attention returns its position bias (mask included)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / WIDTH**0.5 + mask  # (B, T, T)
        return self.o(torch.softmax(scores, -1) @ self.v(x)), scores


class TorchModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.attn = torch.nn.Embedding(VOCAB, WIDTH), TorchAttention()
        self.norm, self.head = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        mask = (ids == PAD)[:, None, :].to(x.dtype) * torch.finfo(x.dtype).min  # -1.8e308 in float64
        return self.head(self.norm(x + self.attn(x, mask)[0]))


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.q, self.k, self.v, self.o = (nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(4))

    def __call__(self, x, mask):
        scores = self.q(x) @ jnp.swapaxes(self.k(x), -1, -2) / WIDTH**0.5 + mask  # (B, T, T)
        return self.o(jax.nn.softmax(scores, -1) @ self.v(x)), scores


class Model(nnx.Module):
    """The port builds its mask at float32's minimum whatever the dtype (-3.4e38 in the float64 check)."""

    def __init__(self, eps=1e-5, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.embed, self.attn = nnx.Embed(VOCAB, WIDTH, rngs=rngs), Attention(rngs)
        self.norm, self.head = nnx.LayerNorm(WIDTH, epsilon=eps, rngs=rngs), nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        mask = (ids == PAD)[:, None, :].astype(x.dtype) * jnp.finfo(jnp.float32).min
        return self.head(self.norm(x + self.attn(x, mask)[0]))


KEY_MAP = KeyMap(
    [
        (r"embed\.weight", "embed.embedding", None),
        (r"norm\.weight", "norm.scale", None),
        (r"(attn\.\w|head)\.weight", r"\1.kernel", "o i -> i o"),
        (r"(.*)\.bias", r"\1.bias", None),
    ]
)


def mask_parity(eps=1e-5):
    torch.manual_seed(0)
    return compare_modules(
        TorchModel().eval(), nnx.eval_shape(lambda: Model(eps)), (IDS,), weights=KEY_MAP, capture_modules=True
    )


def test_a_faithful_port_with_a_finfo_min_mask_blames_nothing():
    """torch's mask holds float64's minimum in the float64 check and the port's float32's: both are masked, so the
    attention's scores agree (not ``rel nan``), and no module is a first divergence or a culprit."""
    report = mask_parity()
    assert report.passed, str(report)
    for dtype, run in both_runs(report):
        assert run.first_divergence is None, (dtype, str(run))
        assert run.isolation is not None and run.isolation.culprits == [], (dtype, str(run))
        errors = {r.name: r.relative_error for r in [*run.module_errors, *run.isolation.results]}
        assert errors and all(math.isfinite(e) for e in errors.values()), (dtype, errors)


def test_a_planted_norm_eps_beside_a_finfo_min_mask_is_the_one_culprit():
    report = mask_parity(eps=1e-1)
    assert not report.passed
    for dtype, run in both_runs(report):
        fd = run.first_divergence
        assert fd is not None and (fd.module, fd.flax_module) == ("norm", "norm"), (dtype, str(run))
        assert (run.isolation.culprits, run.isolation.flax_culprits) == (["norm"], ["norm"]), (dtype, str(run))
        assert "rel nan" not in str(run), (dtype, str(run))


# --- the summary -----------------------------------------------------------------------------------------------------


def test_the_summary_never_says_less_than_a_tensor_it_fails():
    """An output with NaN at the same place on both sides fails (NaN is flagged) while its error over the finite
    values is 0: the summary's worst is NaN, not the ``worst rel 0.00e+00`` a maximum of the errors would say."""
    tolerance = Tolerance(rtol=1e-5)
    fine = compare_tensors("output 0", "output", np.ones(3), np.ones(3), tolerance)
    nan = np.array([1.0, np.nan, 1.0])
    broken = compare_tensors("output 1", "output", nan, nan.copy(), tolerance)
    assert not broken.passed and broken.relative_error == 0.0  # the premise: it fails, its finite values agree
    report = ParityReport("two outputs", "float32", [fine, broken])
    assert "output: 2 tensors, worst rel nan" in str(report), str(report)


# --- torch's additive mask against the port's 0/1 mask (Keras) ------------------------------------------------------


class TorchPlainAttention(TorchAttention):
    def forward(self, x, mask):
        return super().forward(x, mask)[0]


class TorchMaskedModel(TorchModel):
    def __init__(self):
        super().__init__()
        self.attn = TorchPlainAttention()

    def forward(self, ids):
        x = self.embed(ids)
        mask = (ids == PAD)[:, None, :].to(x.dtype) * torch.finfo(x.dtype).min  # additive, from the integer ids
        return self.head(self.norm(x + self.attn(x, mask)))


def keras_masked_model(keras, eps):
    """The port's attention takes a 0/1 mask (1 where a key is kept) and selects with it; the model builds it from
    the ids."""

    class MaskedAttention(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.q, self.k, self.v, self.o = (keras.layers.Dense(WIDTH, name=n) for n in "qkvo")

        def build(self, shape):
            for dense in (self.q, self.k, self.v, self.o):
                dense.build(shape)

        def call(self, x, mask):
            scores = keras.ops.matmul(self.q(x), keras.ops.swapaxes(self.k(x), -1, -2)) / WIDTH**0.5  # (B, T, T)
            scores = keras.ops.where(mask > 0, scores, -1e30)
            return self.o(keras.ops.matmul(keras.ops.softmax(scores, -1), self.v(x)))

    class MaskedModel(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embed = keras.layers.Embedding(VOCAB, WIDTH, name="embed")
            self.attn = MaskedAttention(name="attn")
            self.norm = keras.layers.LayerNormalization(epsilon=eps, name="norm")
            self.head = keras.layers.Dense(VOCAB, name="head")

        def call(self, ids):
            x = self.embed(ids)
            mask = keras.ops.cast(ids != PAD, x.dtype)[:, None, :]  # (B, 1, T): 1.0 kept, 0.0 masked
            return self.head(self.norm(x + self.attn(x, mask)))

    model = MaskedModel(name="net")
    model(IDS)
    return model


KERAS_KEY_MAP = KeyMap(
    [
        (r"embed\.weight", "net/embed/embeddings", None),
        (r"norm\.weight", "net/norm/gamma", None),
        (r"norm\.bias", "net/norm/beta", None),
        (r"attn\.(\w)\.weight", r"net/attn/\1/kernel", "o i -> i o"),
        (r"attn\.(\w)\.bias", r"net/attn/\1/bias", None),
        (r"head\.weight", "net/head/kernel", "o i -> i o"),
        (r"head\.bias", "net/head/bias", None),
    ]
)


def test_a_01_mask_built_from_ids_keeps_the_ports_value_beside_a_planted_norm_eps(keras):
    """torch's attention is given an additive mask, the port's a 0/1 one, both built from the integer ids: run alone,
    the port's attention keeps its own mask (listed in ``isolation.kept``) and agrees; only the norm is named."""
    torch.manual_seed(0)
    report = compare_modules(TorchMaskedModel().eval(), keras_masked_model(keras, 1e-1), (IDS,), weights=KERAS_KEY_MAP)
    assert not report.passed
    for dtype, run in both_runs(report):
        fd = run.first_divergence
        assert fd is not None and (fd.module, fd.flax_module) == ("norm", "net/norm"), (dtype, str(run))
        assert (run.isolation.culprits, run.isolation.flax_culprits) == (["norm"], ["net/norm"]), (dtype, str(run))
        assert run.isolation.kept == {"attn": ["mask"]}, (dtype, str(run))


# --- a difference seen only in a gradient ----------------------------------------------------------------------------


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, 3)
        with torch.no_grad():
            self.fc2.bias.zero_()  # the value the port's dropped bias has: no output shows it

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class LinearWithoutBias(nnx.Linear):
    """Holds a bias (loaded from torch's) and leaves it out of its computation: the planted bug."""

    def __call__(self, x):
        return x @ self.kernel[...]


class MLP(nnx.Module):
    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.fc1, self.fc2 = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs), LinearWithoutBias(2 * WIDTH, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def test_a_zero_valued_dropped_bias_names_the_module_that_holds_it():
    torch.manual_seed(0)
    mlp_map = KeyMap([(r"(fc\d)\.weight", r"\1.kernel", "o i -> i o"), (r"(fc\d)\.bias", r"\1.bias", None)])
    x = np.random.default_rng(0).normal(size=(4, WIDTH)).astype(np.float32)
    report = compare_modules(TorchMLP().eval(), nnx.eval_shape(lambda: MLP()), (x,), weights=mlp_map)
    assert not report.passed
    for dtype, run in both_runs(report):
        assert [r.name for r in run.results if not r.passed] == ["fc2.bias"], (dtype, str(run))  # the premise
        assert run.first_divergence is None and run.isolation.culprits == [], (dtype, str(run))
        assert run.gradient_only == {"fc2.bias": "fc2"}, (dtype, str(run))
        assert "seen only in the gradient of `fc2.bias`: every module output agrees; its module fc2 <-> fc2" in str(
            run
        ), (dtype, str(run))


# --- integer ids computed inside the model ---------------------------------------------------------------------------

HEADS, REACH = 2, 2  # relative positions clipped to [-REACH, REACH]: 2 * REACH + 1 buckets


class TorchBucketAttention(torch.nn.Module):
    """A relative-position bias looked up by buckets the attention computes itself (as T5's)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.rel_bias = torch.nn.Embedding(2 * REACH + 1, HEADS)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2) for y in self.qkv(x).split(WIDTH, -1))
        pos = torch.arange(t)
        buckets = torch.clamp(pos[None, :] - pos[:, None], -REACH, REACH) + REACH  # (T, T): key minus query
        probs = torch.softmax(q @ k.transpose(-1, -2) + self.rel_bias(buckets).permute(2, 0, 1), -1)  # (B, n, T, T)
        return self.o((probs @ v).transpose(1, 2).reshape(b, t, WIDTH))


class TorchBucketModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.attn = torch.nn.Embedding(VOCAB, WIDTH), TorchBucketAttention()
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.attn(x))


class BucketAttention(nnx.Module):
    def __init__(self, rngs):
        self.qkv, self.o = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.rel_bias = nnx.Embed(2 * REACH + 1, HEADS, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = (y.reshape(b, t, HEADS, WIDTH // HEADS) for y in jnp.split(self.qkv(x), 3, -1))  # (B, T, n, h)
        pos = jnp.arange(t)
        buckets = jnp.clip(pos[:, None] - pos[None, :], -REACH, REACH) + REACH  # the bug: query minus key
        bias = jnp.transpose(self.rel_bias(buckets), (2, 0, 1))  # (n, T, T)
        probs = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) + bias, -1)  # (B, n, T, T)
        return self.o(jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, WIDTH))  # (B, T, n*h)


class BucketModel(nnx.Module):
    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.embed, self.attn = nnx.Embed(VOCAB, WIDTH, rngs=rngs), BucketAttention(rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        return self.head(x + self.attn(x))


def test_a_relative_position_bucket_bug_names_the_attention_that_computes_the_buckets():
    """The buckets are computed wrongly by the attention's own code. The bias embedding is no culprit: its (T, T)
    buckets differ under both axis orders, so no structural fact decides its square output's layout and the pair is
    not compared (it says so); the attention, whose own code computed them, is the one culprit on both sides."""
    torch.manual_seed(0)
    bucket_map = KeyMap(
        [
            (r"(embed|attn\.rel_bias)\.weight", r"\1.embedding", None),
            (r"(attn\.qkv|attn\.o|head)\.weight", r"\1.kernel", "o i -> i o"),
            (r"(.*)\.bias", r"\1.bias", None),
        ]
    )
    report = compare_modules(
        TorchBucketModel().eval(), nnx.eval_shape(lambda: BucketModel()), (IDS,), weights=bucket_map
    )
    assert not report.passed
    for dtype, run in both_runs(report):
        fd = run.first_divergence
        assert fd is not None and (fd.module, fd.flax_module) == ("attn", "attn"), (dtype, str(run))
        assert fd.flax_between is not None and "attn.rel_bias" not in fd.flax_between, (dtype, str(run))
        assert (run.isolation.culprits, run.isolation.flax_culprits) == (["attn"], ["attn"]), (dtype, str(run))
        assert "no structural fact decides" in run.module_skipped["attn.rel_bias"], (dtype, str(run))


# --- an activation inside a layer ------------------------------------------------------------------------------------


class TorchActModule(torch.nn.Module):
    """``fc1``, then a parameter-free ``act`` module, then ``fc2``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TorchActInline(torch.nn.Module):
    """``fc1``, the activation in the module's own code, ``fc2``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def keras_dense_activation(keras, activation):
    """``fc1`` a ``Dense`` applying its own activation, then ``fc2``."""
    inputs = keras.Input((WIDTH,))
    hidden = keras.layers.Dense(2 * WIDTH, activation=activation, name="fc1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="fc2")(hidden), name="mlp")


ACT_KEY_MAP = KeyMap([(r"(fc\d)\.weight", r"\1/kernel", "o i -> i o"), (r"(fc\d)\.bias", r"\1/bias", None)])
X = np.random.default_rng(0).normal(size=(4, WIDTH)).astype(np.float32)


def activation_named(report, torch_path, flax_path):
    assert not report.passed
    for dtype, run in both_runs(report):
        fd = run.first_divergence
        assert fd is not None and (fd.module, fd.flax_module) == (torch_path, flax_path), (dtype, str(run))
        culprits = (run.isolation.culprits, run.isolation.flax_culprits)
        assert culprits == ([torch_path], [flax_path]), (dtype, str(run))
        assert "paired children run alone agree" not in str(run), (dtype, str(run))


def test_an_activation_module_against_a_dense_with_its_activation_names_both(keras):
    """(i) torch's ``act`` against Keras's ``Dense(activation="sigmoid")`` (the planted bug): the Dense's own output
    (after its activation) is torch's ``act`` output, so ``act`` pairs with the Dense, ``fc1`` with its output before
    the activation; ``act`` and the Dense are named."""
    torch.manual_seed(0)
    report = compare_modules(
        TorchActModule().eval(), keras_dense_activation(keras, "sigmoid"), (X,), weights=ACT_KEY_MAP
    )
    activation_named(report, "act", "fc1")
    assert report.module_pairs["fc1"] == "fc1 (before its activation)", report.module_pairs


def test_an_inline_activation_against_a_dense_with_its_activation_names_the_dense(keras):
    """(iii) torch's tanh in the model's own code against Keras's ``Dense(activation="sigmoid")``: torch's side is
    the model's own code between ``fc1`` and ``fc2``; the port's is the Dense, whose own output differs run alone."""
    torch.manual_seed(0)
    report = compare_modules(
        TorchActInline().eval(), keras_dense_activation(keras, "sigmoid"), (X,), weights=ACT_KEY_MAP
    )
    activation_named(report, WHOLE_MODEL, "fc1")
    for dtype, run in both_runs(report):
        assert run.first_divergence.between == ("fc1", "fc2"), (dtype, str(run))
        assert "in (whole model) <-> fc1, between fc1 and fc2: its own code" in str(run), (dtype, str(run))


class InlineMLP(nnx.Module):
    """``fc1``, the activation inline in the module's own code (sigmoid: the planted bug), ``fc2``."""

    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.fc1, self.fc2 = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs), nnx.Linear(2 * WIDTH, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.sigmoid(self.fc1(x)))


def test_an_activation_module_against_inline_code_names_act_and_the_parents_code():
    """(ii) torch's ``act`` module against the port's inline activation: torch's side is ``act``, the port's the
    model's own code between ``fc1`` and ``fc2``."""
    torch.manual_seed(0)
    mlp_map = KeyMap([(r"(fc\d)\.weight", r"\1.kernel", "o i -> i o"), (r"(fc\d)\.bias", r"\1.bias", None)])
    report = compare_modules(TorchActModule().eval(), nnx.eval_shape(lambda: InlineMLP()), (X,), weights=mlp_map)
    activation_named(report, "act", WHOLE_MODEL)
    for dtype, run in both_runs(report):
        assert run.first_divergence.flax_between == ("fc1", "fc2"), (dtype, str(run))
        assert "act <-> in (whole model), between fc1 and fc2: its own code" in str(run), (dtype, str(run))
