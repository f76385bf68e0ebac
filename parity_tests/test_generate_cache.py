"""The KV cache of :func:`flax_ln.generate` and :meth:`GPT.decode`: same tokens as recomputing every step,
short caches, and no copy of the whole cache per layer in the compiled loop."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_ln
from flax_ln.models import sampling as fg
from flax_ln.parity import relative_error

TINY = flax_ln.GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=50, block_size=16)


def model(scan_layers: bool) -> flax_ln.GPT:
    return flax_ln.GPT(TINY, scan_layers=scan_layers, rngs=nnx.Rngs(5))


def greedy_by_recompute(gpt: flax_ln.GPT, prompt: np.ndarray, new: int) -> np.ndarray:
    """The book's loop without a cache: run the whole context (the last block_size tokens) for every new token.

    The context is padded to block_size, so one compiled forward serves every step: a causal
    model's logits at position t do not depend on the tokens after t.
    """
    gpt.eval()
    graphdef, state = nnx.split(gpt)
    forward = jax.jit(lambda idx: nnx.merge(graphdef, state)(idx)[0])
    seq = np.asarray(prompt)
    for _ in range(new):
        context = seq[:, -TINY.block_size :]
        n = context.shape[1]
        padded = np.pad(context, ((0, 0), (0, TINY.block_size - n)))  # (B, block_size)
        logits = forward(jnp.asarray(padded))[:, n - 1]  # (B, V): the logits after the last real token
        seq = np.concatenate([seq, np.asarray(jnp.argmax(logits, axis=-1))[:, None]], axis=1)
    return seq


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("prompt_len, new", [(3, 10), (5, 15)])  # inside block_size / into the window phase
def test_cached_greedy_equals_recomputing_every_token(scan_layers, prompt_len, new):
    gpt = model(scan_layers)
    prompt = np.random.default_rng(prompt_len).integers(0, TINY.vocab_size, (2, prompt_len)).astype(np.int32)
    got = flax_ln.generate(gpt, jnp.asarray(prompt), new, temperature=0, rng=jax.random.key(0))
    np.testing.assert_array_equal(got, greedy_by_recompute(gpt, prompt, new))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decode_into_a_short_cache_matches_the_full_forward(scan_layers):
    gpt = model(scan_layers)
    gpt.eval()
    seq = jnp.asarray(np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 9)), jnp.int32)
    full = gpt(seq)[0]  # (B, 9, V)
    cache = gpt.init_cache(2, length=9)
    assert cache.k.shape == cache.v.shape == (2, 2, 4, 9, 8)  # (L, B, nh, S, hs)
    logits, cache = gpt.decode(seq[:, :4], cache, 0)
    steps = [logits]
    for pos in range(4, 9):
        logits, cache = gpt.decode(seq[:, pos : pos + 1], cache, pos)
        steps.append(logits)
    # float32: only the reduction order of the attention differs (9 slots, T=1 queries) from the full pass
    assert relative_error(jnp.concatenate(steps, axis=1), full) <= 1e-5
    # every layer's slots hold that layer's keys: writing layer i must leave the other layers alone
    assert not np.allclose(cache.k[0], cache.k[1])
    with pytest.raises(ValueError, match="do not fit the cache's length 9"):
        gpt.decode(seq[:, :1], cache, 9)
    for bad in (0, 17, 2.0):
        with pytest.raises(ValueError, match=r"length must be an int in \[1, block_size=16\]"):
            gpt.init_cache(2, length=bad)


def loop_instructions(hlo: str) -> list[str]:
    """The instructions of every while-loop body in optimised HLO text, with what those bodies call, nested."""
    computations = dict(re.findall(r"^(?:ENTRY )?%(\S+) .*?\{\n(.*?)^\}", hlo, re.S | re.M))
    todo = re.findall(r"\bbody=%([\w.\-]+)", hlo)
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += re.findall(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)", computations[name])
    return [line for name in seen for line in computations[name].splitlines()]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_compiled_generation_never_copies_the_whole_cache_per_token(scan_layers):
    # Writing a layer's keys as cache.k.at[i].set(...) after updating a slice made XLA copy the whole
    # (L, B, nh, S, hs) buffer for every layer at every token: 24 x 38 MB per GPT-2 124M token.
    graphdef, state = nnx.split(model(scan_layers))
    prompt = jnp.zeros((2, 4), jnp.int32)
    hlo = (
        fg._generate.lower(
            graphdef,
            state,
            prompt,
            jax.random.key(0),
            jnp.float32(1.0),
            max_new_tokens=9,
            greedy=True,
            top_k=None,
            vocab_limit=None,
        )
        .compile()
        .as_text()
    )
    cache_shape = "f32[2,2,4,12,8]"  # (L, B, nh, S, hs), S = min(block_size, 4 + 9 - 1)
    body = loop_instructions(hlo)
    assert any(cache_shape in line for line in body)  # the token loop carries the cache, at its short length
    copies = [line.strip() for line in body if re.search(r"= \S+ copy\(", line)]
    assert not [c for c in copies if cache_shape in c], copies


def test_top_k_sampling_compiles_without_sorting_the_vocabulary():
    # Taking the k-th value as top_k(...)[0][:, -1:] made XLA:CPU sort all V logits per token
    # (~180 ms at B=8, V=50257); the min of the top k values is the same number without the sort.
    pick = jax.jit(lambda logits, key: fg._pick(logits, key, 1.0, greedy=False, top_k=3, vocab_limit=None))
    logits = jax.random.normal(jax.random.key(0), (2, 50))
    hlo = pick.lower(logits, jax.random.key(1)).compile().as_text()
    assert not re.search(r"= \S+ sort\(", hlo)
    drawn = np.asarray(jax.vmap(lambda k: pick(logits, k))(jax.random.split(jax.random.key(2), 200)))  # (200, B)
    top3 = np.argsort(np.asarray(logits), axis=-1)[:, -3:]
    for row in range(2):
        assert set(drawn[:, row]) == set(top3[row])  # only, and all of, the top 3
