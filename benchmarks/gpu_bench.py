"""Accelerator measurements, run by benchmarks/gpu.sh on a lent H200.

Usage: python benchmarks/gpu_bench.py [--dry-run] [--json PATH]

1. LayerNorm bandwidth: bytes moved / time for flax_ln's forward and backward, as a
   fraction of a measured device-to-device copy of the same bytes (targets: forward
   >= 90 %, backward >= 75 %).
2. GPT-2 124M training step in bfloat16 (float32 parameters): tokens/s and MFU
   against the H200's dense bf16 peak (target: MFU >= 0.5); see ``gpt2_train_step``.

``--dry-run`` runs everything on the CPU on tiny sizes, so the script can be checked
on a machine without an accelerator; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from naive import naive_normalize

import flax_ln

# Peak dense bf16 throughput of one H200 SXM (NVIDIA's datasheet, without sparsity), for MFU.
H200_PEAK_BF16_FLOPS = 989e12


def time_per_call(fn, *args, calls: int, repeats: int) -> float:
    """Median seconds per call of ``fn(*args)``, timing ``calls`` back-to-back launches per sample.

    Back-to-back launches hide the host's dispatch time behind the device's work, which
    is what bandwidth means; one sync per sample keeps the measurement honest.
    """
    jax.block_until_ready(fn(*args))  # compile and warm up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def layernorm_bandwidth(shapes, dtypes, calls: int, repeats: int) -> list[dict]:
    """One row per (shape, dtype): copy, forward and backward bandwidth and their ratios."""
    rows = []
    for n, d in shapes:
        for dtype in dtypes:
            key_x, key_g = jax.random.split(jax.random.key(0))
            x = jax.random.normal(key_x, (n, d), jnp.float32).astype(dtype)
            g = jax.random.normal(key_g, (n, d), jnp.float32).astype(dtype)
            module = flax_ln.LayerNorm(d, dtype=dtype)
            graphdef, state = nnx.split(module)

            def forward(state, x):
                return nnx.merge(graphdef, state)(x)

            def backward(state, x, g):  # the VJP alone: the forward output is dead and removed
                return jax.vjp(forward, state, x)[1](g)

            scale, offset = jnp.ones((d,), jnp.float32), jnp.zeros((d,), jnp.float32)

            def naive(x, scale, offset):
                return naive_normalize(x.astype(jnp.float32), scale, offset).astype(dtype)

            def naive_backward(x, g):
                return jax.vjp(naive, x, scale, offset)[1](g)

            copy = jax.jit(jnp.copy)
            negate = jax.jit(jnp.negative)
            fwd = jax.jit(forward)
            bwd = jax.jit(backward)
            nbytes = x.size * x.dtype.itemsize
            t_copy = min(
                time_per_call(copy, x, calls=calls, repeats=repeats),
                time_per_call(negate, x, calls=calls, repeats=repeats),
            )
            t_fwd = time_per_call(fwd, state, x, calls=calls, repeats=repeats)
            t_bwd = time_per_call(bwd, state, x, g, calls=calls, repeats=repeats)
            t_naive_bwd = time_per_call(jax.jit(naive_backward), x, g, calls=calls, repeats=repeats)
            copy_bw = 2 * nbytes / t_copy  # read x, write the copy
            fwd_bw = 2 * nbytes / t_fwd  # read x, write y
            bwd_bw = 3 * nbytes / t_bwd  # read x and g, write dx (d_scale, d_offset are tiny)
            rows.append(
                dict(
                    shape=f"{n}x{d}",
                    dtype=jnp.dtype(dtype).name,
                    copy_GBps=copy_bw / 1e9,
                    fwd_GBps=fwd_bw / 1e9,
                    fwd_frac=fwd_bw / copy_bw,
                    bwd_GBps=bwd_bw / 1e9,
                    bwd_frac=bwd_bw / copy_bw,
                    naive_autodiff_bwd_frac=3 * nbytes / t_naive_bwd / copy_bw,
                )
            )
    return rows


# ==== GPT-2 124M bf16 training step (tokens/s, MFU) ===================================
def gpt2_flops_per_token(n_matmul_params: int, n_layer: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs per token, the PaLM/nanoGPT count: ``6 N + 12 L C T``.

    ``6 N``: forward (2 N) and backward (4 N) multiply-adds of every matmul weight;
    ``12 L C T``: the attention scores and the weighted sum (``q kᵀ`` and ``p v``, 2 L C T
    each forward, twice that backward), counted without the causal half-skip, as nanoGPT
    does. ``N`` excludes the embedding tables (look-ups, not matmuls) and includes the
    book's untied ``lm_head`` (a matmul).
    """
    return 6 * n_matmul_params + 12 * n_layer * n_embd * seq_len


def gpt2_train_step(dry_run: bool) -> list[dict]:
    """GPT-2 124M training steps in bfloat16 compute (float32 parameters and Adam state): tokens/s and MFU.

    The step is ``flax_ln.make_train_step(gpt_loss, gpt_adam())``: forward, backward,
    torch-style clip to norm 1 and Adam, jitted on the functional split with the state
    donated, launched back to back (the host never waits between steps, as in a training
    loop) and synchronised once per sample. Rows: dropout 0 (the usual MFU setting) and
    the book's dropout 0.1. ``mfu = tokens/s * gpt2_flops_per_token / H200_PEAK_BF16_FLOPS``.
    """
    import dataclasses

    import numpy as np

    if dry_run:
        base = flax_ln.GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64)
        batch, seq_len, calls, repeats, name = 2, 64, 2, 2, "tiny (dry run)"
    else:
        base = flax_ln.GPTConfig.gpt2()
        batch, seq_len, calls, repeats, name = 16, 1024, 10, 5, "GPT-2 124M"
    rng = np.random.default_rng(0)
    tokens = {k: jnp.asarray(rng.integers(0, base.vocab_size, (batch, seq_len)), jnp.int32) for k in ("idx", "targets")}
    rows = []
    for dropout in (0.0, 0.1):
        config = dataclasses.replace(base, embd_pdrop=dropout, resid_pdrop=dropout, attn_pdrop=dropout)
        model = flax_ln.GPT(config, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        n_matmul = n_params - model.transformer.wte.embedding.size - model.transformer.wpe.embedding.size
        tx = flax_ln.gpt_adam()
        step = flax_ln.make_train_step(flax_ln.gpt_loss, tx)
        graphdef, state = flax_ln.init_train_state(model, tx)
        del model
        t0 = time.perf_counter()
        state, loss = step(graphdef, state, tokens)
        jax.block_until_ready(loss)
        compile_s = time.perf_counter() - t0
        state, loss = step(graphdef, state, tokens)  # one more warm-up
        jax.block_until_ready(loss)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                state, loss = step(graphdef, state, tokens)
            jax.block_until_ready(loss)
            samples.append((time.perf_counter() - t0) / calls)
        step_s = statistics.median(samples)
        tokens_per_s = batch * seq_len / step_s
        flops = gpt2_flops_per_token(n_matmul, config.n_layer, config.n_embd, seq_len)
        rows.append(
            dict(
                config=name,
                dropout=dropout,
                batch=batch,
                seq_len=seq_len,
                params=n_params,
                step_ms=step_s * 1e3,
                tokens_per_s=tokens_per_s,
                mfu=tokens_per_s * flops / H200_PEAK_BF16_FLOPS,
                first_step_s=compile_s,
                loss=float(loss),
            )
        )
        del state
    return rows


# ==== end of GPT-2 ===================================================================


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n### {title}\n")
    if not rows:
        print("(no rows)")
        return
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the script, not the device")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)

    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
        shapes, dtypes, calls, repeats = [(64, 256)], [jnp.float32, jnp.bfloat16], 2, 2
    else:
        # 256 MiB float32 arrays: far beyond the 50 MB L2, so every kernel streams HBM.
        shapes, dtypes, calls, repeats = (
            [(65536, 1024), (16384, 4096), (131072, 768)],
            [jnp.float32, jnp.bfloat16],
            20,
            7,
        )
        if jax.default_backend() == "cpu":
            print(
                "error: JAX sees no accelerator (devices: %s); use --dry-run on a CPU machine" % jax.devices(),
                file=sys.stderr,
            )
            return 2
    print(
        f"devices {jax.devices()}; jax {jax.__version__}; backend {jax.default_backend()}"
        f"{' (DRY RUN: CPU, tiny sizes, numbers mean nothing)' if args.dry_run else ''}"
    )
    ln_rows = layernorm_bandwidth(shapes, dtypes, calls, repeats)
    print_table("LayerNorm bandwidth vs device copy (targets: fwd_frac >= 0.90, bwd_frac >= 0.75)", ln_rows)
    gpt_rows = gpt2_train_step(args.dry_run)
    print_table("GPT-2 124M bf16 training step (target mfu >= 0.5)", gpt_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "devices": str(jax.devices()),
                    "layernorm": ln_rows,
                    "gpt2": gpt_rows,
                    "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_PLATFORMS")},
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
