"""Parity of flax_ln.models.encoder_decoder and flax_ln.train with the book's torch reference.

The reference is torch_ref.encoder_decoder.

Each component is tested before the whole model. A torch module gets random weights,
its flax twin receives them through the converter, both run in eval mode, and we
compare the output and the gradient of ``sum(output * cotangent)`` with respect to
every floating input and every parameter, keyed by torch name: all through the parity
engine (:func:`flax_ln.parity.check_case`) and its one tolerance policy.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import flax_ln
import torch_ref
from flax_ln.models import encoder_decoder as fe
from flax_ln.parity import TOLERANCES, Case, check_case, compare_tensors, relative_error, zero_gradient_names
from torch_ref import encoder_decoder as te

N, D, D_FF, H = 2, 32, 64, 4  # small config: the whole file runs in well under a minute
SRC_V, TGT_V, PAD = 11, 13, 0
B, S, T = 3, 7, 5
DROPOUT = 0.1  # built with dropout, run in eval mode: proves eval() switches it off


def torch_dtype(dtype):
    return getattr(torch, dtype)


def perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Add noise to every parameter so that no ones/zeros initialisation hides a swapped or unused weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


def tokens(rng, vocab, shape, pad_tail):
    """Random non-pad ids with the last ``pad_tail[b]`` positions of row b set to PAD."""
    x = rng.integers(1, vocab, size=shape)
    for b, n in enumerate(pad_tail):
        if n:
            x[b, -n:] = PAD
    return x


def to_jax(x):
    return jnp.asarray(x.astype(np.int32) if np.issubdtype(x.dtype, np.integer) else x)


def check(torch_mod, flax_mod, inputs, out_shape, forward=None):
    """Every output and gradient (inputs and parameters) within the engine's policy for the parameters'
    dtype; the engine also checks that flax's dtypes are torch's. Returns flax's output in eval mode."""
    dtype = str(next(torch_mod.parameters()).dtype).removeprefix("torch.")
    case = Case(
        "encoder-decoder part",
        torch_mod,
        flax_mod,
        inputs,
        [f"input{i}" for i in range(len(inputs))],
        dtype=dtype,
        forward=forward,
    )
    report = check_case(case)
    assert report.passed, str(report)
    output = next(r for r in report.results if r.kind == "output")
    assert output.shape == out_shape
    flax_mod.eval()
    args = [to_jax(x) for x in inputs]
    return np.asarray(flax_mod(*args) if forward is None else forward(flax_mod, *args))


@pytest.fixture(params=["float64", "float32"])
def dtype(request):
    if request.param == "float64":
        request.getfixturevalue("x64")
    return request.param


def rngs():
    return nnx.Rngs(params=0, dropout=1)


# ---- components -------------------------------------------------------------------------------


def attention_inputs(kind, dtype, rng):
    """query, key, value and a mask; the last batch row has every key masked out."""
    q_len, k_len = (T, S) if kind == "cross" else (T, T)
    q = rng.normal(size=(B, q_len, D)).astype(dtype)
    k = rng.normal(size=(B, k_len, D)).astype(dtype)
    v = rng.normal(size=(B, k_len, D)).astype(dtype)
    if kind == "none":
        return [q, k, v]
    if kind == "causal":
        tgt = tokens(rng, TGT_V, (B, T), pad_tail=[0, 2, T])  # row 2 is all padding
        mask = te.make_std_mask(torch.tensor(tgt), PAD).numpy()  # (B, T, T)
    else:  # padding mask over the keys, broadcast over the queries
        src = tokens(rng, SRC_V, (B, k_len), pad_tail=[0, 3, k_len])
        mask = (src != PAD)[:, None, :]  # (B, 1, Tk)
    assert not mask[-1].any()  # a row where every key is padding
    return [q, k, v, mask]


@pytest.mark.parametrize("kind", ["none", "padding", "causal", "cross"])
def test_attention(dtype, kind):
    torch.manual_seed(0)
    torch_mod = perturb(te.MultiHeadedAttention(H, D, DROPOUT), 1).to(torch_dtype(dtype))
    flax_mod = fe.MultiHeadedAttention(H, D, dropout=DROPOUT, param_dtype=jnp.dtype(dtype), rngs=rngs())
    inputs = attention_inputs(kind, dtype, np.random.default_rng(2))
    out = check(torch_mod, flax_mod, inputs, (B, T, D))
    # -1e9, not -inf: the fully masked row attends uniformly (finite), as in torch.
    assert np.isfinite(out).all()


@pytest.mark.parametrize("activation", [None, "relu"])
def test_feed_forward(dtype, activation):
    torch.manual_seed(0)
    torch_mod = perturb(te.PositionwiseFeedForward(D, D_FF, DROPOUT, activation), 1).to(torch_dtype(dtype))
    flax_mod = fe.PositionwiseFeedForward(
        D, D_FF, dropout=DROPOUT, activation=activation, param_dtype=jnp.dtype(dtype), rngs=rngs()
    )
    x = np.random.default_rng(3).normal(size=(B, T, D)).astype(dtype)
    out = check(torch_mod, flax_mod, [x], (B, T, D))
    # The two activations really differ: the book's network is affine, the Annotated one is not.
    affine = np.asarray(flax_mod.w_2(flax_mod.w_1(jnp.asarray(x))))
    assert (relative_error(out, affine) < 1e-6) == (activation is None)


class TorchResidualFFN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sublayer = te.SublayerConnection(D, DROPOUT)
        self.feed_forward = te.PositionwiseFeedForward(D, D_FF, DROPOUT)

    def forward(self, x):
        return self.sublayer(x, self.feed_forward)


class FlaxResidualFFN(nnx.Module):
    def __init__(self, *, param_dtype, rngs):
        self.sublayer = fe.SublayerConnection(D, dropout=DROPOUT, param_dtype=param_dtype, rngs=rngs)
        self.feed_forward = fe.PositionwiseFeedForward(D, D_FF, dropout=DROPOUT, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.sublayer(x, self.feed_forward)


def test_sublayer_connection(dtype):
    torch.manual_seed(0)
    torch_mod = perturb(TorchResidualFFN(), 1).to(torch_dtype(dtype))
    flax_mod = FlaxResidualFFN(param_dtype=jnp.dtype(dtype), rngs=rngs())
    x = (np.random.default_rng(4).normal(size=(B, T, D)) * 2 + 1).astype(dtype)
    check(torch_mod, flax_mod, [x], (B, T, D))


def test_encoder_layer(dtype):
    torch.manual_seed(0)
    layer = te.EncoderLayer(
        D, te.MultiHeadedAttention(H, D, DROPOUT), te.PositionwiseFeedForward(D, D_FF, DROPOUT), DROPOUT
    )
    torch_mod = perturb(layer, 1).to(torch_dtype(dtype))
    flax_mod = fe.EncoderLayer(D, H, D_FF, dropout=DROPOUT, param_dtype=jnp.dtype(dtype), rngs=rngs())
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, S, D)).astype(dtype)
    mask = (tokens(rng, SRC_V, (B, S), pad_tail=[0, 2, 4]) != PAD)[:, None, :]  # (B, 1, S)
    check(torch_mod, flax_mod, [x, mask], (B, S, D))


def test_decoder_layer(dtype):
    torch.manual_seed(0)
    layer = te.DecoderLayer(
        D,
        te.MultiHeadedAttention(H, D, DROPOUT),
        te.MultiHeadedAttention(H, D, DROPOUT),
        te.PositionwiseFeedForward(D, D_FF, DROPOUT),
        DROPOUT,
    )
    torch_mod = perturb(layer, 1).to(torch_dtype(dtype))
    flax_mod = fe.DecoderLayer(D, H, D_FF, dropout=DROPOUT, param_dtype=jnp.dtype(dtype), rngs=rngs())
    rng = np.random.default_rng(6)
    x = rng.normal(size=(B, T, D)).astype(dtype)
    memory = rng.normal(size=(B, S, D)).astype(dtype)
    src_mask = (tokens(rng, SRC_V, (B, S), pad_tail=[0, 2, 4]) != PAD)[:, None, :]  # (B, 1, S)
    tgt_mask = te.make_std_mask(torch.tensor(tokens(rng, TGT_V, (B, T), pad_tail=[1, 0, 2])), PAD).numpy()
    check(torch_mod, flax_mod, [x, memory, src_mask, tgt_mask], (B, T, D))


def test_embeddings_and_positional_encoding(dtype):
    torch.manual_seed(0)
    torch_mod = perturb(torch.nn.Sequential(te.Embeddings(D, SRC_V), te.PositionalEncoding(D, DROPOUT)), 1)
    torch_mod = torch_mod.to(torch_dtype(dtype))
    flax_mod = fe.Sequential(
        [
            fe.Embeddings(D, SRC_V, param_dtype=jnp.dtype(dtype), rngs=rngs()),
            fe.PositionalEncoding(D, dropout=DROPOUT, param_dtype=jnp.dtype(dtype), rngs=rngs()),
        ]
    )
    src = tokens(np.random.default_rng(7), SRC_V, (B, S), pad_tail=[0, 1, 3])
    check(torch_mod, flax_mod, [src], (B, S, D))
    # The table came from torch and goes back bit for bit.
    np.testing.assert_array_equal(flax_ln.to_torch_state_dict(flax_mod)["1.pe"], torch_mod[1].pe.numpy())
    assert flax_mod[1].pe.shape == (1, 5000, D)


def test_sinusoid_table_matches_torch():
    """flax's own table (used when no torch weights are loaded) against the book's and float64 truth."""
    for d_model in (D, 256):
        ours, book = fe.sinusoid_table(d_model), torch_ref.encoder_decoder.sinusoid_table(d_model).numpy()
        assert ours.shape == book.shape == (1, 5000, d_model) and ours.dtype == np.float32
        position = np.arange(5000)[:, None]
        angle = position * np.exp(np.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        truth = np.stack([np.sin(angle), np.cos(angle)], -1).reshape(1, 5000, d_model)  # interleaved sin, cos
        # float32 angles p*w are off by up to ~ulp(5000) = 5e-4 at the last positions (the
        # book's table as much); the first positions are exact to float32 rounding.
        for table in (ours, book):
            assert np.abs(table - truth).max() <= 1e-3
            assert np.abs(table - truth)[:, :100].max() <= 1e-5


def test_generator(dtype):
    torch.manual_seed(0)
    torch_mod = perturb(te.Generator(D, TGT_V), 1).to(torch_dtype(dtype))
    flax_mod = fe.Generator(D, TGT_V, param_dtype=jnp.dtype(dtype), rngs=rngs())
    x = np.random.default_rng(8).normal(size=(B, T, D)).astype(dtype)
    out = check(torch_mod, flax_mod, [x], (B, T, TGT_V))
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, rtol=1e-5)  # log-probabilities


# ---- the whole model --------------------------------------------------------------------------


def model_pair(dtype, ffn_activation=None, seed=0):
    torch.manual_seed(seed)
    torch_model = te.make_model(SRC_V, TGT_V, N, D, D_FF, H, DROPOUT, ffn_activation)
    torch_model = perturb(torch_model, seed + 1).to(torch_dtype(dtype))
    flax_model = flax_ln.make_model(
        SRC_V,
        TGT_V,
        N,
        D,
        D_FF,
        H,
        DROPOUT,
        ffn_activation,
        param_dtype=jnp.dtype(dtype),
        rngs=nnx.Rngs(params=seed, dropout=seed + 1),
    )
    return torch_model, flax_model


def model_inputs(rng):
    src = tokens(rng, SRC_V, (B, S), pad_tail=[0, 3, S])  # the last source is all padding
    tgt = tokens(rng, TGT_V, (B, T), pad_tail=[0, 2, 1])
    src_mask = (src != PAD)[:, None, :]  # (B, 1, S)
    tgt_mask = te.make_std_mask(torch.tensor(tgt), PAD).numpy()  # (B, T, T)
    return [src, tgt, src_mask, tgt_mask]


def full_model(m, src, tgt, src_mask, tgt_mask):
    return m.generator(m(src, tgt, src_mask, tgt_mask))


@pytest.mark.parametrize("ffn_activation", [None, "relu"])
def test_full_model(dtype, ffn_activation):
    torch_model, flax_model = model_pair(dtype, ffn_activation)
    inputs = model_inputs(np.random.default_rng(9))
    check(torch_model, flax_model, inputs, (B, T, TGT_V), forward=full_model)
    # encode / decode / __call__ agree and keep the parameter dtype
    src, tgt, src_mask, tgt_mask = map(to_jax, inputs)
    memory = flax_model.encode(src, src_mask)
    out = flax_model.decode(memory, src_mask, tgt, tgt_mask)
    assert memory.shape == (B, S, D) and out.shape == (B, T, D) and out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(out, flax_model(src, tgt, src_mask, tgt_mask))


def test_state_dict_round_trip_and_book_keys():
    torch_model, flax_model = model_pair("float32")
    sd = torch_model.state_dict()
    for key in [
        "encoder.layers.0.sublayer.1.norm.a_2",
        "decoder.layers.1.sublayer.2.norm.b_2",
        "decoder.layers.0.src_attn.linears.3.weight",
        "src_embed.0.lut.weight",
        "src_embed.1.pe",
        "tgt_embed.1.pe",
        "generator.proj.weight",
        "encoder.norm.a_2",
    ]:
        assert key in sd, key
    back = flax_ln.to_torch_state_dict(flax_ln.load_torch_state_dict(flax_model, sd))
    assert back.keys() == sd.keys()
    for key, value in sd.items():
        assert back[key].dtype == np.float32 and back[key].shape == tuple(value.shape), key
        np.testing.assert_array_equal(back[key], value.numpy(), err_msg=key)
    fresh = te.make_model(SRC_V, TGT_V, N, D, D_FF, H, DROPOUT)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)
    # a flax-initialised model exports a state dict the book's model loads strictly
    fresh.load_state_dict(
        {
            k: torch.from_numpy(v)
            for k, v in flax_ln.to_torch_state_dict(
                flax_ln.make_model(SRC_V, TGT_V, N, D, D_FF, H, rngs=nnx.Rngs(3))
            ).items()
        },
        strict=True,
    )


def test_mask_helpers_match_torch():
    tgt = tokens(np.random.default_rng(10), TGT_V, (B, T), pad_tail=[0, 2, T])
    np.testing.assert_array_equal(fe.subsequent_mask(T), te.subsequent_mask(T).numpy())
    np.testing.assert_array_equal(fe.make_std_mask(to_jax(tgt), PAD), te.make_std_mask(torch.tensor(tgt), PAD).numpy())
    assert fe.make_std_mask(to_jax(tgt), PAD).dtype == jnp.bool_ and fe.subsequent_mask(T).shape == (1, T, T)
    assert fe.make_src_mask(to_jax(tgt), PAD).shape == (B, 1, T)


# ---- initialisation and dropout ---------------------------------------------------------------


def test_make_model_init_is_xavier_uniform():
    model = flax_ln.make_model(SRC_V, TGT_V, N, D, D_FF, H, rngs=nnx.Rngs(0))
    params = flax_ln.to_torch_state_dict(model)  # torch names and layouts: (out, in) for Linear
    for name, w in params.items():
        assert w.dtype == np.float32, name
        if name.endswith(".pe"):
            continue
        if w.ndim > 1:  # Xavier-uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out)), std a/sqrt(3)
            bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
            assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound, name
            assert abs(w.std() / (bound / math.sqrt(3)) - 1) < 0.2, name
        elif name.endswith("a_2"):
            np.testing.assert_array_equal(w, 1.0)
        elif name.endswith("b_2"):
            np.testing.assert_array_equal(w, 0.0)
        else:  # Linear bias: torch's default U(±1/sqrt(fan_in)), kept by the book
            fan_in = params[name[: -len("bias")] + "weight"].shape[1]
            assert np.abs(w).max() <= 1 / math.sqrt(fan_in) and w.std() > 0, name
    # every layer has its own weights (the book re-initialises its deep copies)
    first, second = (params[f"encoder.layers.{i}.self_attn.linears.0.weight"] for i in (0, 1))
    assert not np.array_equal(first, second)
    # and the same statistics as the torch reference's initialisation
    torch_w = te.make_model(SRC_V, TGT_V, N, D, D_FF, H).state_dict()["decoder.layers.0.feed_forward.w_1.weight"]
    flax_w = params["decoder.layers.0.feed_forward.w_1.weight"]
    assert abs(flax_w.std() / torch_w.std().item() - 1) < 0.1


def test_dropout_follows_train_and_eval():
    # N=1: train-mode dropout (threefry bits at every site) is slow to compile
    model = flax_ln.make_model(SRC_V, TGT_V, 1, D, D_FF, H, dropout=0.3, rngs=nnx.Rngs(0))
    args = [to_jax(x) for x in model_inputs(np.random.default_rng(11))]
    model.eval()
    y_eval = model(*args)
    np.testing.assert_array_equal(model(*args), y_eval)  # eval: deterministic
    model.train()
    y_train1, y_train2 = model(*args), model(*args)
    assert relative_error(y_train1, y_eval) > 1e-2  # train: dropout is active ...
    assert relative_error(y_train1, y_train2) > 1e-2  # ... with a fresh mask each call
    model.eval()
    np.testing.assert_array_equal(model(*args), y_eval)


def test_mixed_precision_compute_dtype():
    """dtype=bfloat16 computes in bfloat16 with float32 parameters; log-probs come back in float32."""
    model = flax_ln.make_model(SRC_V, TGT_V, N, D, D_FF, H, rngs=nnx.Rngs(0))
    model.eval()
    half = flax_ln.make_model(SRC_V, TGT_V, N, D, D_FF, H, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    half.eval()
    assert half.encoder.layers[0].self_attn.linears[0].kernel.dtype == jnp.float32
    args = [to_jax(x) for x in model_inputs(np.random.default_rng(12))]
    out = jax.jit(lambda *a: half(*a))(*args)
    assert out.dtype == jnp.bfloat16 and out.shape == (B, T, D)
    logp = half.generator(out)
    assert logp.dtype == jnp.float32
    # bfloat16 keeps 8 bits: a few 2^-8 relative through the stack (norms run in float32).
    assert relative_error(out.astype(jnp.float32), model(*args)) < 5e-2


# ---- bad input ------------------------------------------------------------------------------


@pytest.fixture
def no_compute(monkeypatch):
    """Fail loudly if the model starts computing: errors must come before any work."""

    def boom(self, x):
        raise AssertionError("compute started before the input was validated")

    monkeypatch.setattr(fe.Embeddings, "__call__", boom)


@pytest.mark.parametrize("jit", [False, True])
def test_bad_input_raises_before_compute(no_compute, jit):
    model = flax_ln.make_model(SRC_V, TGT_V, N, D, D_FF, H, rngs=nnx.Rngs(0))
    src, tgt, src_mask, tgt_mask = (to_jax(x) for x in model_inputs(np.random.default_rng(13)))
    call = jax.jit(lambda *a: model(*a)) if jit else model
    long_src, long_mask = jnp.ones((1, 5001), jnp.int32), jnp.ones((1, 1, 5001), bool)
    cases = [
        (
            (src.astype(jnp.float32), tgt, src_mask, tgt_mask),
            r"src: expected integer token ids of shape \(batch, seq_len <= 5000\).*float32",
        ),
        (
            (src, tgt.astype(jnp.float32), src_mask, tgt_mask),
            r"tgt: expected integer token ids of shape \(3, seq_len <= 5000\)",
        ),
        (
            (src, tgt, src_mask[:, :, :-1], tgt_mask),
            r"src_mask: expected a boolean mask of shape \(3 or 1, 7 or 1, 7\), .*\(3, 1, 6\)",
        ),
        (
            (src, tgt, src_mask, tgt_mask[:, :, :-1]),
            r"tgt_mask: expected a boolean mask of shape \(3 or 1, 5 or 1, 5\), .*\(3, 5, 4\)",
        ),
        ((src, tgt, src_mask, tgt_mask.astype(jnp.float32)), r"tgt_mask: .*dtype float32"),
        # a (B, S, S) source mask cannot serve the decoder's T=5 queries
        ((src, tgt, jnp.ones((B, S, S), bool), tgt_mask), r"src_mask: expected .*\(3 or 1, 5 or 1, 7\)"),
        ((src, tgt[:2], src_mask, tgt_mask[:2]), r"tgt: expected .*\(3, seq_len <= 5000\), got shape \(2, 5\)"),
        ((long_src, tgt[:1], long_mask, tgt_mask[:1]), r"src: .*seq_len <= 5000.*\(1, 5001\)"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            call(*args)
    with pytest.raises(ValueError, match=r"memory: expected a floating-point array of shape \(\*, \*, 32\)"):
        model.decode(jnp.ones((B, S, D + 1)), src_mask, tgt, tgt_mask)


def test_bad_input_to_components():
    attn = fe.MultiHeadedAttention(H, D, rngs=nnx.Rngs(0))
    x = jnp.ones((B, T, D))
    with pytest.raises(ValueError, match=r"mask: expected a boolean mask of shape \(3 or 1, 5 or 1, 5\)"):
        attn(x, x, x, jnp.ones((B, T, T + 1), bool))
    attn.eval()
    causal, x = fe.subsequent_mask(T), jnp.asarray(np.random.default_rng(17).normal(size=(B, T, D)), jnp.float32)
    np.testing.assert_array_equal(attn(x, x, x, causal.astype(jnp.int32)), attn(x, x, x, causal))  # 0/1 masks, as torch
    with pytest.raises(ValueError, match=r"query: expected a floating-point array of shape \(\*, \*, 32\)"):
        attn(jnp.ones((B, T, D + 1)), x, x)
    with pytest.raises(ValueError, match=r"value: expected .*\(3, 5, 32\)"):
        attn(x, x, jnp.ones((B, T + 1, D)))
    with pytest.raises(ValueError, match="x: expected at most max_len=4 positions"):
        fe.PositionalEncoding(D, max_len=4, rngs=nnx.Rngs(0))(x)
    with pytest.raises(ValueError, match=r"x: expected integer token ids"):
        fe.Embeddings(D, SRC_V, rngs=nnx.Rngs(0))(jnp.ones((B, T)))
    with pytest.raises(ValueError, match="divisible"):
        fe.MultiHeadedAttention(5, D, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="activation"):
        fe.PositionwiseFeedForward(D, D_FF, activation="gelu", rngs=nnx.Rngs(0))


# ---- chapter-10 training pieces ---------------------------------------------------------------


def test_label_smoothing_matches_torch(dtype):
    rng = np.random.default_rng(14)
    n, vocab = 40, TGT_V
    logits = rng.normal(size=(n, vocab)) * 2
    log_probs = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(dtype)
    target = rng.integers(0, vocab, size=n)
    target[:5] = PAD  # padded positions add nothing
    crit = te.LabelSmoothing(vocab, PAD, 0.1)
    x_t = torch.tensor(log_probs, requires_grad=True)
    loss_t = crit(x_t, torch.tensor(target))
    loss_t.backward()
    loss_f, grad_f = jax.value_and_grad(flax_ln.label_smoothing_loss)(
        jnp.asarray(log_probs), to_jax(target), padding_idx=PAD, smoothing=0.1
    )
    assert loss_f.shape == () and loss_f.dtype == jnp.dtype(dtype)
    # float64: the same sum in a different order; float32: 40x13 terms summed in two orders.
    tol = 1e-12 if dtype == "float64" else 1e-6
    assert relative_error(loss_f, loss_t.item()) <= tol
    assert relative_error(grad_f, x_t.grad.numpy()) <= tol  # d/dx = -true_dist
    np.testing.assert_array_equal(-np.asarray(grad_f), crit.true_dist.numpy())
    # leading dims are allowed: (B, T, V) with (B, T) targets is the same loss
    loss_3d = flax_ln.label_smoothing_loss(
        jnp.asarray(log_probs).reshape(4, 10, vocab), to_jax(target).reshape(4, 10), padding_idx=PAD
    )
    assert relative_error(loss_3d, loss_f) <= tol
    with pytest.raises(ValueError, match=r"target: expected integer class ids of shape \(40,\)"):
        flax_ln.label_smoothing_loss(jnp.asarray(log_probs), jnp.zeros((41,), jnp.int32), padding_idx=PAD)


def test_label_smoothing_closed_form_at_the_edges(x64):
    """No smoothing, full smoothing and a tiny vocabulary against the book's target-building
    loss (float64); traced out-of-range targets poison the loss with NaN instead of a wrong number."""
    rng = np.random.default_rng(16)
    for vocab, smoothing in [(3, 0.1), (TGT_V, 0.0), (TGT_V, 1.0), (TGT_V, 0.3)]:
        logits = rng.normal(size=(12, vocab))
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        target = rng.integers(0, vocab, size=12)
        target[:3] = PAD
        x_t = torch.tensor(log_probs, requires_grad=True)
        loss_t = te.LabelSmoothing(vocab, PAD, smoothing)(x_t, torch.tensor(target))
        loss_t.backward()
        loss_f, grad_f = jax.value_and_grad(flax_ln.label_smoothing_loss)(
            jnp.asarray(log_probs), to_jax(target), padding_idx=PAD, smoothing=smoothing
        )
        # float64: a sum over 12 x vocab terms in another order (closed form against the full target)
        assert relative_error(loss_f, loss_t.item()) <= 1e-12, (vocab, smoothing)
        assert relative_error(grad_f, x_t.grad.numpy()) <= 1e-12, (vocab, smoothing)
    bad_target = jnp.array([1, 2, vocab])
    loss = jax.jit(lambda t: flax_ln.label_smoothing_loss(jnp.asarray(log_probs[:3]), t, padding_idx=PAD))(bad_target)
    assert np.isnan(float(loss))
    with pytest.raises(ValueError, match="at least 3 classes"):
        flax_ln.label_smoothing_loss(jnp.zeros((4, 2)), jnp.zeros((4,), jnp.int32), padding_idx=0)


def test_noam_schedule_matches_torch(x64):
    for d_model, factor, warmup in [(256, 1.0, 2000), (512, 2.0, 4000), (D, 1.0, 4)]:
        schedule = flax_ln.noam_schedule(d_model, factor, warmup)
        steps = np.array([1, 2, 3, warmup - 1, warmup, warmup + 1, 10 * warmup, 100_000])
        ours = np.array([float(schedule(s - 1)) for s in steps])  # optax counts from 0, the book from 1
        ref = np.array([te.noam_rate(int(s), d_model, factor, warmup) for s in steps])
        # float64: the same closed form evaluated in a different order.
        assert relative_error(ours, ref) <= 1e-13
        assert ours.argmax() == list(steps).index(warmup)  # peak at the end of the warm-up


def test_optimizer_step_matches_torch(x64):
    """Two Adam + Noam steps in eval mode: the same parameters in both frameworks, float64."""
    factor, warmup = 1.0, 4  # a large rate, so that the update itself is tested, not just the weights
    torch_model, flax_model = model_pair("float64")
    flax_ln.load_torch_state_dict(flax_model, torch_model.state_dict())
    torch_model.eval()
    flax_model.eval()
    rng = np.random.default_rng(15)
    src = tokens(rng, SRC_V, (B, S), pad_tail=[0, 3, 1])
    tgt = tokens(rng, TGT_V, (B, T + 1), pad_tail=[0, 2, 1])

    # torch: the book's loop, the rate set before each Adam step
    src_t, tgt_t = torch.tensor(src), torch.tensor(tgt)
    tgt_in, tgt_y = tgt_t[:, :-1], tgt_t[:, 1:]
    src_mask, tgt_mask = (src_t != PAD).unsqueeze(-2), te.make_std_mask(tgt_in, PAD)
    ntokens = (tgt_y != PAD).sum().item()
    criterion = te.LabelSmoothing(TGT_V, PAD, 0.1)
    opt = torch.optim.Adam(torch_model.parameters(), lr=0, betas=(0.9, 0.98), eps=1e-9)

    # flax: split once, one jitted step
    tx = flax_ln.noam_adam(D, factor, warmup)
    graphdef, state = flax_ln.init_train_state(flax_model, tx)
    step = flax_ln.make_train_step(flax_ln.encoder_decoder_loss(PAD), tx)
    batch = flax_ln.make_batch(to_jax(src), to_jax(tgt), PAD)
    np.testing.assert_array_equal(batch["tgt_mask"], tgt_mask.numpy())
    np.testing.assert_array_equal(batch["src_mask"], src_mask.numpy())
    assert int(batch["ntokens"]) == ntokens

    before = {k: v.detach().numpy().copy() for k, v in torch_model.named_parameters()}
    total_lr = 0.0
    zero_grad = set()
    policy = TOLERANCES["float64"]
    for n in (1, 2):
        total_lr += te.noam_rate(n, D, factor, warmup)
        for group in opt.param_groups:
            group["lr"] = te.noam_rate(n, D, factor, warmup)
        opt.zero_grad()
        logp = torch_model.generator(torch_model(src_t, tgt_in, src_mask, tgt_mask))
        loss_t = criterion(logp.reshape(-1, TGT_V), tgt_y.reshape(-1)) / ntokens
        loss_t.backward()
        # the engine's zero-gradient rule finds the key projections' biases (softmax ignores
        # a shift of a whole row of scores): 2 attentions in each of N=2 decoder layers and
        # 1 in each encoder layer, 6 tensors of rounding noise
        zero_grad |= zero_gradient_names({k: p.grad.numpy() for k, p in torch_model.named_parameters()})
        assert len(zero_grad) == 6 and all(k.endswith("linears.1.bias") for k in zero_grad), zero_grad
        opt.step()
        state, loss_f = step(graphdef, state, batch)
        assert loss_f.dtype == jnp.float64 and loss_f.shape == ()
        assert compare_tensors("loss", "loss", loss_f, loss_t.item(), policy["output"]).passed

        after_f = flax_ln.to_torch_state_dict(nnx.merge(graphdef, state.params, state.rest))
        updates_t, updates_f = [], []
        for name, p in torch_model.named_parameters():
            p_t = p.detach().numpy()
            assert after_f[name].dtype == np.float64 and after_f[name].shape == p_t.shape
            if name in zero_grad:
                # Exact gradient 0, rounding noise ~1e-17 in both frameworks, which Adam's
                # g / (|g| + 1e-9) turns into moves of ~1e-8 of the rate, different on each side
                # (torch against torch with another op order would differ as much). Both must
                # stay at that noise level: no real step.
                for moved in (p_t - before[name], after_f[name] - before[name]):
                    assert np.abs(moved).max() <= 1e-6 * total_lr, name
                continue
            # float64: the weights agree to rounding after the update (the policy's gradient bound)
            assert compare_tensors(name, "param", after_f[name], p_t, policy["grad"]).passed, name
            updates_t.append((p_t - before[name]).ravel())
            updates_f.append((after_f[name] - before[name]).ravel())
        # the update itself (lr * Adam direction) agrees, so the check above is not vacuous
        assert relative_error(np.concatenate(updates_f), np.concatenate(updates_t)) <= 1e-9
        assert np.linalg.norm(np.concatenate(updates_t)) > 1e-3


def test_train_step_is_generic_over_loss_and_optimizer():
    """The same step with a GPT-style setup: cross-entropy and clip(1) + Adam(1e-4); dropout RNG advances."""
    model = flax_ln.make_model(SRC_V, TGT_V, 1, D, D_FF, H, rngs=nnx.Rngs(0))
    model.train()

    def cross_entropy(model, batch):
        logits = model.generator.proj(model(batch["src"], batch["tgt"], batch["src_mask"], batch["tgt_mask"]))
        mask = batch["tgt_y"] != PAD  # ignore_index
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt_y"])
        return jnp.sum(losses * mask) / jnp.sum(mask)

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-4))
    graphdef, state = flax_ln.init_train_state(model, tx)
    step = flax_ln.make_train_step(cross_entropy, tx)
    rng = np.random.default_rng(16)
    src, tgt = tokens(rng, SRC_V, (B, S), [0, 1, 2]), tokens(rng, TGT_V, (B, T + 1), [0, 1, 2])
    batch = flax_ln.make_batch(to_jax(src), to_jax(tgt), PAD)
    counts = lambda st: [int(c) for c in jax.tree.leaves(nnx.filter_state(st.rest, nnx.RngCount))]  # noqa: E731
    params_before = flax_ln.to_torch_state_dict(model)
    losses, before = [], counts(state)
    for _ in range(3):
        state, loss = step(graphdef, state, batch)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    params_after = flax_ln.to_torch_state_dict(nnx.merge(graphdef, state.params, state.rest))
    moved = max(np.abs(params_after[k] - params_before[k]).max() for k in params_before)
    # Adam moves a weight by about lr per step (|m̂|/sqrt(v̂) is near 1 and rarely above): 3 steps of 1e-4
    assert 1e-5 < moved <= 1.5 * 3e-4
    assert all(a > b for a, b in zip(counts(state), before))  # fresh dropout masks every step
    assert step._cache_size() == 1  # compiled once for the whole loop
