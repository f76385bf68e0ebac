"""EncoderDecoderConfig: its checks name the field, its presets, plain data from torch_ref, and the models built
from it are the ones the book's make_model arguments build (flax, Linen, torch). Tiny sizes: no compiling."""

import dataclasses
import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import flax_ln
import flax_ln.linen
import torch_ref
from flax_ln import recipes

SIZES = dict(src_vocab=5, tgt_vocab=7, N=1, d_model=8, d_ff=16, h=2)
CONFIGS = [flax_ln.EncoderDecoderConfig, torch_ref.EncoderDecoderConfig]


@pytest.mark.parametrize("cls", CONFIGS, ids=["flax_ln", "torch_ref"])
@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("N", 0, "N must be a positive int, got 0"),
        ("src_vocab", True, "src_vocab must be a positive int, got True"),
        ("d_ff", 2.0, "d_ff must be a positive int, got 2.0"),
        ("max_len", -1, "max_len must be a positive int, got -1"),
        ("h", 3, "d_model=8 is not divisible by h=3"),
        ("dropout", 1.0, r"dropout must be a float in \[0, 1\), got 1.0"),
        ("dropout", "0.1", r"dropout must be a float in \[0, 1\), got '0.1'"),
        ("ffn_activation", "gelu", r"ffn_activation must be one of \[None, 'relu'\], got 'gelu'"),
    ],
)
def test_a_bad_field_is_named_with_what_was_expected_and_given(cls, field, value, says):
    with pytest.raises(ValueError, match=f"EncoderDecoderConfig: {says}"):
        cls(**{**SIZES, field: value})


def test_presets():
    ch10 = flax_ln.EncoderDecoderConfig.chapter10(11, 13)
    assert (ch10.src_vocab, ch10.tgt_vocab, ch10.N, ch10.d_model, ch10.d_ff, ch10.h) == (11, 13, 6, 256, 1024, 8)
    assert (ch10.dropout, ch10.ffn_activation, ch10.max_len) == (0.1, None, 5000)
    assert flax_ln.EncoderDecoderConfig.chapter10(11, 13, N=2).N == 2
    base = flax_ln.EncoderDecoderConfig.base(11, 13)
    assert (base.N, base.d_model, base.d_ff, base.h, base.dropout) == (6, 512, 2048, 8, 0.1)
    # the presets are the defaults of the functions that take the sizes one by one
    fields = {f.name for f in dataclasses.fields(base)} - {"src_vocab", "tgt_vocab", "max_len"}
    for make_model in (flax_ln.make_model, flax_ln.linen.make_model, torch_ref.make_model):
        defaults = {k: p.default for k, p in inspect.signature(make_model).parameters.items() if k in fields}
        assert defaults == {k: getattr(base, k) for k in fields}
    setup = inspect.signature(recipes.encoder_decoder_setup).parameters
    names = dict(
        layers="N", d_model="d_model", d_ff="d_ff", heads="h", dropout="dropout", ffn_activation="ffn_activation"
    )
    assert {k: setup[k].default for k in names} == {k: getattr(ch10, v) for k, v in names.items()}


def test_from_any_reads_plain_data():
    want = flax_ln.EncoderDecoderConfig(**SIZES, ffn_activation="relu", max_len=32)
    theirs = torch_ref.EncoderDecoderConfig(**SIZES, ffn_activation="relu", max_len=32)
    assert flax_ln.EncoderDecoderConfig.from_any(theirs) == want
    assert torch_ref.EncoderDecoderConfig.from_any(want) == theirs
    assert flax_ln.EncoderDecoderConfig.from_any(want) is want
    # a reference file's make_model spec: "sizes" plus "ffn_activation"; the other fields take the defaults
    spec = {"builder": "make_model", "sizes": dict(SIZES), "ffn_activation": "relu"}
    from_spec = flax_ln.EncoderDecoderConfig.from_any({**spec["sizes"], "ffn_activation": spec["ffn_activation"]})
    assert from_spec == dataclasses.replace(want, max_len=5000)
    assert flax_ln.EncoderDecoderConfig.from_any(types.SimpleNamespace(**SIZES, extra=1)).N == 1
    numpy_sizes = flax_ln.EncoderDecoderConfig.from_any({k: np.int64(v) for k, v in SIZES.items()})
    assert type(numpy_sizes.d_model) is int and numpy_sizes == flax_ln.EncoderDecoderConfig(**SIZES)
    for cls in CONFIGS:
        with pytest.raises(TypeError, match=r"lacks \['tgt_vocab'\]"):
            cls.from_any({"src_vocab": 5})


def weights(model: nnx.Module) -> dict:
    """Every parameter and buffer (the positional tables) of ``model``, as a pure dict; no RNG state."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.RngState)))


def test_a_config_builds_what_make_model_builds():
    config = flax_ln.EncoderDecoderConfig(**SIZES, dropout=0.2, ffn_activation="relu")
    args = dict(SIZES, dropout=0.2, ffn_activation="relu")
    ours = flax_ln.make_model(**args, rngs=nnx.Rngs(3))
    for other in (
        flax_ln.Transformer.from_config(config, rngs=nnx.Rngs(3)),
        flax_ln.Transformer.from_config(torch_ref.EncoderDecoderConfig(**args), rngs=nnx.Rngs(3)),
    ):
        assert nnx.graphdef(other) == nnx.graphdef(ours)
        jax.tree.map(np.testing.assert_array_equal, weights(other), weights(ours))
    short = flax_ln.Transformer.from_config(dataclasses.replace(config, max_len=16), rngs=nnx.Rngs(3))
    assert short.src_embed[1].pe.shape == short.tgt_embed[1].pe.shape == (1, 16, 8)

    torch.manual_seed(3)
    book = torch_ref.make_model(**args).state_dict()
    torch.manual_seed(3)
    twin = torch_ref.Transformer.from_config(config).state_dict()  # flax_ln's config, read as plain data
    assert list(twin) == list(book) and all(torch.equal(twin[k], book[k]) for k in book)
    torch.manual_seed(3)
    pe = torch_ref.Transformer.from_config(dataclasses.replace(config, max_len=16)).src_embed[1].pe
    assert pe.shape == (1, 16, 8)


def test_the_linen_transformer_of_a_config_is_linen_make_model():
    config = torch_ref.EncoderDecoderConfig(**SIZES)  # read as plain data
    src = tgt = jnp.ones((2, 3), jnp.int32)
    masks = flax_ln.make_src_mask(src, 0), flax_ln.make_std_mask(tgt, 0)
    key = jax.random.key(0)
    ours = flax_ln.linen.Transformer(config, deterministic=True).init(key, src, tgt, *masks)
    book = flax_ln.linen.make_model(**SIZES, deterministic=True).init(key, src, tgt, *masks)
    assert jax.tree.structure(ours) == jax.tree.structure(book)
    jax.tree.map(np.testing.assert_array_equal, ours, book)
