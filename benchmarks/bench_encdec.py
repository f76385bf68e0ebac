"""Chapter 10's encoder-decoder training step against PyTorch.

Row ``encdec-train-step`` (float32, this CPU; ``--quick`` shrinks the model to a toy):
the book's chapter-10 model, ``make_model(src_vocab=11055, tgt_vocab=11239, N=6,
d_model=256, d_ff=1024, h=8, dropout=0.1)`` (the vocabulary sizes of the book's
English-French subword dictionaries), B=32 sentence pairs, source and target length 32
with some padding, **dropout 0.1 on in both frameworks**. One step is the book's:
forward, ``Generator`` log-probabilities, label smoothing 0.1 (KL divergence summed,
padding index 0) divided by the token count, backward, and Adam (betas 0.9/0.98, eps
1e-9) at the Noam rate (factor 1, warm-up 2000) of that step.

* flax_ln: ``make_train_step(encoder_decoder_loss(padding_idx=0, smoothing=0.1),
  noam_adam(256))`` on the functional split, state donated; the batch (masks, token
  count) is built once by ``flax_ln.train.make_batch``, as the torch batch is.
* torch: ``torch_ref.make_model`` with ``torch_ref.LabelSmoothing`` as the criterion and
  ``torch.optim.Adam(lr=0, betas=(0.9, 0.98), eps=1e-9)`` whose rate is set to
  ``torch_ref.noam_rate(step, 256)`` before each step, as the book's ``NoamOpt`` does;
  eager, and with ``torch.compile`` of the forward + generator + criterion (the
  optimizer step stays eager, as in ``gpt-train-step``).

Both sides start from the same weights (``flax_ln.load_torch_state_dict``). Targets:
<= 0.9x eager, <= 1.0x compile.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    Config,
    Table,
    add_torch_compile,
    interleaved,
    one_thread,
    plain_linear_products,
    ratio_row,
    register,
    timing_rows,
    torch_device,
)
from flax import nnx

import flax_ln
from flax_ln.train import encoder_decoder_loss, init_train_state, make_batch, make_train_step, noam_adam

PAD = 0
SMOOTHING = 0.1  # chapter 10's label smoothing
WARMUP = 2000  # chapter 10's Noam warm-up
# Chapter 10: the book's English and French subword dictionaries hold 11055 and 11239 tokens.
BOOK_SIZES = dict(src_vocab=11055, tgt_vocab=11239, N=6, d_model=256, d_ff=1024, h=8)
TOY_SIZES = dict(src_vocab=64, tgt_vocab=72, N=1, d_model=32, d_ff=64, h=4)
MAX_REPEATS = 5  # keeps the full row under a few minutes on 2 cores


def sentence_batch(sizes: dict, batch: int, seq_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random ``src`` (B, S) and ``tgt`` (B, S+1) ids in ``[1, vocab)``, each row padded with 0 after a random length.

    Lengths are drawn in ``[S/2, S]``, so the masks and the ignored targets are exercised as
    in real batches of sentences of varied length.
    """
    rng = np.random.default_rng(seed)
    src = rng.integers(1, sizes["src_vocab"], (batch, seq_len))
    tgt = rng.integers(1, sizes["tgt_vocab"], (batch, seq_len + 1))
    for ids in (src, tgt):
        lengths = rng.integers(seq_len // 2, ids.shape[1] + 1, batch)
        ids[np.arange(ids.shape[1]) >= lengths[:, None]] = PAD
    return src, tgt


class FlaxEncDecStep:
    """flax_ln's chapter-10 step with its state threaded through donated calls: ``run()`` does one step."""

    def __init__(self, model, src: np.ndarray, tgt: np.ndarray, d_model: int):
        tx = noam_adam(d_model, warmup=WARMUP)
        self.step = make_train_step(encoder_decoder_loss(padding_idx=PAD, smoothing=SMOOTHING), tx)
        self.graphdef, self.state = init_train_state(model, tx)
        self.batch = make_batch(jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32), PAD)

    def run(self) -> float:
        self.state, loss = self.step(self.graphdef, self.state, self.batch)
        return float(loss)  # waits for the step


def torch_encdec_step(model, src: np.ndarray, tgt: np.ndarray, d_model: int, compile_forward: bool = False):
    """The book's chapter-10 step in torch: label smoothing / ntokens, backward, Adam at the Noam rate.

    With ``compile_forward`` the forward, the generator and the criterion are one
    ``torch.compile``d function; the optimizer step stays eager.
    """
    import torch

    import torch_ref

    device = next(model.parameters()).device
    vocab = model.generator.proj.out_features
    criterion = torch_ref.LabelSmoothing(vocab, padding_idx=PAD, smoothing=SMOOTHING)
    opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    src_t, tgt_t = torch.as_tensor(src, device=device), torch.as_tensor(tgt, device=device)
    tgt_in, tgt_y = tgt_t[:, :-1], tgt_t[:, 1:]
    src_mask = (src_t != PAD).unsqueeze(-2)  # (B, 1, S)
    tgt_mask = torch_ref.make_std_mask(tgt_in, PAD)  # (B, T, T)
    ntokens = (tgt_y != PAD).sum()

    def forward_loss(src, tgt_in, src_mask, tgt_mask, tgt_y):
        log_probs = model.generator(model(src, tgt_in, src_mask, tgt_mask))  # (B, T, V)
        return criterion(log_probs.reshape(-1, vocab), tgt_y.reshape(-1)) / ntokens

    forward = torch.compile(forward_loss) if compile_forward else forward_loss
    step = 0

    def run() -> float:
        nonlocal step
        step += 1
        for group in opt.param_groups:  # the book's NoamOpt: set the rate, then step
            group["lr"] = torch_ref.noam_rate(step, d_model, 1.0, WARMUP)
        loss = forward(src_t, tgt_in, src_mask, tgt_mask, tgt_y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # waits for the step (also on a GPU)

    return run


@register("encdec-train-step")
def encdec_train_step(cfg: Config) -> list[Table]:
    import torch

    import torch_ref

    sizes, batch, seq_len = (TOY_SIZES, 4, 8) if cfg.quick else (BOOK_SIZES, 32, 32)
    repeats = cfg.repeats if cfg.quick else min(cfg.repeats, MAX_REPEATS)
    src, tgt = sentence_batch(sizes, batch, seq_len)
    torch.manual_seed(0)
    reference = torch_ref.make_model(**sizes, dropout=0.1).train()
    device = torch_device()

    def torch_twin():
        model = torch_ref.make_model(**sizes, dropout=0.1).train()
        model.load_state_dict(reference.state_dict())
        return model.to(device)

    def flax_twin():
        model = flax_ln.make_model(**sizes, dropout=0.1, rngs=nnx.Rngs(0))
        flax_ln.load_torch_state_dict(model, reference.state_dict())
        model.train()
        return FlaxEncDecStep(model, src, tgt, sizes["d_model"])

    ours = flax_twin()
    with plain_linear_products():
        before = flax_twin()
    t0 = time.perf_counter()
    first_loss = ours.run()
    notes = [f"flax_ln first step (trace + XLA compile + run): {time.perf_counter() - t0:.1f} s"]
    eager = torch_encdec_step(torch_twin(), src, tgt, sizes["d_model"])
    torch_first = eager()
    notes.append(f"first-step losses (dropout on, different masks): flax_ln {first_loss:.4f}, torch {torch_first:.4f}")

    before.run()
    name, before_name = "flax_ln (jit)", "flax_ln, plain lax.dot_general in nnx.Linear (before)"
    candidates = {name: ours.run, before_name: before.run, "torch_ref eager": eager}
    if device == "cpu":
        candidates["torch_ref eager, 1 thread"] = one_thread(eager)
    if cfg.torch_compile:
        compiled = torch_encdec_step(torch_twin(), src, tgt, sizes["d_model"], compile_forward=True)
        add_torch_compile(candidates, notes, "torch.compile(forward + generator + criterion)", compiled)
    else:
        notes.append("torch.compile skipped (--quick or --no-torch-compile)")
    t = interleaved(candidates, repeats, cfg.warmup)
    n_params = sum(p.numel() for p in reference.parameters())
    notes.insert(
        0,
        (
            f"make_model(src_vocab={sizes['src_vocab']}, tgt_vocab={sizes['tgt_vocab']}, N={sizes['N']}, "
            f"d_model={sizes['d_model']}, d_ff={sizes['d_ff']}, h={sizes['h']}), {n_params:,} parameters; B={batch}, "
            f"source and target length {seq_len} (rows padded after a random length), float32, dropout 0.1 on in both "
            f"frameworks; label smoothing {SMOOTHING} / ntokens, Adam(0.9, 0.98, 1e-9) at the Noam rate "
            f"(warm-up {WARMUP}); median of {repeats} interleaved steps after {cfg.warmup} warm-up; "
            f"torch on {device} ({torch.get_num_threads()} CPU threads); JAX on {jax.default_backend()}"
        ),
    )
    best_eager = min((k for k in ("torch_ref eager", "torch_ref eager, 1 thread") if k in t), key=lambda k: t[k].median)
    if device == "cpu":
        notes.append("the eager target is taken against the faster of torch's default thread count and 1 thread")
    rows = [ratio_row("encoder-decoder train step", name, t[name], best_eager, t[best_eager], 0.9)]
    if "torch.compile(torch_ref)" in t:
        rows.append(
            ratio_row(
                "encoder-decoder train step",
                name,
                t[name],
                "torch.compile(torch_ref)",
                t["torch.compile(torch_ref)"],
                1.0,
            )
        )
    rows.append(ratio_row("encoder-decoder train step", name, t[name], before_name, t[before_name], None))
    return [
        Table(
            "Encoder-decoder training step (chapter 10: fwd+bwd, label smoothing, Noam Adam): ratios (lower is better)",
            ["workload", "comparison", "ratio", "target", "met"],
            rows,
            notes,
        ),
        Table(
            "Encoder-decoder training step: raw timings",
            ["candidate", "median ms", "p25-p75 ms", "ratio to flax_ln"],
            timing_rows(t, name),
        ),
    ]
