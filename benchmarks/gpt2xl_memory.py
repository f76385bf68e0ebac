"""Peak host memory (RSS) of one full GPT-2XL forward pass in flax_ln on the CPU.

float32 parameters, eval mode, scanned layers, jitted forward on the functional split.
The peak RSS is read from /proc/self/status (VmHWM); it is reset after building the
model (writing 5 to /proc/self/clear_refs) so the forward's own peak is reported apart
from the initialisation's.

    python benchmarks/gpt2xl_memory.py [--seq-len 1024] [--batch 1]
"""

from __future__ import annotations

import argparse
import time


def rss_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--scan-layers", type=int, default=1)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import flax_ln

    config = flax_ln.GPTConfig.gpt2_xl()
    t0 = time.perf_counter()
    model = flax_ln.GPT(config, scan_layers=bool(args.scan_layers), rngs=nnx.Rngs(0))
    model.eval()
    jax.block_until_ready(nnx.state(model))
    t1 = time.perf_counter()
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    init_peak, after_init = rss_gib("VmHWM"), rss_gib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, idx: nnx.merge(graphdef, state)(idx)[0])
    idx = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq_len)), jnp.int32)
    t2 = time.perf_counter()
    compiled = forward.lower(state, idx).compile()
    t3 = time.perf_counter()
    logits = jax.block_until_ready(compiled(state, idx))
    t4 = time.perf_counter()
    assert logits.shape == (args.batch, args.seq_len, config.vocab_size) and bool(jnp.isfinite(logits).all())
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, GPT-2XL {n_params / 1e9:.3f}B params float32, "
        f"scan_layers={bool(args.scan_layers)}, batch {args.batch}, seq_len {args.seq_len}"
    )
    print(f"init: {t1 - t0:.1f} s, peak RSS {init_peak:.2f} GiB, RSS after init {after_init:.2f} GiB")
    print(
        f"forward: compile {t3 - t2:.1f} s, run {t4 - t3:.1f} s, peak RSS during compile+forward "
        f"{rss_gib('VmHWM'):.2f} GiB (parameters alone: {n_params * 4 / 2**30:.2f} GiB)"
    )


if __name__ == "__main__":
    main()
