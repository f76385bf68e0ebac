"""Localisation on ports as they are written: an Equinox transformer written per example (batched with
``jax.vmap(model)(batch)``, its norms and projections run per token under another ``vmap``, its attention taking
``key=``), called on a batch and on a single example; and stacks of layers scanned over stacked arrays (Equinox with
``jax.lax.scan``, ``nnx.scan``, Linen ``nn.scan``), each localised per layer. Tiny ports, each with one planted
mistake, named on both sides with nothing else blamed, in float32 and float64."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx

eqx = pytest.importorskip("equinox", reason="equinox is an optional dependency (the test extra installs it)")

from torch_weights import randomized  # noqa: E402

from flax_ln.convert import KeyMap  # noqa: E402
from flax_ln.parity import Linen, compare_modules  # noqa: E402

WIDTH, SEQ, BATCH, HEADS = 8, 5, 2, 2
DTYPES = ["float32", "float64"]


# --- an Equinox transformer written per example ----------------------------------------------------------------------


class TorchAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):  # (B, T, E)
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, H, T, D)
        w = torch.softmax(q @ k.transpose(-1, -2) / (WIDTH // HEADS) ** 0.5, dim=-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, t, WIDTH))


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = torch.nn.LayerNorm(WIDTH), TorchAttention()
        self.norm2, self.fc = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + torch.tanh(self.fc(self.norm2(x)))


class TorchTransformer(torch.nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(layers))
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _linear(key, dtype):
    return eqx.nn.Linear(WIDTH, WIDTH, key=key, dtype=dtype)


class Attention(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key, dtype):
        self.q, self.k, self.v, self.o = (_linear(k, dtype) for k in jax.random.split(key, 4))
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key, inference=True):  # x (T, E): one example
        heads = lambda y: y.reshape(SEQ, HEADS, -1).transpose(1, 0, 2)  # noqa: E731  (T, E) -> (H, T, D)
        q, k, v = (heads(jax.vmap(p)(x)) for p in (self.q, self.k, self.v))
        w = jax.nn.softmax(q @ k.transpose(0, 2, 1) / (WIDTH // HEADS) ** 0.5, axis=-1)  # (H, T, T)
        w = self.dropout(w, key=key, inference=inference)
        return jax.vmap(self.o)((w @ v).transpose(1, 0, 2).reshape(SEQ, WIDTH))  # (T, E)


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: Attention
    norm2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear

    def __init__(self, key, dtype, eps=1e-5):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(WIDTH, dtype=dtype), eqx.nn.LayerNorm(WIDTH, eps=eps, dtype=dtype)
        self.attn, self.fc = Attention(k1, dtype), _linear(k2, dtype)

    def __call__(self, x, *, key):  # x (T, E)
        x = x + self.attn(jax.vmap(self.norm1)(x), key=key, inference=True)
        return x + jnp.tanh(jax.vmap(self.fc)(jax.vmap(self.norm2)(x)))


class Transformer(eqx.Module):
    inp: eqx.nn.Linear
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, dtype, eps=(1e-5, 1e-5)):
        keys = jax.random.split(jax.random.key(0), len(eps) + 2)
        self.inp, self.head = _linear(keys[0], dtype), _linear(keys[1], dtype)
        self.blocks = [Block(k, dtype, e) for k, e in zip(keys[2:], eps)]

    def __call__(self, x, key=None):  # x (T, E): one example
        key = jax.random.key(1) if key is None else key
        x = jax.vmap(self.inp)(x)
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, key=k)
        return jax.vmap(self.head)(x)


EQX_MAP = KeyMap([(r"(.*)\.(weight|bias)", r"\1.\2", None)])


def _per_example(model, x):
    return jax.vmap(model)(x)


def _batch_of_one(model, x):
    return model(x[None])[0]


@pytest.fixture(scope="module", params=DTYPES)
def transformer_reports(request):
    """The planted per-example transformer compared on a batch and on a single example (torch: a batch of 1)."""
    dtype = request.param
    rng = np.random.default_rng(3)
    batch, single = rng.standard_normal((BATCH, SEQ, WIDTH)).astype(dtype), rng.standard_normal((SEQ, WIDTH))
    with jax.enable_x64(dtype == "float64"):
        port = Transformer(getattr(jnp, dtype), eps=(1e-5, 0.5))
        torch_model = randomized(TorchTransformer(), dtype)
        batched = compare_modules(
            torch_model, port, (batch,), weights=EQX_MAP, dtype=dtype, forward=(None, _per_example)
        )
        one = compare_modules(
            torch_model, port, (single.astype(dtype),), weights=EQX_MAP, dtype=dtype, forward=(_batch_of_one, None)
        )
    return batched, one


def _check_named_norm(report):
    assert not report.passed
    fd = report.first_divergence
    assert fd is not None and fd.module == "blocks.1.norm2" and fd.flax_module == "blocks.1.norm2", str(report)
    assert fd.between is None, str(report)
    assert report.isolation.culprits == ["blocks.1.norm2"], str(report)
    assert report.isolation.flax_culprits == ["blocks.1.norm2"], str(report)


def test_a_per_example_equinox_transformer_names_the_planted_norm_and_runs_its_attention(transformer_reports):
    """vmap over the batch, vmap over tokens inside: the batch axes are kept, so every LayerNorm and Linear pairs;
    the planted norm is named, and isolation replays the attention's call (``key=``, ``inference=``)."""
    report = transformer_reports[0]
    _check_named_norm(report)
    ran = {r.name for r in report.isolation.results}
    assert {"blocks.0.attn", "blocks.1.attn", "blocks.1.attn.q", "blocks.1.norm1", "blocks.0"} <= ran, str(report)
    assert "blocks.1.attn" not in report.isolation.skipped, str(report)


def test_the_same_transformer_on_a_single_example_gives_the_same_answer(transformer_reports):
    """No batch axis on the port, a batch of one on torch: the unit axis pairs, and the answer is the same."""
    _check_named_norm(transformer_reports[1])
    ran = {r.name for r in transformer_reports[1].isolation.results}
    assert {"blocks.1.attn", "blocks.1.norm2"} <= ran, str(transformer_reports[1])


# --- stacks of layers scanned over stacked arrays ---------------------------------------------------------------------

LAYERS = 4


class TorchLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TorchStack(torch.nn.Module):
    """Four layers; layer 2's norm eps is planted (0.5), so only layer 2 differs from a faithful port."""

    def __init__(self, dtype):
        super().__init__()
        self.inp, self.head = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.layers = torch.nn.ModuleList(TorchLayer() for _ in range(LAYERS))
        randomized(self, dtype)
        self.layers[2].norm.eps = 0.5

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _stacked_map(norm_scale: str, fc_weight: str, fc_layout) -> KeyMap:
    return KeyMap(
        [
            (r"(inp|head)\.weight", rf"\1.{fc_weight}", fc_layout),
            (r"(inp|head)\.bias", r"\1.bias", None),
            (r"layers\.(\d+)\.norm\.weight", rf"layers.norm.{norm_scale}[\1]", None),
            (r"layers\.(\d+)\.norm\.bias", r"layers.norm.bias[\1]", None),
            (r"layers\.(\d+)\.fc\.weight", rf"layers.fc.{fc_weight}[\1]", fc_layout),
            (r"layers\.(\d+)\.fc\.bias", r"layers.fc.bias[\1]", None),
        ]
    )


class EqxLayer(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc: eqx.nn.Linear

    def __init__(self, key, dtype):
        self.norm, self.fc = eqx.nn.LayerNorm(WIDTH, dtype=dtype), _linear(key, dtype)

    def __call__(self, x):  # (T, E)
        return x + jnp.tanh(jax.vmap(self.fc)(jax.vmap(self.norm)(x)))


class EqxScanned(eqx.Module):
    """Its layers built by ``eqx.filter_vmap`` (arrays stacked on a leading layer axis) and run by
    ``jax.lax.scan`` over them, as published Equinox ports do."""

    inp: eqx.nn.Linear
    layers: EqxLayer
    head: eqx.nn.Linear

    def __init__(self, dtype):
        keys = jax.random.split(jax.random.key(0), LAYERS + 2)
        self.inp, self.head = _linear(keys[0], dtype), _linear(keys[1], dtype)
        self.layers = eqx.filter_vmap(lambda k: EqxLayer(k, dtype))(keys[2:])

    def __call__(self, x):  # (T, E)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, arrays):
            return eqx.combine(arrays, static)(x), None

        x, _ = jax.lax.scan(step, jax.vmap(self.inp)(x), dynamic)
        return jax.vmap(self.head)(x)


def _check_layer_two(report, flax_norm: str, flax_layer: str):
    assert not report.passed
    fd = report.first_divergence
    assert fd is not None and fd.module == "layers.2.norm" and fd.flax_module == flax_norm, str(report)
    assert report.isolation.culprits == ["layers.2.norm"], str(report)
    assert report.isolation.flax_culprits == [flax_norm], str(report)
    assert report.module_pairs["layers.2"] == flax_layer, report.module_pairs
    ran = {r.name for r in report.isolation.results}
    assert {f"layers.{k}.{m}" for k in range(LAYERS) for m in ("norm", "fc")} <= ran, str(report)
    assert f"layers.2.norm <-> {flax_norm}" in str(report), str(report)
    assert 'data-path="layers.2.norm"' in report.to_html() and f">{flax_norm}<" in report.to_html()


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_equinox_stack_scanned_with_lax_scan_is_localised_per_layer(dtype):
    x = np.random.default_rng(4).standard_normal((BATCH, SEQ, WIDTH)).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        report = compare_modules(
            TorchStack(dtype),
            EqxScanned(getattr(jnp, dtype)),
            (x,),
            weights=_stacked_map("weight", "weight", None),
            dtype=dtype,
            forward=(None, _per_example),
        )
    _check_layer_two(report, "layers[2].norm", "layers[2]")


class NnxLayer(nnx.Module):
    def __init__(self, dtype, *, rngs):
        self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, param_dtype=dtype, rngs=rngs)
        self.fc = nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.fc(self.norm(x)))


class NnxScanned(nnx.Module):
    """Its layers stacked by ``nnx.vmap`` and run by ``nnx.scan``."""

    def __init__(self, dtype):
        rngs = nnx.Rngs(0)
        self.inp = nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs)
        keys = jax.random.split(jax.random.key(1), LAYERS)
        self.layers = nnx.vmap(lambda k: NnxLayer(dtype, rngs=nnx.Rngs(k)))(keys)
        self.head = nnx.Linear(WIDTH, WIDTH, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def step(layer, x):
            return layer(x)

        return self.head(step(self.layers, self.inp(x)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_nnx_scan_stack_is_localised_per_layer(dtype):
    x = np.random.default_rng(4).standard_normal((BATCH, SEQ, WIDTH)).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        report = compare_modules(
            TorchStack(dtype),
            NnxScanned(getattr(jnp, dtype)),
            (x,),
            weights=_stacked_map("scale", "kernel", "o i -> i o"),
            dtype=dtype,
        )
    _check_layer_two(report, "layers[2].norm", "layers[2]")


class LinenLayer(linen.Module):
    dtype: Any

    @linen.compact
    def __call__(self, x, _):
        norm = linen.LayerNorm(epsilon=1e-5, name="norm", param_dtype=self.dtype, dtype=self.dtype)
        fc = linen.Dense(WIDTH, name="fc", param_dtype=self.dtype, dtype=self.dtype)
        return x + jnp.tanh(fc(norm(x))), None


class LinenScanned(linen.Module):
    """Its layers run by ``nn.scan`` with their parameters stacked on a leading layer axis."""

    dtype: Any

    @linen.compact
    def __call__(self, x):
        x = linen.Dense(WIDTH, name="inp", param_dtype=self.dtype, dtype=self.dtype)(x)
        scanned = linen.scan(LinenLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        x, _ = scanned(self.dtype, name="layers")(x, None)
        return linen.Dense(WIDTH, name="head", param_dtype=self.dtype, dtype=self.dtype)(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_linen_nn_scan_stack_is_localised_per_layer(dtype):
    x = np.random.default_rng(4).standard_normal((BATCH, SEQ, WIDTH)).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        module = LinenScanned(getattr(jnp, dtype))
        variables = jax.eval_shape(module.init, jax.random.key(0), jnp.asarray(x))
        report = compare_modules(
            TorchStack(dtype),
            Linen(module, variables),
            (x,),
            weights=_stacked_map("scale", "kernel", "o i -> i o"),
            dtype=dtype,
        )
    _check_layer_two(report, "layers[2].norm", "layers[2]")


@pytest.mark.parametrize("dtype", ["float64"])  # the strictest policy only: the GPT is the slowest port here
def test_the_books_gpt_with_scan_layers_is_localised_per_layer_without_a_key_map(dtype):
    """``GPT(scan_layers=True)`` compared through the converter's rules (no ``weights=``): its scanned blocks are
    recorded per layer and paired with torch's ``transformer.h.{k}`` by the rules' stacked layers."""
    import flax_ln
    import torch_ref

    config = flax_ln.GPTConfig(n_layer=3, n_head=2, n_embd=WIDTH, vocab_size=16, block_size=SEQ)
    torch.manual_seed(0)
    torch_model = randomized(torch_ref.GPT(config), dtype)
    torch_model.transformer.h[2].ln_2.eps = 0.5
    idx = np.random.default_rng(5).integers(0, 16, size=(BATCH, SEQ))
    with jax.enable_x64(dtype == "float64"):
        port = flax_ln.GPT(config, scan_layers=True, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0))
        report = compare_modules(torch_model, port, (idx,), dtype=dtype, forward=lambda m, x: m(x)[0])
    assert not report.passed
    fd = report.first_divergence
    assert (fd.module, fd.flax_module) == ("transformer.h.2.ln_2", "transformer.h[2].ln_2"), str(report)
    assert report.isolation.culprits == ["transformer.h.2.ln_2"], str(report)
    assert report.isolation.flax_culprits == ["transformer.h[2].ln_2"], str(report)
    assert report.isolation.unrecorded == {}, str(report)
    assert "transformer.h.2.ln_2 <-> transformer.h[2].ln_2" in str(report), str(report)
