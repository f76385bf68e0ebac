"""The models ``flax-ln parity`` checks: each builder returns a :class:`flax_ln.parity.Case`.

A builder takes ``(dtype, batch, seq_len, seed)`` and makes a torch_ref module with
random weights, its flax twin (weights are copied by the harness) and random inputs;
:data:`BUILDERS` has one for each name of :data:`flax_ln.book.catalog.MODEL_NAMES`.
torch is imported here; importing :mod:`flax_ln` does not import this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import flax_ln
import flax_ln.train
import torch_ref
from flax_ln.book.catalog import ENCODER_DECODER_LIMIT, GPT_CONFIG, MODEL_NAMES, MUSIC_CONFIG, check_seq_len
from flax_ln.book.reference import decoder_output_and_log_probs, logits_and_loss
from flax_ln.parity import Case, TrainSpec


def _perturb(module: torch.nn.Module, seed: int, scale: float = 0.1, *, replace: bool = False) -> None:
    """Add normal(0, scale) noise to every parameter (or, with ``replace``, set it to such noise),
    so ones/zeros initialisations (norm scales, biases) cannot hide a swapped or transposed
    weight, while small noise keeps a deep model's activations sane."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale
            if replace:
                p.copy_(noise)
            else:
                p.add_(noise)


def _regression_training(target: np.ndarray, learning_rate: float) -> TrainSpec:
    """Training for a lone layer: mean squared error to a fixed random target, Adam, no clipping."""
    return TrainSpec(
        loss=(lambda y: ((y - torch.from_numpy(target)) ** 2).mean(), lambda y: jnp.mean((y - target) ** 2)),
        torch_optimizer=lambda m: (torch.optim.Adam(m.parameters(), lr=learning_rate), None),
        optax_optimizer=optax.adam(learning_rate),
    )


def norm_case(
    name: str,
    torch_norm: torch.nn.Module,
    flax_cls,
    dtype: str,
    batch: int,
    seq_len: int,
    seed: int,
    features: int,
    randomize: bool = True,
) -> Case:
    """A norm layer (random with ``randomize``, else as given) and its flax twin on one random ``x``;
    Adam on a squared error for training."""
    if randomize:
        _perturb(torch_norm, seed, scale=1.0, replace=True)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((batch, seq_len, features)) * 2 + 0.5).astype(dtype)
    return Case(
        name=name,
        torch_model=torch_norm.to(getattr(torch, dtype)),
        flax_model=flax_cls(features, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed)),
        inputs=[x],
        input_names=["x"],
        dtype=dtype,
        train=_regression_training(rng.standard_normal(x.shape).astype(dtype), learning_rate=1e-2),
        spec={"builder": flax_cls.__name__, "features": features, "eps": torch_norm.eps},
    )


def layernorm(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """The chapter-9 LayerNorm (torch_ref.LayerNorm vs flax_ln.LayerNorm), 512 features."""
    return norm_case("layernorm", torch_ref.LayerNorm(512), flax_ln.LayerNorm, dtype, batch, seq_len or 16, seed, 512)


def torch_layernorm(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """torch.nn.LayerNorm vs its twin flax_ln.TorchLayerNorm, 1600 features (GPT-2XL width)."""
    return norm_case(
        "torch-layernorm", torch.nn.LayerNorm(1600), flax_ln.TorchLayerNorm, dtype, batch, seq_len or 16, seed, 1600
    )


def encoder_decoder(
    dtype: str,
    batch: int,
    seq_len: int | None,
    seed: int,
    *,
    sizes: dict | None = None,
    torch_model: torch.nn.Module | None = None,
    ffn_activation: str | None = None,
    name: str = "encoder-decoder",
) -> Case:
    """Chapters 9-10's encoder-decoder, by default on a small config (N=2, d_model 32, 4 heads, d_ff 64,
    vocab 13), with padding in the source and the pad+causal target mask. Pad id 0."""
    sizes = sizes or dict(src_vocab=13, tgt_vocab=13, N=2, d_model=32, d_ff=64, h=4)
    pad, d_model = 0, sizes["d_model"]
    src_vocab, vocab = sizes["src_vocab"], sizes["tgt_vocab"]
    seq_len = seq_len or 10
    check_seq_len(name, seq_len, *ENCODER_DECODER_LIMIT)
    if torch_model is None:
        torch.manual_seed(seed)
        torch_model = torch_ref.make_model(**sizes, dropout=0.1, ffn_activation=ffn_activation)
        _perturb(torch_model, seed)
    torch_model = torch_model.to(getattr(torch, dtype))
    flax_model = flax_ln.make_model(
        **sizes, dropout=0.1, ffn_activation=ffn_activation, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed)
    )
    rng = np.random.default_rng(seed)
    src = rng.integers(1, src_vocab, (batch, seq_len)).astype(np.int64)
    tgt = rng.integers(1, vocab, (batch, seq_len + 1)).astype(np.int64)
    src[0, seq_len // 2 :] = pad  # padding: masked keys in self- and source attention
    tgt[-1, (seq_len + 1) // 2 :] = pad
    tgt_in, tgt_y = tgt[:, :-1], tgt[:, 1:]
    src_mask = (src != pad)[:, None, :]  # (B, 1, S)
    tgt_mask = torch_ref.make_std_mask(torch.from_numpy(tgt_in), pad).numpy()  # (B, T, T)
    ntokens = int((tgt_y != pad).sum())

    criterion = torch_ref.LabelSmoothing(vocab, padding_idx=pad, smoothing=0.1)

    def torch_loss(outputs):
        return criterion(outputs["log probs"].reshape(-1, vocab), torch.from_numpy(tgt_y).reshape(-1)) / ntokens

    def flax_loss(outputs):
        return (
            flax_ln.label_smoothing_loss(outputs["log probs"], jnp.asarray(tgt_y), padding_idx=pad, smoothing=0.1)
            / ntokens
        )

    def torch_optimizer(m):  # chapter 10: Adam(0.9, 0.98, 1e-9) with the Noam rate set before each step
        opt = torch.optim.Adam(m.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: torch_ref.noam_rate(s + 1, d_model, 1.0, 400))

    return Case(
        name=name,
        torch_model=torch_model,
        flax_model=flax_model,
        inputs=[src, tgt_in, src_mask, tgt_mask],
        input_names=["src", "tgt", "src_mask", "tgt_mask"],
        dtype=dtype,
        forward=decoder_output_and_log_probs,
        train=TrainSpec((torch_loss, flax_loss), torch_optimizer, flax_ln.noam_adam(d_model, 1.0, 400)),
        lm_logits="log probs",
        spec={"builder": "make_model", "sizes": dict(sizes), "ffn_activation": ffn_activation},
    )


def _the_loss(outputs):
    return outputs["loss"]


def gpt_case(
    name: str,
    config: flax_ln.GPTConfig,
    dtype: str,
    batch: int,
    seq_len: int,
    seed: int,
    pad_targets: bool,
    torch_model: torch.nn.Module | None = None,
) -> Case:
    """A torch_ref.GPT (random, or the given one) and a flax_ln.GPT on (idx, targets);
    the book's Adam(1e-4) + clip 1 for training."""
    check_seq_len(name, seq_len, config.block_size, "positions (its block_size)")
    if torch_model is None:
        torch.manual_seed(seed)
        torch_model = torch_ref.GPT(config)
        _perturb(torch_model, seed, scale=0.02)
    torch_model = torch_model.to(getattr(torch, dtype))
    flax_model = flax_ln.GPT(config, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, config.vocab_size, (batch, seq_len)).astype(np.int64)
    targets = rng.integers(0, config.vocab_size, (batch, seq_len)).astype(np.int64)
    targets[0, seq_len - max(1, seq_len // 4) :] = config.ignore_index  # positions the loss skips
    if pad_targets:
        idx[0, seq_len - max(1, seq_len // 4) :] = config.ignore_index  # padding is a real token id too

    return Case(
        name=name,
        torch_model=torch_model,
        flax_model=flax_model,
        inputs=[idx, targets],
        input_names=["idx", "targets"],
        dtype=dtype,
        forward=logits_and_loss,
        train=TrainSpec(
            loss=(_the_loss, _the_loss),
            torch_optimizer=lambda m: (torch.optim.Adam(m.parameters(), lr=1e-4), None),
            optax_optimizer=flax_ln.train.gpt_adam(1e-4, clip_norm=1.0),
            clip_norm=1.0,
        ),
        lm_logits="logits",
        spec={"builder": "GPT", "config": dataclasses.asdict(config)},
    )


def gpt(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """A small GPT (2 layers, 4 heads, width 64, vocab 50, block 32), chapter 11's loss (ignore_index -1)."""
    return gpt_case("gpt", GPT_CONFIG, dtype, batch, seq_len or 16, seed, pad_targets=False)


def music(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """Chapter 14's music Transformer at full width (8 heads, 512, vocab 390, block 2048) with 2 layers,
    loss ignoring the padding id 389."""
    return gpt_case("music", MUSIC_CONFIG, dtype, batch, seq_len or 32, seed, pad_targets=True)


def gpt2_xl_block(dtype: str, batch: int, seq_len: int | None, seed: int) -> Case:
    """One full-width GPT-2XL block: n_embd 1600, 25 heads, block_size 1024."""
    from flax_ln.models.gpt import Block as FlaxBlock
    from torch_ref.gpt import Block as TorchBlock

    config = flax_ln.GPTConfig.gpt2_xl()
    seq_len = seq_len or 32
    check_seq_len("gpt2-xl-block", seq_len)
    torch.manual_seed(seed)
    torch_block = TorchBlock(torch_ref.gpt.GPTConfig.from_any(config))
    _perturb(torch_block, seed, scale=0.02)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq_len, config.n_embd)).astype(dtype)
    return Case(
        name="gpt2-xl-block",
        torch_model=torch_block.to(getattr(torch, dtype)),
        flax_model=FlaxBlock(config, param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed)),
        inputs=[x],
        input_names=["x"],
        dtype=dtype,
        train=_regression_training(rng.standard_normal(x.shape).astype(dtype), learning_rate=1e-4),
        spec={"builder": "Block", "config": dataclasses.asdict(config)},
    )


# One builder per name, found by the name (``gpt2-xl-block`` -> :func:`gpt2_xl_block`), in the catalog's order.
BUILDERS: dict[str, Callable[[str, int, int | None, int], Case]] = {
    name: globals()[name.replace("-", "_")] for name in MODEL_NAMES
}
