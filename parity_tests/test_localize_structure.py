"""Layouts and pairs decided from structure (torch's op trace, provenance), never from the values under test.

One tiny image model, NNX against torch, on a square map where H = W = C (4 x 4 x 4), so that the shapes alone never
decide a layout:

* a patch embedding whose torch forward permutes its conv child's output to channels-last itself (as SAM2's Hiera
  does), while the port's conv works channels-last;
* a LayerNorm over the channels, then torch's ``BatchNormAct2d`` (a BatchNorm whose forward ends in a ReLU) before a
  parameter-free pool, against the port's bare ``nnx.BatchNorm`` with the ReLU in its own code.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from flax_ln.convert import KeyMap
from flax_ln.parity import compare_modules
from flax_ln.parity.records.pairing import Pairs

C, IMAGE, BATCH, CLASSES = 4, 8, 2, 3  # the patch conv halves the image: 4 x 4 x 4, H = W = C
DTYPES = ["float32", "float64"]


class TorchPatchEmbed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, C, 2, stride=2)

    def forward(self, x):
        return self.proj(x).permute(0, 2, 3, 1)  # (B, H, W, C): the parent's own code


class BatchNormAct2d(torch.nn.BatchNorm2d):
    """timm's shape: a BatchNorm whose forward ends in an activation (a child without parameters)."""

    def __init__(self, channels):
        super().__init__(channels)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        return self.act(super().forward(x))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = TorchPatchEmbed()
        self.norm = torch.nn.LayerNorm(C)
        self.bn = BatchNormAct2d(C)
        self.pool = torch.nn.AvgPool2d(2)
        self.head = torch.nn.Linear(C, CLASSES)

    def forward(self, x):
        y = self.norm(self.patch(x)).permute(0, 3, 1, 2)  # (B, C, H, W)
        return self.head(self.pool(self.bn(y)).mean((2, 3)))


class PatchEmbed(nnx.Module):
    def __init__(self, *, param_dtype, rngs):
        self.proj = nnx.Conv(3, C, (2, 2), strides=2, padding="VALID", param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):  # (B, H, W, 3) -> (B, H, W, C)
        return self.proj(x)


class Net(nnx.Module):
    def __init__(self, dtype, *, pool_window=2):
        rngs, param_dtype = nnx.Rngs(0), getattr(jnp, dtype)
        self.patch = PatchEmbed(param_dtype=param_dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(C, epsilon=1e-5, param_dtype=param_dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(C, epsilon=1e-5, momentum=0.9, param_dtype=param_dtype, rngs=rngs)
        self.head = nnx.Linear(C, CLASSES, param_dtype=param_dtype, rngs=rngs)
        self.pool_window = pool_window

    def __call__(self, x):  # (B, H, W, 3)
        y = jax.nn.relu(self.bn(self.norm(self.patch(x))))
        pooled = nnx.avg_pool(y, (self.pool_window,) * 2, strides=(self.pool_window,) * 2)
        return self.head(pooled.mean((1, 2)))


KEY_MAP = KeyMap(
    [
        (r"patch\.proj\.weight", "patch.proj.kernel", "o i kh kw -> kh kw i o"),
        (r"patch\.proj\.bias", "patch.proj.bias", None),
        (r"norm\.weight", "norm.scale", None),
        (r"norm\.bias", "norm.bias", None),
        (r"bn\.weight", "bn.scale", None),
        (r"bn\.bias", "bn.bias", None),
        (r"bn\.running_mean", "bn.mean", None),
        (r"bn\.running_var", "bn.var", None),
        (r"bn\.num_batches_tracked", None, None),
        (r"head\.weight", "head.kernel", "o i -> i o"),
        (r"head\.bias", "head.bias", None),
    ]
)


def torch_net(dtype):
    torch.manual_seed(0)
    net = TorchNet()
    with torch.no_grad():
        for name, p in net.named_parameters():  # unit-scale weights: a planted change shows at float32's tolerance
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name or "bn" in name else torch.randn(p.shape) * 0.5)
        net.bn.running_mean.copy_(0.1 * torch.randn(C))
        net.bn.running_var.copy_(1 + 0.1 * torch.rand(C))
    return net.to(getattr(torch, dtype)).eval()


def run(dtype, *, norm_eps=1e-5, **options):
    x = np.random.default_rng(3).standard_normal((BATCH, 3, IMAGE, IMAGE)).astype(dtype)  # NCHW, torch's layout
    with jax.enable_x64(dtype == "float64"):
        port = Net(dtype)
        port.norm.epsilon = norm_eps
        return compare_modules(
            torch_net(dtype), port, (x,), flax_inputs=(x.transpose(0, 2, 3, 1),), weights=KEY_MAP, dtype=dtype,
            **options,
        )  # fmt: skip


@pytest.fixture(scope="module", params=DTYPES)
def planted(request):
    """The norm after the permuting parent with its eps planted (0.1 for 1e-5)."""
    return run(request.param, norm_eps=1e-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_faithful_port_passes_with_every_pair_agreeing_and_the_batchnorm_act_unpaired(dtype):
    report = run(dtype, capture_modules=True)
    assert report.passed, str(report)
    assert all(r.passed for r in report.module_errors), str(report)
    assert "bn" not in report.module_pairs or report.module_pairs["bn"] is None
    assert "applies relu after its parameterised operation" in report.module_skipped["bn"]


def test_a_bug_after_a_parent_that_permutes_its_conv_child_is_named_alone(planted):
    """torch's patch embedding permutes its conv child's output to channels-last; with H = W = C the shapes allow six
    layouts: the child's comes from its type and torch's own permute, the parent's from provenance (its output is
    the child's, permuted), so the parent agrees, and only the planted norm is named; the BatchNormAct is not."""
    fd = planted.first_divergence
    assert not planted.passed and fd is not None, str(planted)
    assert (fd.module, fd.flax_module, fd.between) == ("norm", "norm", None), str(planted)
    assert (planted.isolation.culprits, planted.isolation.flax_culprits) == (["norm"], ["norm"]), str(planted)
    by_name = {r.name: r for r in planted.module_errors}
    assert by_name["patch"].passed and by_name["patch.proj"].passed, str(planted)
    assert planted.localization_note is None


def test_a_failing_comparison_where_no_pair_fits_says_so_without_naming_xla(monkeypatch):
    """Every pair's activations refuse torch's layout: nothing is compared, and the report says so (how many, why),
    never that the difference is XLA's fusion in the compiled run."""

    def nothing_fits(self, path, array, torch_shape, which="output"):
        return "planted: no layout fits"

    monkeypatch.setattr(Pairs, "to_torch", nothing_fits)
    report = run("float32", norm_eps=1e-1)
    assert not report.passed and report.first_divergence is None
    note = report.localization_note or ""
    assert "no paired module could be compared" in note, str(report)
    assert "planted" in note and "skipped" in note
    assert "XLA" not in str(report) and "compiled" not in note
    assert "isolated: no module could be run alone" in str(report), str(report)


# --- a decoder layer that takes a float causal mask beside activations ----------------------------------------------

D, T = 8, 5


class TorchSelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))

    def forward(self, x, mask):  # mask: additive, 0 where a position is seen, -1e9 where not
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / D**0.5 + mask  # (B, T, T)
        return self.o(torch.softmax(scores, -1) @ self.v(x))


class TorchDecoderLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.self_attn, self.cross = torch.nn.LayerNorm(D), TorchSelfAttention(), torch.nn.Linear(D, D)

    def forward(self, x, memory, mask):
        x = x + self.self_attn(self.norm(x), mask)
        return x + self.cross(memory)


class TorchSeq2Seq(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.enc, self.enc_norm = torch.nn.Linear(D, D), torch.nn.Linear(D, D), torch.nn.LayerNorm(D)
        self.dec = TorchDecoderLayer()

    def forward(self, src, tgt):
        memory = self.enc_norm(self.enc(src))
        mask = torch.full((T, T), -1e9, dtype=src.dtype).triu(1)
        return self.dec(self.embed(tgt), memory, mask)


class SelfAttention(nnx.Module):
    def __init__(self, dense):
        self.q, self.k, self.v, self.o = (nnx.Linear(D, D, **dense) for _ in range(4))

    def __call__(self, x, mask):  # mask: 1.0 where a position is seen, 0.0 where not (not torch's encoding)
        scores = jnp.where(mask > 0, self.q(x) @ jnp.swapaxes(self.k(x), -1, -2) / D**0.5, -1e9)
        return self.o(jax.nn.softmax(scores, -1) @ self.v(x))


class DecoderLayer(nnx.Module):
    def __init__(self, dense):
        self.norm = nnx.LayerNorm(D, epsilon=1e-5, **dense)
        self.self_attn, self.cross = SelfAttention(dense), nnx.Linear(D, D, **dense)

    def __call__(self, x, memory, mask):
        x = x + self.self_attn(self.norm(x), mask)
        return x + self.cross(memory)


class Seq2Seq(nnx.Module):
    def __init__(self, dtype, enc_eps=1e-5):
        dense = dict(param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0))
        self.embed, self.enc = nnx.Linear(D, D, **dense), nnx.Linear(D, D, **dense)
        self.enc_norm = nnx.LayerNorm(D, epsilon=enc_eps, **dense)
        self.dec = DecoderLayer(dense)

    def __call__(self, src, tgt):
        memory = self.enc_norm(self.enc(src))
        mask = jnp.tril(jnp.ones((T, T), src.dtype))
        return self.dec(self.embed(tgt), memory, mask)


_LINEARS = r"(embed|enc|dec\.cross|dec\.self_attn\.[qkvo])"
SEQ_KEY_MAP = KeyMap(
    [
        (_LINEARS + r"\.weight", r"\1.kernel", "o i -> i o"),
        (_LINEARS + r"\.bias", r"\1.bias", None),
        (r"(enc_norm|dec\.norm)\.weight", r"\1.scale", None),
        (r"(enc_norm|dec\.norm)\.bias", r"\1.bias", None),
    ]
)


@pytest.fixture(scope="module", params=DTYPES)
def upstream(request):
    """The port's encoder norm eps planted (0.1 for 1e-5): the decoder layer's memory differs upstream of it."""
    dtype = request.param
    rng = np.random.default_rng(4)
    src, tgt = (rng.standard_normal((BATCH, T, D)).astype(dtype) for _ in range(2))
    torch.manual_seed(1)
    model = TorchSeq2Seq().to(getattr(torch, dtype)).eval()
    with jax.enable_x64(dtype == "float64"):
        return compare_modules(model, Seq2Seq(dtype, enc_eps=1e-1), (src, tgt), weights=SEQ_KEY_MAP, dtype=dtype)


def test_a_float_mask_beside_activations_keeps_the_ports_value_and_the_decoder_agrees_alone(upstream):
    """The port's mask is built from constants (it does not move when the port's inputs and parameters do): isolation
    keeps it, instead of putting torch's differently encoded mask in its place; the decoder layer and its attention
    agree alone, only the planted encoder norm is named, and the isolated line names the kept mask."""
    report = upstream
    assert not report.passed and report.first_divergence is not None, str(report)
    assert (report.first_divergence.module, report.first_divergence.flax_module) == ("enc_norm", "enc_norm")
    assert (report.isolation.culprits, report.isolation.flax_culprits) == (["enc_norm"], ["enc_norm"]), str(report)
    by_name = {r.name: r for r in report.isolation.results}
    assert by_name["dec"].passed and by_name["dec.self_attn"].passed, str(report)
    assert report.isolation.kept["dec"] == ["mask"] and report.isolation.kept["dec.self_attn"] == ["mask"]
    assert "dec: `mask`" in str(report) and "dec.self_attn: `mask`" in str(report), str(report)


# --- the same decoder written in Equinox, per example: its mask is kept too ------------------------------------------


def _equinox_seq2seq():
    """The Seq2Seq port above written in Equinox, per example (``(T, D)`` in, Linear per token), its names torch's
    (no key map) and its encoder norm's eps planted (0.1 for 1e-5)."""
    eqx = pytest.importorskip("equinox", reason="equinox is an optional dependency (the test extra installs it)")

    def per_token(layer, h):
        return jax.vmap(layer)(h)

    class EqxSelfAttention(eqx.Module):
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        o: eqx.nn.Linear

        def __init__(self, key):
            self.q, self.k, self.v, self.o = (eqx.nn.Linear(D, D, key=k) for k in jax.random.split(key, 4))

        def __call__(self, x, mask):  # mask: 1.0 where seen, 0.0 where not (not torch's additive encoding)
            scores = jnp.where(mask > 0, per_token(self.q, x) @ per_token(self.k, x).T / D**0.5, -1e9)  # (T, T)
            return per_token(self.o, jax.nn.softmax(scores, -1) @ per_token(self.v, x))

    class EqxDecoderLayer(eqx.Module):
        norm: eqx.nn.LayerNorm
        self_attn: EqxSelfAttention
        cross: eqx.nn.Linear

        def __init__(self, key):
            self.norm, self.self_attn = eqx.nn.LayerNorm(D, eps=1e-5), EqxSelfAttention(key)
            self.cross = eqx.nn.Linear(D, D, key=jax.random.fold_in(key, 1))

        def __call__(self, x, memory, mask):
            x = x + self.self_attn(per_token(self.norm, x), mask)
            return x + per_token(self.cross, memory)

    class EqxSeq2Seq(eqx.Module):
        embed: eqx.nn.Linear
        enc: eqx.nn.Linear
        enc_norm: eqx.nn.LayerNorm
        dec: EqxDecoderLayer

        def __init__(self, key):
            keys = jax.random.split(key, 3)
            self.embed, self.enc = eqx.nn.Linear(D, D, key=keys[0]), eqx.nn.Linear(D, D, key=keys[1])
            self.enc_norm, self.dec = eqx.nn.LayerNorm(D, eps=1e-1), EqxDecoderLayer(keys[2])

        def __call__(self, src, tgt):  # (T, D) each: one example
            memory = per_token(self.enc_norm, per_token(self.enc, src))
            mask = jnp.tril(jnp.ones((T, T), src.dtype))
            return self.dec(per_token(self.embed, tgt), memory, mask)

    return EqxSeq2Seq(jax.random.PRNGKey(0))


def test_an_equinox_port_keeps_its_mask_too():
    """Equinox isolation tells constants from activations as NNX does: the mask built per example from constants
    keeps the port's value, the decoder layer and its attention agree alone, only the planted norm is named."""
    rng = np.random.default_rng(4)
    src, tgt = (rng.standard_normal((BATCH, T, D)).astype("float32") for _ in range(2))
    torch.manual_seed(1)
    model = TorchSeq2Seq().eval()
    port = _equinox_seq2seq()
    report = compare_modules(
        model, port, (src, tgt), forward=(None, lambda m, s, t: jax.vmap(m)(s, t)), dtype="float32"
    )
    assert not report.passed and report.first_divergence is not None, str(report)
    assert (report.isolation.culprits, report.isolation.flax_culprits) == (["enc_norm"], ["enc_norm"]), str(report)
    by_name = {r.name: r for r in report.isolation.results}
    assert by_name["dec"].passed and by_name["dec.self_attn"].passed, str(report)
    assert report.isolation.kept["dec"] == ["mask"] and report.isolation.kept["dec.self_attn"] == ["mask"], str(report)


# --- a record holds a pytree of arrays --------------------------------------------------------------------------------


class TorchInner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(D, D), torch.nn.LayerNorm(D)

    def forward(self, parts):  # a dict of activations
        return self.norm(self.lin(parts["a"]) + parts["b"])


class TorchOuter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.out = TorchInner(), torch.nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.inner({"a": x, "b": 2 * x}))


class Inner(nnx.Module):
    def __init__(self, dense, eps):
        self.lin, self.norm = nnx.Linear(D, D, **dense), nnx.LayerNorm(D, epsilon=eps, **dense)

    def __call__(self, parts):
        return self.norm(self.lin(parts["a"]) + parts["b"])


class Outer(nnx.Module):
    def __init__(self, dtype, eps=1e-5):
        dense = dict(param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0))
        self.inner, self.out = Inner(dense, eps), nnx.Linear(D, D, **dense)

    def __call__(self, x):
        return self.out(self.inner({"a": x, "b": 2 * x}))


def test_a_child_called_with_a_dict_of_arrays_is_isolated():
    """A mirrored child whose call takes a dict of activations is run alone on torch's (a record holds a pytree of
    arrays); only the planted norm inside it is named, neither the child nor its parent."""
    dtype = "float32"
    x = np.random.default_rng(5).standard_normal((BATCH, T, D)).astype(dtype)
    torch.manual_seed(2)
    with jax.enable_x64(dtype == "float64"):
        report = compare_modules(TorchOuter().to(getattr(torch, dtype)).eval(), Outer(dtype, 1e-1), (x,), dtype=dtype)
    assert not report.passed
    assert report.isolation.culprits == ["inner.norm"], str(report)
    ran = {r.name: r for r in report.isolation.results}
    assert "inner" in ran and "inner" not in report.isolation.skipped, str(report)
    assert report.first_divergence.module == "inner.norm", str(report)
