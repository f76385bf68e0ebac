"""Parity of flax_ln's GPT (chapters 11, 12, 14) with torch_ref.gpt: components, whole model, converter, HF, generation.

Small configs keep the file fast; one full-width GPT-2XL block checks the real width.
"""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file

import flax_ln
import torch_ref
from flax_ln import ConversionError, GPTConfig
from flax_ln.models import gpt as fg
from flax_ln.parity import TOLERANCES, assert_parity, compare_modules, compare_tensors, relative_error
from torch_ref import gpt as tg

SMALL = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=50, block_size=16)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


# ---------------------------------------------------------------------------------------
# helpers


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """O(1) activations everywhere: Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
    norm scales ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2); the book's 0.02 init would make
    attention nearly uniform and hide masking or scaling bugs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if p.ndim == 2:
                p.copy_(noise if ("wte" in name or "wpe" in name) else noise / math.sqrt(p.shape[1]))
            elif "ln" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)
    return module


def torch_gpt(config, dtype="float32", seed=0):
    torch.manual_seed(seed)
    return randomize(tg.GPT(config), seed).to(getattr(torch, dtype)).eval()


def flax_twin(torch_module, flax_cls, config, param_dtype="float32", **kwargs):
    """The flax twin of a torch module, weights copied through the converter, dropout off."""
    model = flax_cls(config, param_dtype=getattr(jnp, param_dtype), rngs=nnx.Rngs(0), **kwargs)
    flax_ln.load_torch_state_dict(model, torch_module.state_dict())
    model.eval()
    return model


def split(model):
    return nnx.split(model, nnx.Param, ...)


def tokens(shape, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


def the_loss(outputs):
    """The GPT's own loss from its (logits, loss) outputs, for either framework."""
    return outputs[1]


LOSS = (the_loss, the_loss)


# ---------------------------------------------------------------------------------------
# components


def test_gelu_is_the_tanh_form(x64):
    x = np.linspace(-8, 8, 401)
    y_flax = fg.GELU()(jnp.asarray(x))
    y_torch = tg.GELU()(torch.tensor(x)).numpy()
    exact = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    assert y_flax.dtype == jnp.float64 and y_flax.shape == x.shape
    # float64, same formula: rounding only.
    assert relative_error(y_flax, exact) <= 1e-15 and relative_error(y_torch, exact) <= 1e-15
    # Not the erf GELU of torch.nn.GELU(): 0.841192 vs 0.841345 at x = 1.
    np.testing.assert_allclose(float(fg.gelu(jnp.float64(1.0))), 0.8411919906082768, rtol=1e-15)
    assert abs(float(fg.gelu(jnp.float64(1.0))) - 0.8413447460685429) > 1e-4


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("component", ["attn", "mlp", "block"])
def test_components_match_torch(request, dtype, component):
    if dtype == "float64":
        request.getfixturevalue("x64")
    torch_cls, flax_cls = {
        "attn": (tg.CausalSelfAttention, fg.CausalSelfAttention),
        "mlp": (tg.MLP, fg.MLP),
        "block": (tg.Block, fg.Block),
    }[component]
    torch.manual_seed(0)
    torch_mod = randomize(torch_cls(SMALL), 1).to(getattr(torch, dtype)).eval()
    flax_mod = flax_twin(torch_mod, flax_cls, SMALL, dtype)
    rng = np.random.default_rng(2)
    shape = (3, 11, SMALL.n_embd)  # T = 11 < block_size: the mask is cut to (T, T)
    x = rng.normal(size=shape).astype(dtype)
    report = assert_parity(torch_mod, flax_mod, x)  # the policy: float64 1e-12 / 1e-10, float32 1e-5 / 1e-4
    assert report.dtype == dtype and report["output"].shape == shape
    assert {r.name for r in report.results} == {"output", "grad input 0", *dict(torch_mod.named_parameters())}


def test_attention_is_causal():
    """Changing a later token never changes an earlier output (catches a missing or flipped mask)."""
    attn = fg.CausalSelfAttention(SMALL, rngs=nnx.Rngs(0))
    attn.eval()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, SMALL.n_embd)), jnp.float32)
    y1, y2 = attn(x), attn(x.at[:, 5].add(1.0))
    np.testing.assert_array_equal(y1[:, :5], y2[:, :5])
    assert not np.allclose(y1[:, 5:], y2[:, 5:])


@pytest.mark.slow
def test_gpt2_xl_block_full_width_float32():
    config = GPTConfig.gpt2_xl()
    torch.manual_seed(0)
    torch_mod = randomize(tg.Block(config), 3).eval()
    flax_mod = flax_twin(torch_mod, fg.Block, config)
    rng = np.random.default_rng(4)
    shape = (2, 16, 1600)
    x = rng.normal(size=shape).astype(np.float32)
    assert flax_mod.attn.c_attn.kernel.shape == (1600, 4800) and config.head_size == 64
    # float32 at width 1600/6400: reductions of up to 6400 terms, still ~1e-6 relative (policy 1e-5 / 1e-4).
    report = assert_parity(torch_mod, flax_mod, x)
    assert report["output"].shape == shape


# ---------------------------------------------------------------------------------------
# whole model


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpt_logits_loss_and_every_gradient(request, dtype, scan_layers):
    if dtype == "float64":
        request.getfixturevalue("x64")
    torch_model = torch_gpt(SMALL, dtype)
    flax_model = flax_twin(torch_model, flax_ln.GPT, SMALL, dtype, scan_layers=scan_layers)
    idx = tokens((3, 16), SMALL.vocab_size, 5)
    targets = tokens((3, 16), SMALL.vocab_size, 6)
    targets[0, :4] = -1  # chapter 11's ignore_index
    # logits, loss and the gradient of the loss w.r.t. every parameter (by torch name), each
    # of the same shape and dtype as torch's, within the policy
    report = assert_parity(torch_model, flax_model, (idx, targets), loss=LOSS)
    assert report["output[0]"].shape == (3, 16, SMALL.vocab_size) and report["output[1]"].shape == ()
    assert {r.name for r in report.results if r.kind == "param grad"} == set(dict(torch_model.named_parameters()))
    # A shorter sequence, no targets: loss is None.
    short = idx[:, :7]
    l_short, loss_short = flax_model(jnp.asarray(short))
    assert loss_short is None and l_short.shape == (3, 7, SMALL.vocab_size)
    assert [r.name for r in assert_parity(torch_model, flax_model, short).results if r.kind == "output"] == [
        "output[0]"
    ]


@pytest.mark.parametrize("ignored", ["some", "all"])
def test_head_cross_entropy_equals_the_composition(x64, ignored):
    """Value and gradients (input and head parameters, bias included) of the one-piece rule
    against autodiff of ``cross_entropy(head(hidden))``, float64; every target ignored gives
    NaN and zero gradients in both."""
    head = nnx.Linear(6, 13, rngs=nnx.Rngs(1), param_dtype=jnp.float64)
    head.bias[...] = jnp.asarray(np.random.default_rng(2).normal(size=13))
    hidden = jnp.asarray(np.random.default_rng(3).normal(size=(2, 4, 6)))
    targets = jnp.asarray(tokens((2, 4), 13, 4)).at[0, :2].set(-1)
    if ignored == "all":
        targets = jnp.full_like(targets, -1)
    graphdef, params = nnx.split(head)

    def composed(hidden, params):
        return fg.cross_entropy(nnx.merge(graphdef, params)(hidden), targets, -1)

    def one_piece(hidden, params):
        return flax_ln.head_cross_entropy(nnx.merge(graphdef, params), hidden, targets, -1)

    (value, grads), (expected, expected_grads) = (
        jax.value_and_grad(f, argnums=(0, 1))(hidden, params) for f in (one_piece, composed)
    )
    if ignored == "all":
        assert np.isnan(value) and np.isnan(expected)
        assert all(not np.any(leaf) for leaf in jax.tree.leaves((grads, expected_grads)))
        return
    assert relative_error(value, expected) <= 1e-14  # float64, the same ops in the same order
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        assert relative_error(got, want) <= 1e-13  # float64; the softmax gradient in another association
    # The two-output form: the logits and their forward-mode derivative are the head's own.
    direction = jax.tree.map(jnp.ones_like, (hidden, params))

    def logits_of(hidden, params):
        return flax_ln.head_logits_and_cross_entropy(nnx.merge(graphdef, params), hidden, targets, -1)[0]

    (logits, d_logits), (expected, expected_d) = (
        jax.jvp(f, (hidden, params), direction) for f in (logits_of, lambda h, p: nnx.merge(graphdef, p)(h))
    )
    # the same head call gives the same bits; the tangent is the same linear map, evaluated through
    # jax.linearize instead of jax.jvp (float64: at most a rounding of op order)
    assert relative_error(logits, expected) == 0 and relative_error(d_logits, expected_d) <= 1e-15


def test_a_head_mistake_is_named_when_the_loss_is_compared():
    """The loss's head runs inside a custom_jvp on a copy of lm_head; the logits the model
    returns still come from lm_head itself, so the capture localises a head mistake."""
    torch_model = torch_gpt(SMALL)
    flax_model = flax_twin(torch_model, flax_ln.GPT, SMALL)
    torch_model.lm_head.register_forward_hook(lambda module, inputs, output: output * 1.01)
    idx, targets = tokens((2, 8), SMALL.vocab_size, 7), tokens((2, 8), SMALL.vocab_size, 8)
    report = compare_modules(torch_model, flax_model, (idx, targets), loss=LOSS)
    assert not report.passed and report.first_divergence.module == "lm_head"


def test_music_config_ignores_padding(x64):
    config = GPTConfig.music(n_layer=2, n_head=4, n_embd=32, block_size=16)
    assert config.vocab_size == 390 and config.ignore_index == 389 and config.c_proj_reinit
    torch_model = torch_gpt(config, "float64", seed=7)
    flax_model = flax_twin(torch_model, flax_ln.GPT, config, "float64", scan_layers=True)
    idx = tokens((2, 16), 388, 8)
    targets = tokens((2, 16), 389, 9)  # notes, time shifts, velocities and EOS (388)
    targets[0, 10:] = 389  # padded to the block, as chapter 14 pads to 2048
    targets[1, 3:] = 389
    assert_parity(torch_model, flax_model, (idx, targets), loss=LOSS)  # float64: 1e-12 / 1e-10, rounding only
    l_flax, loss_flax = flax_model(jnp.asarray(idx), jnp.asarray(targets))
    assert l_flax.shape == (2, 16, 390)
    # The loss is the mean over the 13 unpadded targets only (chapter 14's ignore_index=389).
    logp = jax.nn.log_softmax(l_flax, axis=-1)
    keep = targets != 389
    manual = -np.mean(np.take_along_axis(np.asarray(logp), targets[..., None] % 390, -1)[..., 0][keep])
    assert keep.sum() == 13 and abs(float(loss_flax) - manual) <= 1e-12 * abs(manual)
    # Every target ignored: 0/0 = NaN, as torch.
    all_pad = np.full_like(targets, 389)
    with torch.no_grad():
        assert math.isnan(torch_model(torch.as_tensor(idx), torch.as_tensor(all_pad))[1].item())
    assert np.isnan(flax_model(jnp.asarray(idx), jnp.asarray(all_pad))[1])


def test_c_proj_reinit_and_init_statistics():
    config = GPTConfig.chapter12(vocab_size=64, n_layer=8, n_embd=128)
    model = flax_ln.GPT(config, scan_layers=True, rngs=nnx.Rngs(0))
    c_proj = np.asarray(model.transformer.h.attn.c_proj.kernel[...])
    c_fc = np.asarray(model.transformer.h.mlp.c_fc.kernel[...])
    torch_model = tg.GPT(config)
    # std of 8*128*128 (resp. 8*128*512) normal draws: within 3% of the target.
    want = 0.02 / math.sqrt(2 * 8)
    assert abs(c_proj.std() / want - 1) < 0.03 and abs(c_fc.std() / 0.02 - 1) < 0.03
    assert abs(torch_model.transformer.h[0].attn.c_proj.weight.std().item() / want - 1) < 0.05
    assert np.all(np.asarray(model.transformer.h.attn.c_attn.bias[...]) == 0)
    plain = flax_ln.GPT(dataclasses.replace(config, c_proj_reinit=False), rngs=nnx.Rngs(0))
    assert abs(np.asarray(plain.transformer.h[0].attn.c_proj.kernel[...]).std() / 0.02 - 1) < 0.1


# bfloat16 keeps 8 significant bits: unit roundoff u = 2^-8 ~ 3.9e-3 per rounding. Matmul
# outputs, activations and the residual stream are rounded to bfloat16 at every layer,
# while norm statistics, attention scores, softmax and the loss stay float32, so errors
# add up to a few u instead of growing through the stack. Measured against the float32
# torch model over three seeds: logits 6.2e-3 (1.6 u), loss 1.2e-4, gradients 7.7e-3 to
# 8.2e-3 as one vector (2 u) and at most 1.3e-2 per tensor (3.3 u). Bounds: ~3x that.
# float16 (u = 2^-11), two seeds: logits 8.1e-4, gradients 1.1e-3 as one vector, at most
# 1.8e-3 per tensor, loss 3e-5. Those bounds are the engine's half-precision policy; the
# loss keeps its tighter one here (measured at most 1.2e-4 in bfloat16).
HALF_LOSS_RTOL = 5e-3


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_half_precision_compute_with_float32_params(half):
    """dtype=bfloat16/float16: half-precision compute, float32 parameters and gradients, float32 norm statistics
    and loss.

    Compared with the float32 torch model (the reference), not with flax's own float32.
    The norms' float32 statistics are checked on their own in test_layernorm.py
    (bfloat16 inputs with a large offset).
    """
    torch_model = torch_gpt(SMALL)
    model = flax_twin(torch_model, flax_ln.GPT, SMALL, "float32", dtype=getattr(jnp, half))
    idx, targets = tokens((2, 16), 50, 1), tokens((2, 16), 50, 2)
    logits, loss = jax.jit(lambda s, i, t: nnx.merge(nnx.graphdef(model), s)(i, t))(
        nnx.state(model), jnp.asarray(idx), jnp.asarray(targets)
    )
    assert model.lm_head.kernel.dtype == jnp.float32
    assert logits.dtype == getattr(jnp, half) and logits.shape == (2, 16, 50)
    assert loss.dtype == jnp.float32  # the loss is taken in float32
    # the engine's half-precision policy (bfloat16: logits 2e-2, each gradient 4e-2, all
    # gradients as one vector 3e-2; float16 1/8 of that; float32 gradients w.r.t. float32
    # parameters) ...
    report = assert_parity(torch_model, model, (idx, targets), loss=LOSS, dtype=half)
    assert report["all parameter gradients"].passed
    # ... and this test's tighter bound for the loss (a float32 mean of float32 log-softmax terms)
    assert report["loss"].relative_error <= HALF_LOSS_RTOL


def test_dropout_follows_train_and_eval():
    config = dataclasses.replace(SMALL, embd_pdrop=0.5, resid_pdrop=0.5, attn_pdrop=0.5)
    for scan_layers in (False, True):
        model = flax_ln.GPT(config, scan_layers=scan_layers, rngs=nnx.Rngs(0))
        idx = jnp.asarray(tokens((1, 8), 50, 0))
        a, b = model(idx)[0], model(idx)[0]
        assert not np.allclose(a, b)  # training mode by default: fresh dropout masks per call
        model.eval()
        np.testing.assert_array_equal(model(idx)[0], model(idx)[0])


@pytest.mark.parametrize(
    "scan_layers, remat",
    [
        (False, True),  # nothing_saveable
        (True, jax.checkpoint_policies.dots_with_no_batch_dims_saveable),  # any jax.checkpoint policy
    ],
)
def test_remat_gives_the_same_gradients(x64, scan_layers, remat):
    """remat recomputes each block in the backward pass; loss, gradients and dropout RNG are unchanged.

    float64 with dropout active (the masks are recomputed from the same keys): only
    op-order rounding may differ, so 1e-12 relative.
    """
    config = dataclasses.replace(SMALL, embd_pdrop=0.3, resid_pdrop=0.3, attn_pdrop=0.3)
    idx, targets = jnp.asarray(tokens((3, 16), 50, 40)), jnp.asarray(tokens((3, 16), 50, 41))

    def run(remat):
        model = flax_ln.GPT(config, scan_layers=scan_layers, remat=remat, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        graphdef, params, rest = split(model)

        def loss_fn(params):
            model = nnx.merge(graphdef, params, rest, copy=True)  # training mode: dropout on
            return model(idx, targets)[1], nnx.state(model, nnx.RngState)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, rng_state), grads = jax.jit(grad_fn)(params)
        return loss, grads, rng_state, jax.make_jaxpr(grad_fn)(params)

    loss, grads, rng_state, plain = run(False)
    loss_r, grads_r, rng_state_r, jaxpr = run(remat)
    # really checkpointed: the norms' backward is a checkpoint of its own, the blocks add more
    assert str(jaxpr).count("remat") > str(plain).count("remat")
    assert relative_error(loss_r, loss) <= 1e-12
    for (path, g), g_r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(grads_r)):
        assert g_r.dtype == jnp.float64 and relative_error(g_r, g) <= 1e-12, path
    raw = [
        jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a
        for a in jax.tree.leaves(rng_state) + jax.tree.leaves(rng_state_r)
    ]
    for a, b in zip(raw[: len(raw) // 2], raw[len(raw) // 2 :]):  # the same dropout draws
        np.testing.assert_array_equal(a, b)


def test_remat_shrinks_the_compiled_step():
    """XLA keeps far fewer temporaries for a remat training step (deterministic: buffer sizes, not time).

    Guards the unrolled layout's recomputation against XLA:CPU, which drops
    ``jax.checkpoint``'s optimisation barriers and would otherwise merge it back into
    the forward pass (the scanned layout's recomputation sits in the backward loop).
    """
    config = GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=64, block_size=128)
    temp = {}
    for remat in (False, True):
        model = nnx.eval_shape(lambda remat=remat: flax_ln.GPT(config, remat=remat, rngs=nnx.Rngs(0)))
        graphdef, params, rest = split(model)
        tx = flax_ln.gpt_adam()
        state = flax_ln.TrainState(params, rest, jax.eval_shape(tx.init, params))
        step = flax_ln.make_train_step(flax_ln.gpt_loss, tx)
        ids = jax.ShapeDtypeStruct((4, 128), jnp.int32)
        compiled = step.lower(graphdef, state, {"idx": ids, "targets": ids}).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[True] * 2.5 <= temp[False], temp  # 3.3x here; GPT-2 124M (B=4, T=1024): 3.8x, benchmarks/RESULTS.md


def test_remat_argument_is_checked():
    with pytest.raises(ValueError, match="remat must be False, True or a jax.checkpoint policy"):
        flax_ln.GPT(SMALL, remat="full", rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------------------------
# converter


def test_round_trip_torch_flax_scanned_torch_is_bit_exact():
    torch_model = torch_gpt(SMALL, seed=11)
    sd = torch_model.state_dict()
    flax_model = flax_twin(torch_model, flax_ln.GPT, SMALL, scan_layers=True)
    assert flax_model.transformer.h.attn.c_attn.kernel.shape == (2, 32, 96)  # (n_layer, in, out)
    back = flax_ln.to_torch_state_dict(flax_model)
    assert back.keys() == sd.keys()
    assert "transformer.h.1.attn.bias" in back and back["transformer.h.1.attn.bias"].shape == (1, 1, 16, 16)
    for key, value in sd.items():
        assert back[key].dtype == np.float32 and back[key].shape == tuple(value.shape), key
        np.testing.assert_array_equal(back[key], value.numpy(), err_msg=key)
    fresh = tg.GPT(SMALL)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)
    # and the same state dict loads into the unrolled layout
    unrolled = flax_twin(fresh, flax_ln.GPT, SMALL)
    np.testing.assert_array_equal(
        unrolled.transformer.h[1].mlp.c_fc.kernel[...], flax_model.transformer.h.mlp.c_fc.kernel[...][1]
    )


@pytest.mark.parametrize("scan_layers", [False, True])
def test_converter_errors(scan_layers):
    model = flax_ln.GPT(SMALL, scan_layers=scan_layers, rngs=nnx.Rngs(0))
    before = flax_ln.to_torch_state_dict(model)

    def error(state_dict):
        with pytest.raises(ConversionError) as info:
            flax_ln.load_torch_state_dict(model, state_dict)
        return info.value

    sd = tg.GPT(SMALL).state_dict()
    layer1 = [k for k in sd if k.startswith("transformer.h.1.")]
    err = error({k: v for k, v in sd.items() if k not in layer1})  # missing layer
    assert err.missing == sorted(layer1) and len(layer1) == 13 and not err.unexpected

    deeper = tg.GPT(dataclasses.replace(SMALL, n_layer=3)).state_dict()  # extra layer
    err = error(deeper)
    assert err.unexpected == sorted(k for k in deeper if k.startswith("transformer.h.2.")) and not err.missing

    wide = tg.GPT(dataclasses.replace(SMALL, n_embd=48)).state_dict()  # head width 12 instead of 8
    err = error(wide)
    mismatched = dict(err.mismatched)
    assert mismatched["transformer.h.0.attn.c_attn.weight"] == "expected shape (96, 32), got (144, 48)"
    assert len(mismatched) == len(wide) - 2  # every weight but the two attn.bias buffers is mis-shaped

    longer = tg.GPT(dataclasses.replace(SMALL, block_size=32)).state_dict()  # another block_size
    assert {k for k, _ in error(longer).mismatched} == {
        "transformer.wpe.weight",
        "transformer.h.0.attn.bias",
        "transformer.h.1.attn.bias",
    }

    tampered = dict(sd)
    tampered["transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16)  # not causal
    assert "buffer differs" in dict(error(tampered).mismatched)["transformer.h.0.attn.bias"]

    after = flax_ln.to_torch_state_dict(model)  # nothing was written by any failed load
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


# ---------------------------------------------------------------------------------------
# Hugging Face checkpoints


def hf_tensors(torch_model, *, prefix=True, with_buffers=True, lm_head=False):
    """A GPT2LMHeadModel-style state dict: Conv1D (in, out) weights, tied lm_head omitted."""
    out = {}
    for key, value in torch_model.state_dict().items():
        value = value.numpy()
        if key.endswith(".attn.bias"):
            if not with_buffers:
                continue
            value = np.tril(np.ones(value.shape[-2:], bool))[None, None]  # HF's bool mask
            out[key.replace(".attn.bias", ".attn.masked_bias")] = np.array(-1e4, np.float32)
        elif key == "lm_head.weight" and not lm_head:
            continue
        elif key.endswith(CONV1D):
            value = value.T
        if not prefix:
            key = key.removeprefix("transformer.")
        out[key] = np.ascontiguousarray(value)
    return out


def tied_torch_gpt(config=SMALL, seed=12):
    model = torch_gpt(config, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.transformer.wte.weight)
    return model


def hf_config(config, **extra):
    return {
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        **extra,
    }


def write_hf(folder, tensors, config=None):
    folder.mkdir(exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("layout", ["folder", "folder-no-prefix", "file", "explicit-lm-head", "sharded"])
def test_hf_gpt2_loads_into_both_frameworks(tmp_path, layout):
    torch_model = tied_torch_gpt()
    tensors = hf_tensors(torch_model, prefix=layout != "folder-no-prefix", lm_head=layout == "explicit-lm-head")
    if layout == "file":
        path = tmp_path / "gpt2.safetensors"
        save_file(tensors, str(path))
        kwargs = {"config": SMALL}
    elif layout == "sharded":
        path = tmp_path / "sharded"
        path.mkdir()
        keys = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for name, ks in shards.items():
            save_file({k: tensors[k] for k in ks}, str(path / name))
        weight_map = {k: name for name, ks in shards.items() for k in ks}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (path / "config.json").write_text(json.dumps(hf_config(SMALL)))
        kwargs = {}
    else:
        path, kwargs = write_hf(tmp_path / "hf", tensors, hf_config(SMALL)), {}
    flax_model = flax_ln.load_hf_gpt2(path, scan_layers=True, **kwargs)
    torch_loaded = torch_ref.load_hf_gpt2(path, **kwargs)
    assert flax_model.config == SMALL and not torch_loaded.training
    assert dataclasses.asdict(torch_loaded.config) == dataclasses.asdict(SMALL)  # torch_ref's own config class
    assert flax_model.transformer.h.attn.c_attn.kernel.dtype == jnp.float32
    for key, value in torch_model.state_dict().items():  # the transposes undone, lm_head = wte
        np.testing.assert_array_equal(torch_loaded.state_dict()[key].numpy(), value.numpy(), err_msg=key)
    idx = tokens((2, 16), 50, 13)
    with torch.no_grad():
        expected = torch_model(torch.as_tensor(idx))[0].numpy()
    logits = flax_model(jnp.asarray(idx))[0]  # in eval mode: deterministic
    # weights read by each framework's own reader: not compare_modules, which would copy torch's
    assert compare_tensors("logits", "output", logits, expected, TOLERANCES["float32"]["output"]).passed


def test_hf_gpt2_float64_unrolled(tmp_path, x64):
    torch_model = tied_torch_gpt()
    path = write_hf(tmp_path / "hf", hf_tensors(torch_model, with_buffers=False), hf_config(SMALL))
    model = flax_ln.load_hf_gpt2(path, param_dtype=jnp.float64)
    assert model.lm_head.kernel.dtype == jnp.float64 and not model.scan_layers
    np.testing.assert_array_equal(model.lm_head.kernel[...], torch_model.transformer.wte.weight.detach().numpy().T)


def test_hf_tied_weight_mismatch_is_an_error(tmp_path):
    tensors = hf_tensors(tied_torch_gpt(), lm_head=True)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1e-3
    path = write_hf(tmp_path / "hf", tensors, hf_config(SMALL))
    for load, error in ((flax_ln.load_hf_gpt2, ConversionError), (torch_ref.load_hf_gpt2, torch_ref.HFCheckpointError)):
        with pytest.raises(error, match="lm_head.weight.*differs from transformer.wte.weight"):
            load(path)
    # An untied checkpoint keeps its own lm_head.
    untied = write_hf(tmp_path / "untied", tensors, hf_config(SMALL, tie_word_embeddings=False))
    np.testing.assert_array_equal(flax_ln.load_hf_gpt2(untied).lm_head.kernel[...], tensors["lm_head.weight"].T)


def test_hf_weight_problems_are_listed_by_the_converter(tmp_path):
    tensors = hf_tensors(tied_torch_gpt())
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    tensors["transformer.h.0.attn.c_proj.weight"] = np.zeros((32, 31), np.float32)
    tensors["score.weight"] = np.zeros((2, 32), np.float32)  # a classification head
    path = write_hf(tmp_path / "hf", tensors, hf_config(SMALL))
    with pytest.raises(ConversionError) as info:
        flax_ln.load_hf_gpt2(path)
    assert info.value.missing == ["transformer.h.1.mlp.c_fc.bias"]
    assert info.value.unexpected == ["score.weight"]
    assert [k for k, _ in info.value.mismatched] == ["transformer.h.0.attn.c_proj.weight"]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"activation_function": "gelu"}, "activation_function='gelu'"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True"),
        ({"scale_attn_weights": False}, "scale_attn_weights=False"),
        ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
        ({"n_inner": 100}, "n_inner=100"),
        ({"model_type": "gpt_neo"}, "model_type='gpt_neo'"),
        ({"add_cross_attention": True}, "add_cross_attention=True"),
    ],
)
def test_hf_unsupported_configs_are_refused(tmp_path, extra, fragment):
    path = write_hf(tmp_path / "hf", {"wte.weight": np.zeros((50, 32), np.float32)}, hf_config(SMALL, **extra))
    for load in (flax_ln.load_hf_gpt2, torch_ref.load_hf_gpt2):
        with pytest.raises(ValueError, match="cannot be expressed") as info:
            load(path)
        assert fragment in str(info.value)


def test_hf_file_errors(tmp_path):
    tensors = hf_tensors(tied_torch_gpt())
    single = tmp_path / "model.safetensors"
    save_file(tensors, str(single))
    with pytest.raises(ValueError, match="pass config=GPTConfig"):
        flax_ln.load_hf_gpt2(single)
    pickled = tmp_path / "pt"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    (pickled / "config.json").write_text(json.dumps(hf_config(SMALL)))
    with pytest.raises(FileNotFoundError, match="Only safetensors"):
        flax_ln.load_hf_gpt2(pickled)
    with pytest.raises(ValueError, match="expected a .safetensors file"):
        flax_ln.load_hf_gpt2(pickled / "pytorch_model.bin", config=SMALL)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        flax_ln.load_hf_gpt2(write_hf(tmp_path / "noconfig", tensors))
    with pytest.raises(FileNotFoundError):
        flax_ln.load_hf_gpt2(tmp_path / "absent")


# ---------------------------------------------------------------------------------------
# generation


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef, state, idx, cache, pos):
    return nnx.merge(graphdef, state).decode(idx, cache, pos)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_cached_decode_matches_full_recompute(scan_layers):
    model = flax_twin(torch_gpt(SMALL, seed=3), flax_ln.GPT, SMALL, scan_layers=scan_layers)
    graphdef, state = nnx.split(model)
    seq = jnp.asarray(tokens((2, 16), 50, 4))
    full = model(seq)[0]  # causal: position t's logits depend on seq[:, :t+1] only
    cache = model.init_cache(2)
    assert cache.k.shape == (2, 2, 4, 16, 8) and cache.k.dtype == jnp.float32  # (L, B, nh, block, hs)
    logits, cache = _decode(graphdef, state, seq[:, :5], cache, 0)  # prefill
    steps = [logits]
    for pos in range(5, 16):
        logits, cache = _decode(graphdef, state, seq[:, pos : pos + 1], cache, pos)
        steps.append(logits)
    cached = jnp.concatenate(steps, axis=1)
    assert cached.shape == full.shape
    # float32: the cached path attends over block_size slots with the extra ones at -inf
    # (exact zeros after softmax), so only reduction order differs.
    assert relative_error(cached, full) <= 1e-5
    with pytest.raises(ValueError, match="do not fit block_size 16"):
        model.decode(seq[:, :2], cache, 15)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("prompt_len, new", [(4, 20), (20, 3)])  # crosses block_size / starts beyond it
def test_greedy_generation_equals_torch(scan_layers, prompt_len, new):
    torch_model = torch_gpt(SMALL, seed=21)
    model = flax_twin(torch_model, flax_ln.GPT, SMALL, scan_layers=scan_layers)
    prompt = tokens((3, prompt_len), 50, 22)
    expected = tg.generate(torch_model, torch.as_tensor(prompt), new, temperature=0).numpy()
    got = flax_ln.generate(model, jnp.asarray(prompt, jnp.int32), new, temperature=0, rng=jax.random.key(0))
    assert got.shape == (3, prompt_len + new) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, expected)


def test_sampling():
    model = flax_twin(torch_gpt(SMALL, seed=31), flax_ln.GPT, SMALL)
    model.train()  # generate switches dropout off on its own copy, and leaves the mode alone
    prompt = jnp.asarray(np.repeat(tokens((1, 5), 50, 32), 256, axis=0), jnp.int32)
    a = flax_ln.generate(model, prompt, 3, temperature=0.8, top_k=3, rng=jax.random.key(1))
    b = flax_ln.generate(model, prompt, 3, temperature=0.8, top_k=3, rng=jax.random.key(1))
    c = flax_ln.generate(model, prompt, 3, temperature=0.8, top_k=3, rng=jax.random.key(2))
    assert model.transformer.drop.deterministic is False
    np.testing.assert_array_equal(a, b)  # same key, same tokens
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(a[:, :5], prompt)
    model.eval()
    last = np.asarray(model(prompt[:1])[0][0, -1])
    top3 = set(np.argsort(last)[-3:])
    first = set(np.asarray(a[:, 5]).tolist())
    assert first <= top3 and len(first) > 1  # only top-k tokens, and really sampled
    greedy = flax_ln.generate(model, prompt[:2], 6, temperature=0, rng=jax.random.key(3))
    top1 = flax_ln.generate(model, prompt[:2], 6, temperature=1.5, top_k=1, rng=jax.random.key(4))
    np.testing.assert_array_equal(greedy, top1)
    np.testing.assert_array_equal(flax_ln.generate(model, prompt[:1], 0, rng=jax.random.key(0)), prompt[:1])
    for kwargs, fragment in [({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_k": 51}, "top_k")]:
        with pytest.raises(ValueError, match=fragment):
            flax_ln.generate(model, prompt[:1], 2, rng=jax.random.key(0), **kwargs)
    with pytest.raises(ValueError, match="max_new_tokens"):
        flax_ln.generate(model, prompt[:1], -1, rng=jax.random.key(0))


# ---------------------------------------------------------------------------------------
# configs and bad inputs


def test_presets_and_shared_config():
    assert torch_ref.GPTConfig is not flax_ln.GPTConfig  # the reference keeps its own: it imports no flax_ln
    for preset, args in (("gpt2", ()), ("gpt2_xl", ()), ("chapter12", (10000,)), ("music", ())):
        ours, reference = getattr(GPTConfig, preset)(*args), getattr(torch_ref.GPTConfig, preset)(*args)
        assert dataclasses.asdict(ours) == dataclasses.asdict(reference), preset
        assert GPTConfig.from_any(reference) == ours and torch_ref.GPTConfig.from_any(ours) == reference
    xl = GPTConfig.gpt2_xl()
    assert (xl.n_layer, xl.n_head, xl.n_embd, xl.vocab_size, xl.block_size) == (48, 25, 1600, 50257, 1024)
    assert (xl.embd_pdrop, xl.resid_pdrop, xl.attn_pdrop, xl.ignore_index) == (0.1, 0.1, 0.1, -1)
    small = GPTConfig.gpt2()
    assert (small.n_layer, small.n_head, small.n_embd, small.vocab_size, small.block_size) == (12, 12, 768, 50257, 1024)
    c12 = GPTConfig.chapter12(vocab_size=10000)
    assert (c12.n_layer, c12.n_head, c12.n_embd, c12.vocab_size, c12.block_size, c12.c_proj_reinit) == (
        3,
        4,
        256,
        10000,
        128,
        True,
    )
    music = GPTConfig.music()
    assert (music.n_layer, music.n_head, music.n_embd, music.vocab_size, music.block_size, music.ignore_index) == (
        6,
        8,
        512,
        390,
        2048,
        389,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        xl.n_layer = 1
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        GPTConfig(n_layer=1, n_head=4, n_embd=30, vocab_size=5, block_size=4)
    with pytest.raises(ValueError, match="n_layer must be a positive int"):
        GPTConfig(n_layer=0, n_head=1, n_embd=4, vocab_size=5, block_size=4)
    with pytest.raises(ValueError, match="attn_pdrop"):
        GPTConfig(n_layer=1, n_head=1, n_embd=4, vocab_size=5, block_size=4, attn_pdrop=1.0)


def test_bad_inputs_raise_before_compute():
    model = flax_ln.GPT(SMALL, scan_layers=True, rngs=nnx.Rngs(0))
    model.eval()
    ids = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="integer token ids.*float32.*astype"):
        model(ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"idx: expected .*\(batch, seq_len <= 16\), got shape \(8,\).*idx\[None\]"):
        model(ids[0])
    with pytest.raises(ValueError, match="sequence length 17 .*block_size 16"):
        model(jnp.zeros((1, 17), jnp.int32))
    graphdef, state = nnx.split(model)
    jitted = jax.jit(lambda state, idx: nnx.merge(graphdef, state)(idx)[0])
    with pytest.raises(ValueError, match="sequence length 17 .*block_size 16"):  # static shapes: fires under jit
        jitted(state, jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="empty time axis"):
        model(jnp.zeros((2, 0), jnp.int32))
    with pytest.raises(ValueError, match="targets shape"):
        model(ids, ids[:, :4])
    with pytest.raises(ValueError, match="targets: expected integer token ids"):
        model(ids, ids.astype(jnp.float32))
    with pytest.raises(ValueError):
        torch_ref.GPT(SMALL)(torch.zeros(1, 17, dtype=torch.long))


def test_global_norm_sums_flattened_or_in_place_alike(x64):
    """The two ways ``global_norm`` reads a leaf give the same sum; a leaf of unknown sharding is flattened
    (which split leaves are summed in place instead: test_sharding.py, on 8 devices)."""
    from flax_ln.train import _squares_flattened, _squares_in_place, global_norm

    leaf = jnp.asarray(np.random.default_rng(1).normal(size=(3, 4, 5)))
    expected = float(np.sum(np.asarray(leaf) ** 2))
    for squares in (_squares_flattened, _squares_in_place):
        # float64 sums of the same 60 numbers, in another order: a few float64 roundings
        np.testing.assert_allclose(float(jax.jit(squares)(leaf)), expected, rtol=1e-14)
    assert "stablehlo.reshape" in jax.jit(global_norm).lower({"w": leaf}).as_text()


def test_global_norm_and_clip_match_torch(x64):
    """``gpt_adam``'s clip: the global norm of every leaf (one produced column-major by a
    transposed matmul under jit, as GPT-2's head gradient is) and torch's clip + Adam steps."""
    import optax

    from flax_ln.train import global_norm

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, 5)), rng.normal(size=(6, 7))
    tree = {"head": jnp.asarray(a.T @ b), "bias": jnp.asarray(rng.normal(size=7)), "half": jnp.ones(3, jnp.bfloat16)}
    transposed_dot = jax.jit(lambda a, b, t: global_norm({**t, "head": jnp.einsum("ti,tj->ij", a, b)}))
    expected = math.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in tree.values()))
    # float64 sums of the same numbers in another order: a few float64 roundings.
    np.testing.assert_allclose(float(transposed_dot(jnp.asarray(a), jnp.asarray(b), tree)), expected, rtol=1e-13)
    np.testing.assert_allclose(float(global_norm(tree)), float(optax.global_norm(tree)), rtol=1e-13)

    params = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3)}
    grads = [{k: 5 * rng.normal(size=v.shape) for k, v in params.items()} for _ in range(2)]  # norm > 1: clipping on
    tx = flax_ln.gpt_adam()
    state, p = tx.init(params), {k: jnp.asarray(v) for k, v in params.items()}
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.Adam(list(tp.values()), lr=1e-4)
    for g in grads:
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, p)
        p = optax.apply_updates(p, updates)
        for k, v in tp.items():
            v.grad = torch.tensor(g[k])
        torch.nn.utils.clip_grad_norm_(list(tp.values()), 1.0)
        opt.step()
    for k in params:  # float64 Adam with the same formula in another operation order: float64 roundings
        np.testing.assert_allclose(np.asarray(p[k]), tp[k].detach().numpy(), rtol=1e-12, atol=1e-15)
