"""XLA compile time of a GPT-2XL training step (forward + backward), scanned vs unrolled layers.

Each measurement runs in a fresh subprocess (no warm caches) on abstract inputs:
the model is built with ``nnx.eval_shape`` and the jitted step is lowered from
``jax.ShapeDtypeStruct``s, so the 1.5B parameters are never materialised. Reported:
``lower`` (tracing to StableHLO) and ``compile`` (XLA) seconds.

    python benchmarks/compile_time.py                 # 1 and 48 layers scanned, 48 unrolled (6 min cap)
    python benchmarks/compile_time.py --case scan 48  # one measurement, printed as JSON

``run_case`` (one fresh subprocess per measurement) is also what ``benchmarks/bench_gpt.py``
reports in ``benchmarks/run.py``; ``--tiny`` swaps GPT-2XL for a 64-wide model (smoke tests).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(layout: str, n_layer: int, batch: int, seq_len: int, tiny: bool = False) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import flax_ln

    config = flax_ln.GPTConfig.gpt2_xl(n_layer=n_layer)
    if tiny:  # smoke-test size: same code path, seconds to compile
        config = flax_ln.GPTConfig(n_layer=n_layer, n_head=4, n_embd=64, vocab_size=256, block_size=max(seq_len, 1))
    model = nnx.eval_shape(lambda: flax_ln.GPT(config, scan_layers=layout == "scan", rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # training mode: dropout on

    def loss_fn(params, rest, idx, targets):
        model = nnx.merge(graphdef, params, rest, copy=True)  # fresh Variables: dropout may advance their RNG
        _, loss = model(idx, targets)
        return loss, nnx.state(model, nnx.RngState)

    @jax.jit
    def train_grads(params, rest, idx, targets):
        return jax.value_and_grad(loss_fn, has_aux=True)(params, rest, idx, targets)

    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    t0 = time.perf_counter()
    lowered = train_grads.lower(params, rest, tokens, tokens)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return {"layout": layout, "n_layer": n_layer, "params": n_params, "lower_s": t1 - t0, "compile_s": t2 - t1}


def run_case(
    layout: str, n_layer: int, batch: int = 1, seq_len: int = 1024, *, timeout: float | None = None, tiny: bool = False
) -> dict | None:
    """:func:`measure` in a fresh Python process (no warm caches); ``None`` if it ran past ``timeout`` seconds."""
    cmd = [sys.executable, __file__, "--case", layout, str(n_layer), "--batch", str(batch), "--seq-len", str(seq_len)]
    try:
        out = subprocess.run(
            cmd + (["--tiny"] if tiny else []), capture_output=True, text=True, timeout=timeout, check=True
        ).stdout
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", nargs=2, metavar=("LAYOUT", "N_LAYER"), help="scan|unrolled and a layer count")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true", help="a 64-wide model instead of GPT-2XL (smoke test)")
    parser.add_argument(
        "--unrolled-timeout", type=float, default=360.0, help="seconds before the unrolled case is cut off"
    )
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(args.case[0], int(args.case[1]), args.batch, args.seq_len, args.tiny)))
        return

    import flax
    import jax

    print(
        f"jax {jax.__version__}, flax {flax.__version__}, backend {jax.default_backend()}, "
        f"GPT-2XL, batch {args.batch}, seq_len {args.seq_len}, float32, loss + grads w.r.t. all parameters"
    )
    print("| layers | layout | lower (s) | XLA compile (s) | total (s) |")
    print("|---|---|---|---|---|")
    results = {}
    for layout, n_layer, timeout in [
        ("scan", 1, None),
        ("scan", 48, None),
        ("unrolled", 1, None),
        ("unrolled", 48, args.unrolled_timeout),
    ]:
        start = time.perf_counter()
        r = run_case(layout, n_layer, args.batch, args.seq_len, timeout=timeout, tiny=args.tiny)
        if r is None:
            print(f"| {n_layer} | {layout} | | cut off after {time.perf_counter() - start:.0f} s | |", flush=True)
            continue
        results[(layout, n_layer)] = r
        print(
            f"| {n_layer} | {layout} | {r['lower_s']:.2f} | {r['compile_s']:.2f} | "
            f"{r['lower_s'] + r['compile_s']:.2f} |",
            flush=True,
        )
    one, deep = results[("scan", 1)], results[("scan", 48)]
    ratio = (deep["lower_s"] + deep["compile_s"]) / (one["lower_s"] + one["compile_s"])
    print(f"\nscanned 48 layers / 1 layer (lower + compile): {ratio:.2f}x (target <= 3x)")


if __name__ == "__main__":
    main()
