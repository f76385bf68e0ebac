"""Token ids out of range: clear errors at every public entry point (flax_ln.models.checks).

An id indexes an embedding table or a row of logits. torch raises IndexError for one
outside ``[0, vocab)``; ``jnp.take`` wraps negative ids around and reads NaN past the end,
so without these checks a bad id gives finite, wrong numbers or NaN without a word.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import flax_ln
import flax_ln.models.encoder_decoder as fe
import flax_ln.models.encoder_decoder.decoding as fd
import flax_ln.models.sampling as fg
from flax_ln import GPT, GPTConfig

V = 10  # GPT vocabulary
CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=V, block_size=8, ignore_index=-1)
SRC_V, TGT_V = 7, 9  # encoder-decoder vocabularies, different so that a mix-up shows


@pytest.fixture(scope="module")
def gpt():
    model = GPT(CONFIG, rngs=nnx.Rngs(0))
    model.eval()
    return model


@pytest.fixture(scope="module")
def seq2seq():
    model = flax_ln.make_model(SRC_V, TGT_V, N=1, d_model=8, d_ff=16, h=2, rngs=nnx.Rngs(0))
    model.eval()
    return model


@pytest.fixture
def no_gpt_compute(monkeypatch):
    """Fail if the GPT starts computing: the ids must be refused first."""

    def boom(*args, **kwargs):
        raise AssertionError("compute started before the ids were validated")

    monkeypatch.setattr(fg.GPT, "_forward", boom)
    monkeypatch.setattr(fg, "_generate", boom)


@pytest.fixture
def no_seq2seq_compute(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("compute started before the ids were validated")

    monkeypatch.setattr(fe.Embeddings, "__call__", boom)
    monkeypatch.setattr(fd, "_greedy_decode", boom)


# ---- eager calls: ValueError naming the argument, the bad values, their positions and the range ----


@pytest.mark.parametrize("bad", [-1, V, -V - 1, 1000])
def test_gpt_idx_out_of_range(gpt, no_gpt_compute, bad):
    ids = np.array([[1, bad, 3]])
    with pytest.raises(ValueError, match=rf"GPT: idx holds 1 id\(s\) outside .*: {bad} at \(0, 1\)\..*\[0, {V}\)"):
        gpt(ids)
    with pytest.raises(ValueError, match=rf"GPT\.decode: idx .*{bad} at \(0, 1\)"):
        gpt.decode(jnp.asarray(ids), gpt.init_cache(1), 0)
    with pytest.raises(ValueError, match=rf"generate: idx .*{bad} at \(0, 1\)"):
        flax_ln.generate(gpt, ids, 2, rng=jax.random.key(0))


def test_gpt_lists_several_bad_ids(gpt, no_gpt_compute):
    ids = np.full((2, 8), -3)
    with pytest.raises(ValueError, match=r"idx holds 16 id\(s\) .*-3 at \(0, 0\), -3 at \(0, 1\).*\(and 11 more\)"):
        gpt(ids)


def test_gpt_targets(gpt):
    idx = np.array([[1, 2, 3, 4]])
    for bad in (-5, V, -2):  # -1 is the ignore_index; any other negative is an error
        targets = np.array([[2, 3, bad, 5]])
        with pytest.raises(ValueError, match=rf"GPT: targets .*{bad} at \(0, 2\).*\[0, {V}\) \(or ignore_index=-1\)"):
            gpt(idx, targets)
    _, loss = gpt(idx, np.array([[2, -1, 0, V - 1]]))  # ignore_index and both ends of the range are legal
    _, kept = gpt(idx[:, [0, 2, 3]], np.array([[2, 0, V - 1]]))
    assert np.isfinite(float(loss)) and np.isfinite(float(kept))


def test_gpt_ignore_index_inside_the_vocabulary():
    model = GPT(GPTConfig.music(n_layer=1, n_head=2, n_embd=8, block_size=8), rngs=nnx.Rngs(0))
    idx = np.array([[1, 2]])
    assert np.isfinite(float(model(idx, np.array([[389, 5]]))[1]))  # the padding id 389 < vocab 390
    with pytest.raises(ValueError, match=r"targets .*390 at \(0, 1\).*\[0, 390\) \(or ignore_index=389\)"):
        model(idx, np.array([[389, 390]]))


@pytest.mark.parametrize("bad", [-1, SRC_V, 50])
def test_encoder_decoder_src_and_tgt(seq2seq, no_seq2seq_compute, bad):
    src = np.array([[1, 2, bad]])
    tgt = np.array([[1, 2]])
    src_mask, tgt_mask = np.ones((1, 1, 3), bool), np.asarray(flax_ln.subsequent_mask(2))
    with pytest.raises(ValueError, match=rf"Transformer: src .*{bad} at \(0, 2\).*\[0, {SRC_V}\)"):
        seq2seq(src, tgt, src_mask, tgt_mask)
    with pytest.raises(ValueError, match=rf"Transformer\.encode: src .*{bad} at \(0, 2\)"):
        seq2seq.encode(src, src_mask)
    with pytest.raises(ValueError, match=rf"greedy_decode: src .*{bad} at \(0, 2\)"):
        flax_ln.greedy_decode(seq2seq, src, src_mask, 3, 1)


@pytest.mark.parametrize("bad", [-1, TGT_V])
def test_encoder_decoder_tgt(seq2seq, no_seq2seq_compute, bad):
    src, tgt = np.array([[1, 2, 3]]), np.array([[1, bad]])
    src_mask, tgt_mask = np.ones((1, 1, 3), bool), np.asarray(flax_ln.subsequent_mask(2))
    with pytest.raises(ValueError, match=rf"Transformer: tgt .*{bad} at \(0, 1\).*\[0, {TGT_V}\)"):
        seq2seq(src, tgt, src_mask, tgt_mask)
    memory = jnp.zeros((1, 3, 8))
    with pytest.raises(ValueError, match=rf"Transformer\.decode: tgt .*{bad} at \(0, 1\)"):
        seq2seq.decode(memory, src_mask, tgt, tgt_mask)


@pytest.mark.parametrize("start", [-1, TGT_V, 99, 1.0, True, "1", np.array([1, 2])])
def test_greedy_decode_start_symbol(seq2seq, no_seq2seq_compute, start):
    src = jnp.array([[1, 2, 3]])
    with pytest.raises(ValueError, match=rf"greedy_decode: start_symbol.*\[0, {TGT_V}\)"):
        flax_ln.greedy_decode(seq2seq, src, jnp.ones((1, 1, 3), bool), 3, start)


def test_valid_ids_still_decode(seq2seq, gpt):
    src = jnp.array([[0, SRC_V - 1, 3]])
    ys = flax_ln.greedy_decode(seq2seq, src, jnp.ones((1, 1, 3), bool), 3, np.int64(TGT_V - 1))
    assert ys.shape == (1, 3) and int(ys[0, 0]) == TGT_V - 1
    out = flax_ln.generate(gpt, np.array([[0, V - 1]]), 3, temperature=0, rng=jax.random.key(0))
    assert out.shape == (1, 5) and ((0 <= np.asarray(out)) & (np.asarray(out) < V)).all()


def test_label_smoothing_targets():
    log_probs = jax.nn.log_softmax(jnp.zeros((4, 6)))
    for bad in (-1, 6):
        with pytest.raises(ValueError, match=rf"label_smoothing_loss: target .*{bad} at \(2,\).*\[0, 6\)"):
            flax_ln.label_smoothing_loss(log_probs, jnp.array([1, 0, bad, 5]), padding_idx=0)
    assert np.isfinite(float(flax_ln.label_smoothing_loss(log_probs, jnp.array([1, 0, 2, 5]), padding_idx=0)))


# ---- under jit: no check by default (documented behaviour), checkify with debug_checks ----


def test_traced_ids_without_debug_checks_behave_as_documented(gpt):
    logits = jax.jit(lambda idx: gpt(idx)[0])
    np.testing.assert_array_equal(logits(jnp.array([[1, -1]])), logits(jnp.array([[1, V - 1]])))  # wraps around
    assert np.isnan(np.asarray(logits(jnp.array([[1, V]])))).all()  # reads NaN, which attention spreads


def test_debug_checks_catch_traced_ids_with_checkify():
    model = GPT(CONFIG, debug_checks=True, rngs=nnx.Rngs(0))
    model.eval()
    loss = checkify.checkify(jax.jit(lambda idx, targets: model(idx, targets)[1]))
    idx, targets = jnp.array([[1, 2, 3], [4, 5, 6]]), jnp.array([[2, 3, 4], [5, -1, 7]])
    err, good = loss(idx, targets)
    assert err.get() is None and np.isfinite(float(good))
    err, _ = loss(idx.at[1, 2].set(V), targets)
    assert err.get().startswith(f"GPT: idx holds an id outside [0, {V}): {V} at index [1 2]")
    err, _ = loss(idx, targets.at[0, 1].set(-4))
    assert err.get().startswith(f"GPT: targets holds an id outside [0, {V}) (or ignore_index=-1): -4 at index [0 1]")
    with pytest.raises(ValueError, match="checkify"):  # a checked model under a bare jit is refused, not silent
        jax.jit(lambda idx: model(idx)[0])(idx)


def test_debug_checks_in_the_encoder_decoder_and_loss():
    model = flax_ln.make_model(SRC_V, TGT_V, N=1, d_model=8, d_ff=16, h=2, debug_checks=True, rngs=nnx.Rngs(0))
    model.eval()
    src_mask, tgt_mask = jnp.ones((1, 1, 3), bool), flax_ln.subsequent_mask(2)
    call = checkify.checkify(jax.jit(lambda src, tgt: model(src, tgt, src_mask, tgt_mask)))
    assert call(jnp.array([[1, 2, 3]]), jnp.array([[1, 2]]))[0].get() is None
    assert (
        call(jnp.array([[1, 2, SRC_V]]), jnp.array([[1, 2]]))[0]
        .get()
        .startswith(f"Transformer: src holds an id outside [0, {SRC_V}): {SRC_V} at index [0 2]")
    )
    assert (
        call(jnp.array([[1, 2, 3]]), jnp.array([[-1, 2]]))[0]
        .get()
        .startswith(f"Transformer: tgt holds an id outside [0, {TGT_V}): -1 at index [0 0]")
    )
    loss = checkify.checkify(
        jax.jit(lambda t: flax_ln.label_smoothing_loss(jnp.zeros((2, 6)), t, padding_idx=0, debug_checks=True))
    )
    assert loss(jnp.array([1, 5]))[0].get() is None
    assert loss(jnp.array([1, 6]))[0].get().startswith("label_smoothing_loss: target holds an id outside [0, 6)")
