"""Chapter 14's music Transformer: training throughput against the book's own loop.

Row ``music-throughput`` (float32, this CPU; ``--quick`` shrinks the model to a toy):
``GPTConfig.music()``, the book's 6 layers, 8 heads, width 512, vocabulary 390, block
size 2048, dropout 0.1 on in both frameworks, at T=2048 tokens per sequence (the book's
training length, = the block size) and B=2 (the book gives no batch size for chapter 14,
so 2 is our choice). Targets are the inputs shifted left, with the second sequence's tail
padded by 389 as the book's data pipeline pads a shorter piece.

* flax_ln: ``make_train_step(gpt_loss, gpt_adam())`` (forward, cross-entropy ignoring
  389, backward, torch-style clip to norm 1, Adam 1e-4), state donated.
* torch: the book's loop on ``torch_ref.GPT``: ``logits = model(x)``,
  ``nn.CrossEntropyLoss(ignore_index=389)`` on the flattened logits, backward,
  ``clip_grad_norm_(params, 1)``, ``Adam(lr=1e-4)``; eager, and with
  ``torch.compile(model)`` (the loss, clip and optimizer step stay eager, as in the book).

Same weights on both sides (``flax_ln.load_torch_state_dict``). Reported as training
tokens per second (B * T / step time) and flax_ln's time ratio; no target is set.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from common import Config, Table, add_torch_compile, interleaved, register, timing_rows, torch_device
from flax import nnx

import flax_ln
from flax_ln import GPTConfig

END, PAD = 388, 389  # chapter 14's end-of-sequence and padding ids
BOOK_BATCH = 2  # the book's chapter 14 gives none: our choice
MAX_REPEATS = 3  # a step is seconds long on 2 cores: keeps the full row under 8 minutes


def music_batch(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (B, T) event ids in ``[0, 388)`` and ``y`` = ``x`` shifted left, as chapter 14's sequences.

    Row 0 is a piece longer than T (``y`` continues it); the other rows are pieces of
    length ``3T/4``: ``x`` padded with 389, ``y[L-1] = 388`` (end) and the rest 389, ignored by the loss.
    """
    rng = np.random.default_rng(seed)
    events = min(END, vocab_size)
    pieces = rng.integers(0, events, (batch, seq_len + 1))
    x, y = pieces[:, :-1].copy(), pieces[:, 1:].copy()
    length = 3 * seq_len // 4
    x[1:, length:] = PAD
    y[1:, length - 1] = END
    y[1:, length:] = PAD
    return x, y


def torch_music_step(model, x: np.ndarray, y: np.ndarray, forward=None):
    """The book's chapter-14 step: cross-entropy ignoring 389, backward, clip to norm 1, Adam 1e-4."""
    import torch

    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=PAD)
    device = next(model.parameters()).device
    x_t, y_t = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)
    forward = model if forward is None else forward  # a compiled module has no truth value

    def run() -> float:
        opt.zero_grad(set_to_none=True)
        logits, _ = forward(x_t)  # (B, T, vocab); torch_ref.GPT returns (logits, None) without targets
        loss = loss_fn(logits.reshape(-1, logits.size(-1)), y_t.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()  # waits for the step (also on a GPU)

    return run


@register("music-throughput")
def music_throughput(cfg: Config) -> list[Table]:
    import torch
    from bench_gpt import FlaxStep

    import torch_ref

    if cfg.quick:
        config = GPTConfig.music(n_layer=1, n_head=4, n_embd=64, block_size=64)
        batch, seq_len = 2, 64
    else:
        config, batch, seq_len = GPTConfig.music(), BOOK_BATCH, 2048
    if seq_len > config.block_size:
        raise ValueError(f"music-throughput: T={seq_len} exceeds the config's block_size {config.block_size}")
    repeats = cfg.repeats if cfg.quick else min(cfg.repeats, MAX_REPEATS)
    x, y = music_batch(config.vocab_size, batch, seq_len)
    torch.manual_seed(0)
    reference = torch_ref.GPT(config).train()
    device = torch_device()

    def torch_twin():
        model = torch_ref.GPT(config).train()
        model.load_state_dict(reference.state_dict())
        return model.to(device)

    flax_model = flax_ln.GPT(config, rngs=nnx.Rngs(0))
    flax_ln.load_torch_state_dict(flax_model, reference.state_dict())
    ours = FlaxStep(flax_model, x, y)
    del flax_model
    t0 = time.perf_counter()
    first_loss = ours.run()
    notes = [f"flax_ln first step (trace + XLA compile + run): {time.perf_counter() - t0:.1f} s"]
    eager = torch_music_step(torch_twin(), x, y)
    notes.append(f"first-step losses (dropout on, different masks): flax_ln {first_loss:.4f}, torch {eager():.4f}")
    name = "flax_ln (jit)"
    candidates = {name: ours.run, "torch_ref eager (the book's loop)": eager}
    if cfg.torch_compile:
        compiled_model = torch_twin()
        compiled = torch_music_step(compiled_model, x, y, forward=torch.compile(compiled_model))
        add_torch_compile(candidates, notes, "torch.compile(model)", compiled)
    else:
        notes.append("torch.compile skipped (--quick or --no-torch-compile)")
    warmup = cfg.warmup if cfg.quick else 1  # every candidate has already run once
    t = interleaved(candidates, repeats, warmup)
    tokens = batch * seq_len
    rows = [[cand, tokens / t[cand].median, t[cand].median, t[name].median / t[cand].median] for cand in candidates]
    notes.insert(
        0,
        (
            f"GPTConfig.music{'' if not cfg.quick else ' (toy under --quick)'}: {config.n_layer} layers, "
            f"{config.n_head} heads, n_embd {config.n_embd}, vocab {config.vocab_size}, "
            f"block_size {config.block_size}; "
            f"B={batch}, T={seq_len} ({tokens} tokens per step), float32, dropout {config.attn_pdrop} on in both "
            f"frameworks; median of {repeats} interleaved steps after {warmup} warm-up; "
            f"torch on {device} ({torch.get_num_threads()} CPU threads); JAX on {jax.default_backend()}"
        ),
    )
    return [
        Table(
            "Music Transformer training throughput (chapter 14 loop, higher tokens/s is better)",
            ["candidate", "tokens/s", "median step s", "flax_ln step time / this (lower is better for flax_ln)"],
            rows,
            notes,
        ),
        Table(
            "Music Transformer training step: raw timings",
            ["candidate", "median ms", "p25-p75 ms", "ratio to flax_ln"],
            timing_rows(t, name),
        ),
    ]
